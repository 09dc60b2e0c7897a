"""Any dataset as problems, through Hugging Face `datasets`, in TRL's two prompt formats.

`read_problems(spec, split)` loads one split of a hub dataset (`path` a hub id, `name` its config), a local
folder (`datasets` infers the builder), or local files (`.jsonl`, `.json`, `.parquet`, `.csv`; `train_path` /
`test_path` name a file per split), and turns each row into a `Problem`:

* the prompt is the `prompt_column`: text (TRL's standard format) or a list of `{"role", "content"}` messages
  (TRL's conversational format, rendered later with the tokenizer's chat template);
* the gold answer is the `answer_column` if the dataset has it (optional: a reward may need none), as text,
  after the preset's `answer_format` (`gsm8k`: the text after the last `####`);
* every other column of the row travels with it (`Problem.columns`), for reward functions that take them.

The built-in sources are presets over the same path (`PRESETS`: the vendored GSM8K and MAWPS JSONL files in
`data/`); `arithmetic` is generated (`lora_rl_core.data.arithmetic`). A missing file or column, an empty split
or a malformed row is a `DataError` naming the file (or dataset and split), the row and the column.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from lora_rl_core.data.problems import Problem
from lora_rl_core.errors import DataError

FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
"""`datasets` builder for a local file, by suffix."""
GSM8K_INSTRUCTION = "Give the final answer after ####."


@dataclass(frozen=True)
class DatasetSpec:
    """Where one dataset lives and how its rows become problems (from `DataConfig`, or a preset).

    Attributes:
        label: how errors and problem ids name the dataset (`gsm8k`, or the path's last part).
        path: hub id, local folder or local file (None: only `files`).
        name: the dataset's config (`datasets.load_dataset(path, name)`).
        files: a local file per split (`train_path`, `test_path`); wins over `path` for that split.
        splits: the split names to read for `train` and `test`.
        prompt_column / answer_column: the columns of the prompt and the gold answer.
        answer_format: `plain` (the column as text) or `gsm8k` (the text after the last `####`).
    """

    label: str
    path: str | None
    name: str | None
    files: dict[str, str]
    splits: dict[str, str]
    prompt_column: str = "prompt"
    answer_column: str = "answer"
    answer_format: Literal["plain", "gsm8k"] = "plain"


@dataclass(frozen=True)
class Preset:
    """A built-in data source: its vendored files (`<data_dir>/<folder>/<split>.jsonl`), columns, answer format
    and the instruction its prompts get (`rollout.instruction` unset)."""

    folder: str
    prompt_column: str
    answer_format: Literal["plain", "gsm8k"]
    instruction: str = GSM8K_INSTRUCTION


PRESETS: dict[str, Preset] = {
    "gsm8k": Preset("gsm8k", "question", "gsm8k"),
    "mawps": Preset("mawps", "question", "plain"),
}
"""The built-in sources read from files (`data.source`), over the same loader as any dataset."""


def read_problems(spec: DatasetSpec, split: Literal["train", "test"], *, limit: int | None = None) -> list[Problem]:
    """The problems of one split, in dataset order; ids `<label>-<split name>-<row index>`.

    Args:
        spec: the dataset.
        split: which of `spec.splits` / `spec.files`.
        limit: keep the first `limit` rows (None: all).

    Raises:
        DataError: the dataset, file, split or a column is missing, the split is empty, or a row is malformed
            (the message names the file or dataset, the row and the column, and the fix).
    """
    rows, where = _load_rows(spec, split)
    if len(rows) == 0:
        raise DataError(f"{where} has no rows; give a split with at least one example")
    columns = list(rows.column_names)
    if spec.prompt_column not in columns:
        raise DataError(
            f"{where} has no column {spec.prompt_column!r} (columns: {columns}); set data.prompt_column to the "
            "column that holds the prompt (text, or a list of {role, content} messages)"
        )
    has_answer = spec.answer_column in columns
    split_name = spec.splits[split] if split not in spec.files else Path(spec.files[split]).stem
    if limit is not None and limit < len(rows):
        rows = rows.select(range(limit))
    problems = []
    for i, row in enumerate(rows):  # iterating reads the Arrow table in batches; rows[i] would slice it per row
        at = f"{where}, row {i}"
        answer = _answer(row[spec.answer_column], spec.answer_format, at, spec.answer_column) if has_answer else None
        problems.append(
            Problem(
                prompt=_prompt(row[spec.prompt_column], at, spec.prompt_column),
                answer=answer,
                id=f"{spec.label}-{split_name}-{i}",
                columns=_columns(row, spec, answer),
            )
        )
    return problems


def _load_rows(spec: DatasetSpec, split: str) -> tuple[Any, str]:
    """The `datasets.Dataset` of `split` and how errors name it."""
    import datasets  # lazy: pulls in pyarrow and pandas

    datasets.disable_progress_bars()
    if split in spec.files:
        path = Path(spec.files[split])
        where = str(path)
        if not path.is_file():
            raise DataError(f"dataset file not found: {path} (check data.{split}_path or data.path)")
        builder = FILE_BUILDERS.get(path.suffix.lower())
        if builder is None:
            raise DataError(f"{path}: unknown file type {path.suffix!r}; use one of {sorted(FILE_BUILDERS)}")
        if path.suffix.lower() == ".jsonl":
            _check_jsonl(path)
        args: tuple[Any, ...] = (builder,)
        kwargs: dict[str, Any] = {"data_files": {"data": str(path)}, "split": "data"}
    else:
        if spec.path is None:
            raise DataError(
                f"no data for the {split} split: set data.path (hub id, folder or file) or data.{split}_path"
            )
        where = f"{spec.path}" + (f" ({spec.name})" if spec.name else "") + f" split {spec.splits[split]!r}"
        args, kwargs = (spec.path, spec.name), {"split": spec.splits[split]}
    try:
        return datasets.load_dataset(*args, **kwargs), where
    except (ValueError, FileNotFoundError, KeyError) as exc:  # unknown split or config, missing files, hub
        raise DataError(f"cannot load {where}: {_first_line(exc)}") from None
    except Exception as exc:  # noqa: BLE001 - a malformed file fails inside datasets' builders in many ways
        raise DataError(f"cannot read {where}: {type(exc).__name__}: {_first_line(exc)}") from None


def _check_jsonl(path: Path) -> None:
    """Every non-blank line of a JSONL file is a JSON object (`datasets` would fail without naming the line).

    Raises:
        DataError: naming the file and the 1-based line.
    """
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise DataError(f"cannot read dataset file {path}: {exc}") from None
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataError(f"{path}:{number}: invalid JSON ({exc.msg}); fix or remove this line") from None
        if not isinstance(row, dict):
            raise DataError(f"{path}:{number}: expected a JSON object, got {type(row).__name__}")


def _prompt(value: Any, at: str, column: str) -> str | list[dict[str, str]]:
    """The prompt as text (standard format) or messages (conversational format)."""
    if isinstance(value, str):
        if not value.strip():
            raise DataError(f"{at}: column {column!r} is empty; every row needs a prompt")
        return value
    if isinstance(value, list) and value and all(_is_message(m) for m in value):
        return [{"role": m["role"], "content": m["content"]} for m in value]
    raise DataError(
        f"{at}: column {column!r} must be text or a list of {{'role', 'content'}} messages, got {_describe(value)}"
    )


def _is_message(value: Any) -> bool:
    return isinstance(value, dict) and isinstance(value.get("role"), str) and isinstance(value.get("content"), str)


def _answer(value: Any, answer_format: str, at: str, column: str) -> str | None:
    """The gold answer as text (None for an empty cell)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise DataError(f"{at}: column {column!r} must be text or a number, got {_describe(value)}")
    if isinstance(value, float) and not math.isfinite(value):
        return None
    text = str(value)
    if answer_format == "gsm8k":
        if "####" not in text:
            raise DataError(f"{at}: column {column!r} has no '####' before the final answer; is this a gsm8k file?")
        text = text.rsplit("####", 1)[1]
    text = text.strip()
    if not text:
        raise DataError(f"{at}: column {column!r} is empty; give the final answer as text")
    return text


def _columns(row: dict[str, Any], spec: DatasetSpec, answer: str | None) -> dict[str, Any]:
    """Every column but the prompt, as `datasets` gives them; the answer column holds the parsed gold answer."""
    out = {k: v for k, v in row.items() if k != spec.prompt_column}
    if spec.answer_column in out:
        out[spec.answer_column] = answer
    return out


def _describe(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:60]}{'...' if len(text) > 60 else ''}"


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__
