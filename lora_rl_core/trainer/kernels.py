"""Fused training kernels for the trainer's copy of the model (`trainer.liger_kernels`).

Liger Kernel (linkedin/Liger-Kernel, PyPI `liger-kernel`, Triton) replaces a decoder's RMSNorm and SwiGLU MLP
by one fused kernel each, forward and backward. On a GPU the LoRA train phase is as much launch-bound as
compute-bound (benchmarks/results/gpu_scale/README.md: thousands of small elementwise kernels per step
around the GEMMs), and the fused RMSNorm and SwiGLU also keep fewer activations. The logits stay
materialised: the loss needs every completion token's logprob and the entropy, which Liger's fused linear
cross-entropy does not return. TRL (`use_liger_kernel`) and verl (`model.use_liger`) apply the same patch
through `liger_kernel.transformers._apply_liger_kernel_to_instance`.

Only this model instance is patched: its RMSNorm and MLP modules get Liger's forwards (PEFT's wrappers of the
MLP's linear layers are then called by Liger's forward as by the original, so the patch goes on before LoRA).
Liger also rebinds names in transformers' module of the family (the RMSNorm and MLP classes, the rotary
function) for every model of the process; `apply_kernels` puts those back, so an engine or a reference model
built in the same process stays as transformers wrote it. That leaves the rotary embedding unfused (it is a
module-level function: it cannot be patched for one instance).

Off by default (not yet measured on a GPU with this trainer). `auto`: on for a trainer on CUDA when
`liger-kernel` is installed (the `gpu` extra) and the model's family is one whose decoder is RMSNorm + SwiGLU
(`FAMILIES`); off otherwise, e.g. on a CPU, where Triton does not run. `true` insists.
"""

from __future__ import annotations

import importlib.util
import logging
import sys
from dataclasses import dataclass
from typing import Any, Literal

import torch

from lora_rl_core.errors import ConfigError

log = logging.getLogger(__name__)

FAMILIES = frozenset({"llama", "mistral", "qwen2", "qwen3"})
"""Model families (`model_type`) whose decoder layers are RMSNorm + SwiGLU MLP: the two kernels patched. Others
(Gemma's GeGLU, MoE experts, LayerNorm models) get other Liger kernels, untested with PEFT LoRA here."""
PATCHED = {"rope": False, "rms_norm": True, "swiglu": True, "cross_entropy": False, "fused_linear_cross_entropy": False}
"""What the patch replaces: RMSNorm and SwiGLU; never the logits (the loss needs them), nor the rotary function
(module-wide only)."""


@dataclass(frozen=True)
class KernelChoice:
    """Whether the trainer's model gets a kernel option (Liger's fused kernels, compiled layers), and why (one
    line for the run log)."""

    enabled: bool
    reason: str


def liger_model_types() -> frozenset[str]:
    """The families of `FAMILIES` that the installed `liger-kernel` patches.

    Raises:
        ImportError: `liger-kernel` is not installed, or does not import (no Triton, a transformers it does
            not know); the message says which.
    """
    if importlib.util.find_spec("liger_kernel") is None:
        raise ImportError("liger-kernel is not installed (`pip install 'lora-rl[gpu]'` or `pip install liger-kernel`)")
    try:
        from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN
    except Exception as exc:  # noqa: BLE001 - any import failure of the package means: cannot use it
        raise ImportError(f"liger-kernel does not import ({type(exc).__name__}: {exc})") from exc
    return FAMILIES & frozenset(MODEL_TYPE_TO_APPLY_LIGER_FN)


def choose_kernels(requested: bool | Literal["auto"], device: torch.device | str, model_type: str) -> KernelChoice:
    """Resolve `trainer.liger_kernels` for a trainer on `device` training a `model_type` model.

    Raises:
        ConfigError: `true` on a CPU, without a working `liger-kernel`, or for a family outside `FAMILIES`
            (names the setting and the fix).
    """
    device = torch.device(device)
    if requested is False:
        return KernelChoice(False, "trainer.liger_kernels=false")
    problem = None
    if device.type != "cuda":
        problem = f"the trainer is on {device.type} (Liger's Triton kernels need a GPU)"
    else:
        try:
            supported = liger_model_types()
        except ImportError as exc:
            problem = str(exc)
        else:
            if model_type not in supported:
                problem = f"Liger's RMSNorm + SwiGLU kernels are not used for model_type {model_type!r}"
    return _resolve("trainer.liger_kernels", requested, problem, "Liger's fused RMSNorm and SwiGLU kernels on cuda")


def _resolve(setting: str, requested: bool | Literal["auto"], problem: str | None, on: str) -> KernelChoice:
    """`auto` or `true` of a kernel option, given what stops it here (`problem`, None: nothing): on where nothing
    does, off for `auto` where something does, a `ConfigError` naming `setting` and the fix for `true`."""
    if problem is None:
        return KernelChoice(True, f"{'auto: ' if requested == 'auto' else ''}{on}")
    if requested == "auto":
        return KernelChoice(False, f"auto: off, {problem}")
    raise ConfigError(f"{setting}=true but {problem}; set {setting}=auto or false")


def apply_kernels(model: Any, liger: bool) -> None:
    """Patch `model` (a transformers model, before LoRA is applied) with Liger's kernels where the run's plan
    turned `trainer.liger_kernels` on (`choose_kernels` decided it, once). Only the instance changes: what
    Liger rebinds in transformers' module of the family is put back."""
    if liger:
        from liger_kernel.transformers import _apply_liger_kernel_to_instance

        module = sys.modules[type(model).__module__]
        before = dict(vars(module))
        try:
            _apply_liger_kernel_to_instance(model=model, **PATCHED)
        finally:
            for name, value in before.items():
                if vars(module).get(name) is not value:
                    setattr(module, name, value)


def choose_compile(requested: bool | Literal["auto"], device: torch.device | str, ranks: int) -> KernelChoice:
    """Resolve `trainer.torch_compile` for a trainer on `device` with `ranks` FSDP2 ranks (0: in-process).

    Raises:
        ConfigError: `true` on a CPU or with FSDP2 ranks (names the setting and the fix).
    """
    device = torch.device(device)
    if requested is False:
        return KernelChoice(False, "trainer.torch_compile=false")
    problem = None
    if ranks:
        problem = f"the trainer runs as {ranks} FSDP2 ranks (compiled layers are built for the in-process trainer)"
    elif device.type != "cuda":
        problem = f"the trainer is on {device.type} (compiling pays off on a GPU only)"
    return _resolve(
        "trainer.torch_compile", requested, problem, "each decoder layer compiled (torch.compile, dynamic shapes)"
    )


def compile_layers(model: torch.nn.Module) -> int:
    """Compile each decoder layer of `model` in place (`nn.Module.compile`, dynamic shapes): regional
    compilation, as PyTorch's recipe for repeated blocks, so the layers share one compiled graph (a second for
    the first layer, whose input needs no gradient). Call after LoRA is applied; compilation happens at the
    first forward.

    Returns:
        the number of layers compiled.

    Raises:
        ValueError: the model has no list of identical decoder blocks (`distributed.find_decoder_layers`).
    """
    from lora_rl_core.distributed import find_decoder_layers

    layers = find_decoder_layers(model)
    for layer in layers:
        layer.compile(dynamic=True)
    return len(layers)
