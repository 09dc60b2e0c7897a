"""The ``Problem`` record and loaders for the vendored JSONL datasets.

Formats (see ``data/README.md``):

* ``gsm8k``: ``{"question", "answer"}`` where ``answer`` is a worked solution
  ending in ``#### <number>``; the gold answer is the text after the last
  ``####``.
* ``mawps``: ``{"question", "answer", "equation_prefix"}`` where ``answer`` is
  the number as text, used as is.

Blank lines are skipped. Every malformed row raises ``DataError`` naming the
file and 1-based line number. Problem ids are ``"{kind}-{file stem}-{row}"``
with a 0-based row index, e.g. ``"gsm8k-test-17"``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from lora_rl_core.errors import DataError

DATASETS: tuple[str, ...] = ("gsm8k", "mawps")
SPLITS: tuple[str, ...] = ("train", "test")


@dataclass(frozen=True)
class Problem:
    """One prompt with its gold answer.

    Attributes:
        question: the text shown to the model.
        answer: the gold final answer as text, e.g. ``"68"``, ``"1,250"``, ``"3/4"``.
        id: a stable id, e.g. ``"gsm8k-test-17"`` or ``"arith-add-2d-s0-5"``.
    """

    question: str
    answer: str
    id: str


def _parse_row(line: str, where: str) -> dict:
    """Decode one JSONL line into a dict; raise ``DataError`` naming ``where``."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError as err:
        raise DataError(f"{where}: invalid JSON ({err.msg}); fix or remove this line") from None
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(row).__name__}")
    return row


def _field(row: dict, name: str, where: str) -> str:
    """Return ``row[name]`` as text; raise ``DataError`` if missing or not text/number."""
    if name not in row:
        raise DataError(f"{where}: row has no '{name}' field; each row needs 'question' and 'answer'")
    value = row[name]
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise DataError(f"{where}: field '{name}' must be a string, got {type(value).__name__}")
    return str(value)


def _gold_answer(solution: str, kind: str, where: str) -> str:
    """Extract the gold answer from a row's ``answer`` field for dataset ``kind``."""
    if kind == "mawps":
        answer = solution.strip()
    elif "####" not in solution:
        raise DataError(f"{where}: gsm8k answer has no '####' before the final answer; is this a gsm8k file?")
    else:
        answer = solution.rsplit("####", 1)[1].strip()
    if not answer:
        raise DataError(f"{where}: empty answer; give the final answer as text")
    return answer


def _open_lines(path: Path) -> list[str]:
    """Read ``path`` as UTF-8 lines; raise ``DataError`` if it is missing or unreadable."""
    if not path.is_file():
        raise DataError(f"dataset file not found: {path} (check the dataset path in the config)")
    try:
        return path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as err:
        raise DataError(f"cannot read dataset file {path}: {err}") from None


def load_jsonl_problems(
    path: str | Path, kind: Literal["gsm8k", "mawps"], *, limit: int | None = None
) -> list[Problem]:
    """Load problems from a JSONL file in the ``gsm8k`` or ``mawps`` format.

    Args:
        path: the ``.jsonl`` file.
        kind: ``"gsm8k"`` (answer after the last ``####``) or ``"mawps"`` (answer as is).
        limit: keep only the first ``limit`` rows (``None``: all); must be >= 1.

    Returns:
        The problems in file order, ids ``"{kind}-{file stem}-{row index}"``.

    Raises:
        DataError: unknown kind, bad limit, missing file, invalid JSON, a row without
            ``question``/``answer``, a gsm8k answer without ``####``, or no rows.
    """
    if kind not in DATASETS:
        raise DataError(f"unknown dataset kind {kind!r}; valid kinds: {', '.join(DATASETS)}")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise DataError(f"limit must be a positive integer or None, got {limit!r}")
    path = Path(path)
    problems: list[Problem] = []
    for line_no, line in enumerate(_open_lines(path), start=1):
        if limit is not None and len(problems) >= limit:
            break
        if not line.strip():
            continue
        where = f"{path}:{line_no}"
        row = _parse_row(line, where)
        question = _field(row, "question", where)
        answer = _gold_answer(_field(row, "answer", where), kind, where)
        problems.append(Problem(question, answer, f"{kind}-{path.stem}-{len(problems)}"))
    if not problems:
        raise DataError(f"dataset file {path} has no rows; expected one JSON object per line")
    return problems


def load_dataset(
    name: str,
    split: Literal["train", "test"],
    *,
    path: str | Path | None = None,
    limit: int | None = None,
    data_dir: str | Path = "data",
) -> list[Problem]:
    """Load a named dataset split.

    Args:
        name: ``"gsm8k"`` or ``"mawps"`` (also the row format).
        split: ``"train"`` or ``"test"``.
        path: the file to read; default ``{data_dir}/{name}/{split}.jsonl``.
        limit: keep only the first ``limit`` rows.
        data_dir: the folder holding the vendored datasets.

    Returns:
        The problems, as from ``load_jsonl_problems``.

    Raises:
        DataError: unknown name or split, or any error of ``load_jsonl_problems``.
    """
    if name not in DATASETS:
        raise DataError(f"unknown dataset {name!r}; valid names: {', '.join(DATASETS)}")
    if split not in SPLITS:
        raise DataError(f"unknown split {split!r}; valid splits: {', '.join(SPLITS)}")
    if path is None:
        path = Path(data_dir) / name / f"{split}.jsonl"
    return load_jsonl_problems(path, name, limit=limit)  # type: ignore[arg-type]
