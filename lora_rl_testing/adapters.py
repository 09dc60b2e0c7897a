"""Random LoRA adapters for tests and benchmarks: `random_lora_factory(model)` makes one version's weights.

Imports only torch (the benchmarks import it from a plain checkout with `PYTHONPATH=.`).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

AdapterFactory = Callable[[int], tuple[dict[str, torch.Tensor], dict[str, Any]]]
"""version -> (PEFT-keyed LoRA state dict, PEFT config dict)."""


def random_lora_factory(
    model: nn.Module, *, rank: int = 2, targets: tuple[str, ...] = ("q_proj", "v_proj"), scale: float = 0.05
) -> AdapterFactory:
    """Random LoRA weights for `model`'s linear `targets`, fresh for each version (seeded by it).

    Keys are PEFT's (`base_model.model.<module>.lora_A.weight` `[r, in]`, `lora_B.weight` `[out, r]`), as
    `get_peft_model_state_dict` gives; B is non-zero, so versions change the outputs.

    Raises:
        ValueError: no linear module of `model` ends with one of `targets`.
    """
    shapes = {
        name: (m.in_features, m.out_features)
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear) and name.rsplit(".", 1)[-1] in targets
    }
    if not shapes:
        raise ValueError(f"no linear module ends with one of {targets}")
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": sorted(targets)}
    config["task_type"] = "CAUSAL_LM"

    def make(version: int) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        gen = torch.Generator().manual_seed(version)
        tensors = {}
        for name, (n_in, n_out) in shapes.items():
            tensors[f"base_model.model.{name}.lora_A.weight"] = torch.randn(rank, n_in, generator=gen) * scale
            tensors[f"base_model.model.{name}.lora_B.weight"] = torch.randn(n_out, rank, generator=gen) * scale
        return tensors, dict(config)

    return make


def write_peft_folder(tensors: dict[str, torch.Tensor], config: dict[str, Any], folder: Path) -> Path:
    """Write an adapter as a PEFT folder (`adapter_model.safetensors` + `adapter_config.json`); returns it."""
    import json

    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, folder / "adapter_model.safetensors")
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return folder
