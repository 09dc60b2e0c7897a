"""Fused training kernels for the trainer's copy of the model (`trainer.liger_kernels`).

Liger Kernel (linkedin/Liger-Kernel, PyPI `liger-kernel`, Triton) replaces a decoder's RMSNorm, SwiGLU MLP
and rotary embedding by one fused kernel each, forward and backward. On a GPU the LoRA train phase is as
much launch-bound as compute-bound (benchmarks/results/gpu_scale/README.md: thousands of small elementwise
kernels per step around the GEMMs), and the fused RMSNorm and SwiGLU also keep fewer activations. The logits
stay materialised: the loss needs every completion token's logprob and the entropy, which Liger's fused
linear cross-entropy does not return. TRL (`use_liger_kernel`) and verl (`model.use_liger`) apply the same
patch through `liger_kernel.transformers._apply_liger_kernel_to_instance`.

The patch is applied to the loaded model before LoRA wraps its linear layers (PEFT's wrappers are then
called by Liger's MLP forward as by the original). It also swaps the model family's rotary function in
transformers' module for the whole process (Liger patches it module-wide), which computes the same values.

Off by default (not yet measured on a GPU with this trainer). `auto`: on for a trainer on CUDA when
`liger-kernel` is installed (the `gpu` extra) and has kernels for the model's family (`model_type`: llama,
mistral, qwen2, qwen3, gemma, phi3, ...); off on a CPU, where Triton does not run. `true` insists.
"""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass
from typing import Any, Literal

import torch

from lora_rl_core.errors import ConfigError

log = logging.getLogger(__name__)

PATCHED = {"rope": True, "rms_norm": True, "swiglu": True, "cross_entropy": False, "fused_linear_cross_entropy": False}
"""What the patch replaces: the three elementwise blocks; never the logits (the loss needs them)."""


@dataclass(frozen=True)
class KernelChoice:
    """Whether the trainer's model gets Liger's fused kernels, and why (one line for the run log)."""

    liger: bool
    reason: str


def liger_model_types() -> frozenset[str]:
    """The `model_type`s the installed `liger-kernel` patches; empty when it is not installed."""
    if importlib.util.find_spec("liger_kernel") is None:
        return frozenset()
    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

    return frozenset(MODEL_TYPE_TO_APPLY_LIGER_FN)


def choose_kernels(requested: bool | Literal["auto"], device: torch.device | str, model_type: str) -> KernelChoice:
    """Resolve `trainer.liger_kernels` for a trainer on `device` training a `model_type` model.

    Raises:
        ConfigError: `true` on a CPU, without `liger-kernel` installed, or for a family it has no kernels for
            (names the setting and the fix).
    """
    device = torch.device(device)
    if requested is False:
        return KernelChoice(False, "trainer.liger_kernels=false")
    supported = liger_model_types()
    problem = None
    if device.type != "cuda":
        problem = f"the trainer is on {device.type} (Liger's Triton kernels need a GPU)"
    elif not supported:
        problem = "liger-kernel is not installed (`pip install 'lora-rl[gpu]'` or `pip install liger-kernel`)"
    elif model_type not in supported:
        problem = f"liger-kernel has no kernels for model_type {model_type!r}"
    if problem is None:
        auto = "auto: " if requested == "auto" else ""
        return KernelChoice(True, f"{auto}Liger's fused RMSNorm, SwiGLU and rotary kernels on cuda")
    if requested == "auto":
        return KernelChoice(False, f"auto: off, {problem}")
    raise ConfigError(f"trainer.liger_kernels=true but {problem}; set trainer.liger_kernels=auto or false")


def apply_kernels(model: Any, requested: bool | Literal["auto"], device: torch.device | str) -> KernelChoice:
    """Patch `model` (a transformers model, before LoRA is applied) with Liger's kernels where
    `trainer.liger_kernels` (`requested`) resolves to on for `device`; returns the choice (logged).

    Raises:
        ConfigError: as `choose_kernels`.
    """
    choice = choose_kernels(requested, device, getattr(model.config, "model_type", ""))
    log.info("trainer kernels: %s", choice.reason)
    if choice.liger:
        from liger_kernel.transformers import _apply_liger_kernel_to_instance

        _apply_liger_kernel_to_instance(model=model, **PATCHED)
    return choice
