"""A tiny-model run config for flow-level tests (CPU, seconds per step)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml


def write_tiny_config(tmp_path: Path, model_dir: Path, name: str, **sections: dict[str, Any]) -> Path:
    """Write `<tmp_path>/<name>.yaml`: the tiny random model, arithmetic data, the digit-fraction reward
    (a random model rarely solves a sum, so the math reward would be all zeros) without the leak check,
    store `<tmp_path>/store`.
    Each keyword updates that section, e.g. `trainer={"steps": 4}`."""
    cfg: dict[str, dict[str, Any]] = {
        "run": {"name": name, "output_dir": str(tmp_path / "runs")},
        "model": {"name_or_path": str(model_dir), "dtype": "float32", "device": "cpu"},
        "lora": {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]},
        # a random model rarely ends a completion within 8 tokens: keep its cut completions in the loss, so every
        # step trains (the default, `mask`, would leave most steps nothing to train on)
        "algorithm": {"skip_uniform_groups": False, "truncation": "keep"},
        "rollout": {"prompts_per_step": 2, "group_size": 4, "max_new_tokens": 8},
        "trainer": {"steps": 2, "lr": 1e-2, "micro_batch_size": 4},
        "data": {"source": "arithmetic", "train_size": 64, "eval_size": 4},
        # The digit fraction pays for restated digits too, a leak by design: the check would stop the run.
        "reward": {"functions": [{"name": "tests.integration.rewards:digit_fraction"}], "leak_check": False},
        "store": {"uri": f"file://{tmp_path / 'store'}"},
    }
    for section, values in sections.items():
        cfg.setdefault(section, {}).update(values)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path
