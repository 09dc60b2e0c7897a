"""Launch settings from the run, not from one model: `engine.launch`'s `auto` values resolved against what
the installed SGLang has (`probe.SGLangEnvironment`), the rollout batch and the run's memory plan.

    attention_backend auto  SGLang's own choice where its kernels are installed (FA3 on Hopper), else
                            `flashinfer` where usable, else `triton`
    sampling_backend auto   SGLang's own (`flashinfer`) where usable, else `pytorch`
    lora_backend auto       `triton`: rollouts are decode-bound, and SGLang's Triton LoRA kernels decode the
                            rollout batch 1.38-1.41x faster than its default `csgmv` (H100, 128 sequences,
                            Qwen2.5-1.5B/7B shapes: benchmarks/results/gpu_scale/lora-backend/rollout-*.json)
    cuda_graph_max_bs auto  max(rollout batch, SGLang's default for the GPU's memory)
    mem_fraction_static     the memory plan's fraction (`lora_rl_core.memory`) where a trainer shares the GPU,
                            else SGLang's own
    memory_saver auto       as the memory plan decided (off without a plan)

Every value stays overridable in the config; `ResolvedLaunch.reasons` says why each `auto` became what it is,
and the launcher logs the resolved command.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lora_rl_core.engines.launch.probe import SGLangEnvironment
from lora_rl_core.engines.records import ResolvedLaunch

if TYPE_CHECKING:
    from lora_rl_core.config import SGLangLaunchConfig

_GIB = 1024**3
LORA_BACKEND = "triton"
"""`lora_backend: auto` (module docstring): the LoRA kernels that decode a rollout batch fastest, measured."""


def sglang_default_cuda_graph_max_bs(gpu_total_bytes: int | None, tp_size: int = 1) -> int:
    """SGLang's own `--cuda-graph-max-bs-decode` for a GPU of this much memory (sglang 0.5.17
    `server_args.py` `_handle_gpu_memory_settings`: 8 below 20 GiB, 24/80 below 35, 32/160 below 60, 256/512
    below 160, else 512; the second value for tp >= 4; 160 when the memory is unknown)."""
    if gpu_total_bytes is None:
        return 160
    gib = gpu_total_bytes / _GIB
    if gib < 20:
        return 8
    if gib < 35:
        return 24 if tp_size < 4 else 80
    if gib < 60:
        return 32 if tp_size < 4 else 160
    if gib < 160:
        return 256 if tp_size < 4 else 512
    return 512


def resolve_launch(
    launch: SGLangLaunchConfig,
    env: SGLangEnvironment,
    *,
    rollout_batch: int | None = None,
    mem_fraction: float | None = None,
    memory_saver: bool = False,
    memory_saver_reason: str = "no trainer shares SGLang's GPU",
) -> ResolvedLaunch:
    """Resolve `launch`'s `auto` values (module docstring).

    Args:
        launch: the `engine.launch` section.
        env: what the SGLang installation and its GPU offer (`probe_sglang`).
        rollout_batch: sequences decoded at once (prompts x group size x rollouts in flight); None = unknown.
        mem_fraction: the memory plan's `--mem-fraction-static` (None: no trainer shares the GPU).
        memory_saver: the memory plan frees SGLang's KV cache during training.
        memory_saver_reason: the memory plan's reason (`MemoryPlan.memory_saver_reason`).
    """
    reasons: dict[str, str] = {}
    attention: str | None = launch.attention_backend
    if attention == "auto":
        attention, reasons["attention_backend"] = _attention(env)
    sampling: str | None = launch.sampling_backend
    if sampling == "auto":
        sampling = None if env.flashinfer else "pytorch"
        reasons["sampling_backend"] = "SGLang's own (flashinfer)" if env.flashinfer else "flashinfer not usable here"
    lora: str | None = launch.lora_backend
    if lora == "auto":
        lora = LORA_BACKEND
        reasons["lora_backend"] = "decode-bound rollouts: 1.4x the decode tokens/s of SGLang's default csgmv"
    graphs = launch.cuda_graph_max_bs
    if graphs == "auto":
        default = sglang_default_cuda_graph_max_bs(env.gpu_total_bytes)
        graphs = max(default, rollout_batch or 0)
        reasons["cuda_graph_max_bs"] = f"max(rollout batch {rollout_batch}, SGLang's default {default})"
    fraction = launch.mem_fraction_static
    if fraction == "auto":
        fraction = mem_fraction
        reasons["mem_fraction_static"] = (
            "SGLang's own (no trainer on this GPU)" if mem_fraction is None else "the run's memory plan"
        )
    saver = launch.memory_saver
    if saver == "auto":
        saver = memory_saver
        reasons["memory_saver"] = memory_saver_reason
    return ResolvedLaunch(
        attention_backend=attention,
        sampling_backend=sampling,
        lora_backend=lora,
        grammar_backend=launch.grammar_backend,
        cuda_graph_max_bs=graphs,
        mem_fraction_static=fraction,
        memory_saver=bool(saver),
        extra_args=tuple(launch.extra_args),
        reasons=reasons,
    )


def _attention(env: SGLangEnvironment) -> tuple[str | None, str]:
    """SGLang's own choice where it can run (sglang 0.5.17 `_get_default_attn_backend` for MHA models: FA3 on
    Hopper, else FlashInfer where available, else Triton), else the best installed fallback."""
    if env.hopper and env.fa3:
        return None, "SGLang's own (FA3 on Hopper)"
    if not env.hopper and env.gpu_capability is not None and env.gpu_capability[0] >= 10:
        return None, "SGLang's own (Blackwell)"
    if env.flashinfer:
        return "flashinfer", "FA3 kernels not installed" if env.hopper else "SGLang's choice here"
    return "triton", "neither FA3 nor a usable FlashInfer installed"
