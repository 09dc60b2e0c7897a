"""The problems a run trains and evaluates on, by `data.source`: generated (`arithmetic`), a built-in preset over
the vendored files (`gsm8k`, `mawps`), or any dataset (`dataset`: a hub id, a local folder or files)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from lora_rl_core.config import DataConfig, RolloutConfig
from lora_rl_core.data.arithmetic import arithmetic_split
from lora_rl_core.data.problems import Problem
from lora_rl_core.data.sources import GSM8K_INSTRUCTION, PRESETS, DatasetSpec, read_problems


def load_problems(cfg: DataConfig, split: Literal["train", "test"], seed: int) -> list[Problem]:
    """Training or held-out problems of the `data` section (held-out: the first `eval_size`).

    Raises:
        DataError: a missing dataset, file, split or column, an empty split, or a malformed row.
    """
    if cfg.source == "arithmetic":
        size = cfg.train_size if split == "train" else (cfg.eval_size or 128)
        return arithmetic_split(cfg.operations, cfg.digits, split=split, size=size, seed=seed)
    return read_problems(dataset_spec(cfg), split, limit=cfg.eval_size if split == "test" else None)


def dataset_spec(cfg: DataConfig) -> DatasetSpec:
    """Where `cfg`'s dataset lives and how to read it: a preset's files and columns, or the user's settings."""
    files = {k: v for k, v in (("train", cfg.train_path), ("test", cfg.test_path)) if v}
    if cfg.source in PRESETS:
        preset = PRESETS[cfg.source]
        for split in ("train", "test"):
            files.setdefault(split, str(Path(cfg.data_dir) / preset.folder / f"{split}.jsonl"))
        return DatasetSpec(
            label=cfg.source,
            path=None,
            name=None,
            files=files,
            splits={"train": "train", "test": "test"},
            prompt_column=preset.prompt_column,
            answer_column="answer",
            answer_format=preset.answer_format,
        )
    if cfg.path and Path(cfg.path).is_file():
        files.setdefault("train", cfg.path)  # one local file is the train split; test_path names held-out rows
    return DatasetSpec(
        label=_label(cfg.path or cfg.train_path or "dataset"),
        path=cfg.path,
        name=cfg.name,
        files=files,
        splits={"train": cfg.train_split, "test": cfg.test_split},
        prompt_column=cfg.prompt_column,
        answer_column=cfg.answer_column,
    )


def prompt_instruction(data: DataConfig, rollout: RolloutConfig) -> str:
    """The instruction appended to each prompt: `rollout.instruction` if set, else the source's own (the
    built-in math sources ask for the answer after `####`; a user's dataset gets none)."""
    if rollout.instruction is not None:
        return rollout.instruction
    return "" if data.source == "dataset" else GSM8K_INSTRUCTION


def _label(path: str) -> str:
    """A short name for problem ids: the last part of a hub id or path, without a file suffix."""
    return Path(path.rstrip("/")).stem or "dataset"
