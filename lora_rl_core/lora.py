"""LoRA adapters through PEFT: resolve target modules against the real model, build configs.

`target_modules` is `all-linear` or a list of module-name suffixes (`q_proj`),
matched against the model's actual linear modules (`adapters.adaptable_module_names`;
the output head is never adapted). A suffix that matches nothing is an error that lists the
suffixes that do exist, instead of PEFT's silent or late failure.
"""

from __future__ import annotations

import json
from typing import Any

import torch
from peft import LoraConfig, PeftConfig, PeftModel, get_peft_model
from peft.tuners.lora import LoraLayer
from torch import nn

from lora_rl_core.adapters.validation import adaptable_module_names
from lora_rl_core.config import LoRAConfig
from lora_rl_core.distributed import peft_adapter_state
from lora_rl_core.errors import ConfigError


def linear_suffixes(model: nn.Module) -> list[str]:
    """Sorted distinct last-name parts of the model's linear modules (`nn.Linear`, GPT-2 `Conv1D`),
    output head excluded (as PEFT's `all-linear`)."""
    head = getattr(model, "get_output_embeddings", lambda: None)()
    head_names = {name for name, mod in model.named_modules() if head is not None and mod is head}
    names = adaptable_module_names(model, linear_only=True)
    return sorted({name.rsplit(".", 1)[-1] for name in names if name not in head_names})


def resolve_target_modules(model: nn.Module, cfg: LoRAConfig, *, section: str = "lora") -> list[str]:
    """The module-name suffixes to adapt, after `all-linear` expansion and `exclude_modules` (`section`: where
    `cfg` is in the config, for the errors: `lora` or `critic.lora`).

    Raises:
        ConfigError: a target or exclude suffix matches no linear module (names those that exist),
            or nothing is left to adapt.
    """
    available = linear_suffixes(model)
    wanted = available if cfg.target_modules == "all-linear" else list(cfg.target_modules)
    for field, names in ((f"{section}.target_modules", wanted), (f"{section}.exclude_modules", cfg.exclude_modules)):
        missing = [n for n in names if n not in available]
        if missing:
            raise ConfigError(f"{field}: {missing} match no linear module of this model; it has {available}")
    chosen = [n for n in wanted if n not in set(cfg.exclude_modules)]
    if not chosen:
        raise ConfigError(f"{section}.exclude_modules removes every target module: nothing left to adapt")
    return chosen


def peft_lora_config(
    model: nn.Module, cfg: LoRAConfig, *, section: str = "lora", modules_to_save: list[str] | None = None
) -> LoraConfig:
    """A PEFT `LoraConfig` for `model` from our `LoRAConfig` (targets resolved and checked; `section` names it in
    errors), with PEFT's fully trained `modules_to_save` (the critic's value head)."""
    return LoraConfig(
        r=cfg.rank,
        lora_alpha=cfg.alpha,  # type: ignore[arg-type]  # PEFT annotates int; the scale alpha / r takes any number
        lora_dropout=cfg.dropout,
        target_modules=resolve_target_modules(model, cfg, section=section),
        modules_to_save=modules_to_save,
        init_lora_weights=True if cfg.init == "default" else cfg.init,
        use_rslora=cfg.use_rslora,
        bias="none",
        task_type="CAUSAL_LM",
    )


def apply_lora(model: nn.Module, cfg: LoRAConfig, *, adapter_name: str = "default") -> PeftModel:
    """Wrap `model` with a trainable LoRA adapter; only LoRA parameters require grad.

    The base weights are frozen; LoRA weights are float32 (PEFT's autocast of adapter dtype).
    """
    return get_peft_model(model, peft_lora_config(model, cfg), adapter_name=adapter_name)


def set_input_dtype_casting(model: nn.Module, *, enabled: bool) -> None:
    """Turn PEFT's cast of each adapted layer's input to the adapter's dtype on or off, for every LoRA layer.

    PEFT casts the input of `lora_A` to its (float32) weight dtype (`BaseTunerLayer._cast_input_dtype`); off,
    the input keeps the base model's dtype, and the caller must run the forward under `torch.autocast` so the
    float32 LoRA weights are cast to it instead. Sets PEFT's `cast_input_dtype_enabled` attribute, as
    `peft.helpers.disable_input_dtype_casting` does for the length of a block; here it stays set, so a
    gradient-checkpointing recomputation (outside any such block) computes the same way.
    """
    for module in model.modules():
        if isinstance(module, LoraLayer):
            module.cast_input_dtype_enabled = enabled


def adapter_state(model: PeftModel, adapter_name: str = "default") -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The adapter's weights (PEFT key names, detached CPU copies) and its JSON-safe PEFT config.

    Returns:
        (tensors, adapter_config): keys like `base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`,
        as `PeftModel.save_pretrained` writes them; `adapter_config` is what goes to `adapter_config.json`.
    """
    state = peft_adapter_state(model, adapter_name)
    return cpu_copies(state), peft_config_dict(model.peft_config[adapter_name])


def cpu_copies(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Detached, contiguous CPU copies of `tensors` (any device, any dtype kept, each its own storage), so that
    later steps of the trainer cannot change them.

    CUDA tensors are copied into page-locked host memory (torch's caching host allocator: reused from step to
    step) with asynchronous copies and one wait per device, instead of one synchronous copy from pageable
    memory per tensor: a 7B adapter is ~390 tensors, its checkpoint three times as many. In a timeline of one
    7B step those copies were ~0.1 s of publish and ~0.2 s of the checkpoint's snapshot
    (`benchmarks/_timeline.py`; `benchmarks/results/gpu_scale/README.md`). The page-locked memory stays
    reserved by the allocator for the process's life, at the most copies alive at once (a version being
    written, a queued checkpoint, the next snapshot: a few times the adapter's float32 bytes). Where it cannot
    be had, a tensor is copied into pageable memory as before.
    """
    out: dict[str, torch.Tensor] = {}
    devices = set()
    for k, v in tensors.items():
        if v.is_cuda:
            try:
                out[k] = torch.empty(v.shape, dtype=v.dtype, pin_memory=True)
            except RuntimeError:  # no page-locked memory to be had (a locked-memory limit): a pageable copy
                out[k] = v.detach().to("cpu", copy=True).contiguous()
                continue
            out[k].copy_(v.detach(), non_blocking=True)
            devices.add(v.device)
        else:
            out[k] = v.detach().to("cpu", copy=True).contiguous()
    for device in devices:  # the copies are queued on each device's current stream: wait for them once
        torch.cuda.current_stream(device).synchronize()
    return out


def peft_config_dict(config: PeftConfig) -> dict[str, Any]:
    """A PEFT config as a JSON-safe dict (sets become sorted lists)."""
    return json.loads(json.dumps(config.to_dict(), default=lambda o: sorted(o) if isinstance(o, set) else str(o)))
