"""`plan_memory`: what the trainer and a launched SGLang get of each GPU, decided before step 1 (the package
docstring, `lora_rl_core.memory`, says how)."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from lora_rl_core.config import SET_IN_CONFIG, RolloutMode, RunConfig, SGLangEngineConfig, SGLangLaunchConfig
from lora_rl_core.config.trainer import MICRO_BATCH_AUTO_MAX
from lora_rl_core.errors import ConfigError
from lora_rl_core.memory.shape import GIB, ModelShape

_log = logging.getLogger(__name__)

CUDA_CONTEXT_BYTES = int(0.75 * GIB)
"""A CUDA context and the libraries it loads (cuBLAS, NCCL handles), per process."""
SAFETY_BYTES = 2 * GIB
"""Left free on the GPU: allocator fragmentation, NCCL and cuBLAS workspaces, estimate error."""
ENGINE_OVERHEAD_BYTES = int(2.5 * GIB)
"""SGLang outside its static pool, besides prefill activations: its CUDA context, decode CUDA graphs, sampling."""
MIN_MICRO_BATCH = 4
"""The smallest micro-batch the plan halves to before it turns on gradient checkpointing instead."""
SGLANG_CHUNKED_PREFILL = 8192
"""SGLang's `--chunked-prefill-size` on an 80 GB GPU (sglang 0.5.17 `_handle_gpu_memory_settings`)."""


@dataclass(frozen=True)
class MemoryPlan:
    """What the run's GPU memory allows, decided before step 1 (module docstring). Sizes in bytes.

    Attributes:
        gradient_checkpointing: the trainer's setting (resolved from `auto`), and why (`checkpointing_reason`).
        micro_batch_size: sequences per forward/backward pass (and why: `micro_batch_reason`):
            `trainer.micro_batch_size`, halved where it does not fit and `gradient_checkpointing` is `auto`
            (without checkpointing not below `MIN_MICRO_BATCH`).
        mem_fraction_static: SGLang's `--mem-fraction-static`; None = SGLang's own (no trainer beside it).
        memory_saver: SGLang frees its KV cache during each train phase.
        memory_saver_reason: why (or why not), for the run log and `run.json`.
        shard_weights: several trainer ranks shard the base weights (FSDP2); False: each holds them whole.
        shard_weights_reason: why.
        rollout_batch: sequences decoded at once (prompts x group size x rollouts in flight).
        colocated: trainer and SGLang share one GPU.
        gpu_total: the trainer's GPU memory; 0 on a CPU.
        trainer_resident / activations / engine_fixed / kv_cache / kv_needed: the plan's figures.
    """

    gradient_checkpointing: bool
    micro_batch_size: int
    checkpointing_reason: str
    micro_batch_reason: str
    mem_fraction_static: float | None = None
    memory_saver: bool = False
    memory_saver_reason: str = "no trainer shares SGLang's GPU"
    shard_weights: bool = True
    shard_weights_reason: str = "one trainer process"
    rollout_batch: int = 0
    colocated: bool = False
    gpu_total: int = 0
    trainer_resident: int = 0
    activations: int = 0
    engine_fixed: int = 0
    kv_cache: int = 0
    kv_needed: int = 0

    def summary(self) -> dict[str, Any]:
        """The plan as JSON-safe values, sizes in GiB (for logs and `run.json`)."""
        return {
            k: round(v / GIB, 2) if isinstance(v, int) and not isinstance(v, bool) and v > 4096 else v
            for k, v in asdict(self).items()
        }


def _engine_bytes(cfg: RunConfig, shape: ModelShape, *, seq: int, batch: int, servers: int, tp: int) -> tuple[int, int]:
    """What one SGLang server takes of each of its `tp` GPUs, bytes: (its share of the weights, the LoRA pool and
    the prefill activations plus `ENGINE_OVERHEAD_BYTES`; the KV cache of its share of `batch` sequences of
    `seq` tokens, the rollout batch spread over `servers`)."""
    prefill = SGLANG_CHUNKED_PREFILL * (6 * shape.hidden + 3 * shape.intermediate) * 2
    pool = cfg.engine.max_loras_per_batch * shape.lora_params * 2
    fixed = (shape.weight_bytes() + pool + prefill) // tp + ENGINE_OVERHEAD_BYTES
    return fixed, -(-batch // servers) * seq * shape.kv_bytes_per_token() // tp


def _gib(size: int) -> str:
    """`size` bytes in GiB for a message, e.g. `12.3 GiB`."""
    return f"{size / GIB:.1f} GiB"


def _cost(choice: tuple[bool, int]) -> tuple[bool, int]:
    """The order of the trainer's `(checkpointing, micro-batch)` choices, smaller is better: no recomputation
    beats recomputation (~1/3 more compute), then a larger micro-batch beats a smaller one."""
    return choice[0], -choice[1]


def rollout_batch(cfg: RunConfig, mode: RolloutMode) -> int:
    """Sequences an engine decodes at once in rollout `mode`: prompts x group size x rollouts in flight
    (1 + `RunConfig.rollouts_ahead`)."""
    return cfg.rollout.prompts_per_step * cfg.rollout.group_size * (1 + cfg.rollouts_ahead(mode))


@dataclass(frozen=True)
class _Inputs:
    """What `plan_memory` was told of the GPU, the engine beside it and the ranks (its arguments)."""

    prompt_tokens: int
    gpu_free: int
    gpu_total: int
    colocated: bool
    saver_available: bool
    mode: RolloutMode
    world: int
    dp_size: int
    engine_tp: int


def plan_memory(
    cfg: RunConfig,
    shape: ModelShape | None,
    *,
    prompt_tokens: int,
    gpu_free: int,
    gpu_total: int,
    colocated: bool,
    saver_available: bool,
    mode: RolloutMode,
    ranks: int | None = None,
    dp_size: int = 1,
    engine_tp: int = 1,
    shard_weights: bool | None = None,
) -> MemoryPlan:
    """The run's memory plan (module docstring), per GPU; pure arithmetic, no GPU touched.

    Args:
        cfg: the run (trainer, rollout, engine sections).
        shape: the model's sizes; None when the trainer is on a CPU (then only `auto` values are resolved).
        prompt_tokens: the longest rendered prompt, tokens.
        gpu_free / gpu_total: the trainer's GPU before anything of this run is on it, bytes.
        colocated: a launched SGLang shares the trainer's GPU (each of the trainer's GPUs).
        saver_available: the installed SGLang has `torch_memory_saver`.
        mode: `rollout.mode` resolved (async: the KV cache of the rollouts ahead too, and never released).
        ranks: FSDP2 ranks, one per GPU, each holding 1/ranks of the base weights (0: the trainer in this
            process); None = `trainer.backend`'s.
        dp_size: SGLang servers (data-parallel replicas): each holds the whole model and the KV cache of
            1/dp_size of the rollout batch, over `engine_tp` GPUs.
        engine_tp: GPUs per SGLang server (tensor parallel): each holds 1/engine_tp of the server's weights,
            LoRA pool, prefill activations and KV cache.
        shard_weights: with several ranks, shard the base weights over them; None = `trainer.shard_weights`
            (`auto`: whole on every rank where that plans a micro-batch and recomputation no worse, else sharded).

    Raises:
        ConfigError: the trainer (and SGLang beside it) cannot fit, naming the settings to change.
    """
    world = max(1, cfg.trainer.ranks() if ranks is None else ranks)
    asked = cfg.trainer.shard_weights if shard_weights is None else shard_weights
    gpu = _Inputs(prompt_tokens, gpu_free, gpu_total, colocated, saver_available, mode, world, dp_size, engine_tp)
    if world == 1:
        return _plan_memory(cfg, shape, gpu, shard=True, shard_reason="one trainer process")
    if asked != "auto":
        return _plan_memory(
            cfg, shape, gpu, shard=bool(asked), shard_reason=f"trainer.shard_weights={str(asked).lower()}"
        )
    if shape is None:
        return _plan_memory(cfg, shape, gpu, shard=True, shard_reason="auto: sharded (no GPU memory to plan)")
    sharded = _plan_memory(cfg, shape, gpu, shard=True, shard_reason="")
    try:
        whole = _plan_memory(cfg, shape, gpu, shard=False, shard_reason="")
    except ConfigError:
        whole = None
    choice = lambda p: (p.gradient_checkpointing, p.micro_batch_size)  # noqa: E731
    say = lambda p: _trainer_words(choice(p))  # noqa: E731
    if whole is not None and _cost(choice(whole)) <= _cost(choice(sharded)):
        why = f"auto: the base weights fit every rank whole ({say(whole)}): no all-gathers"
        return dataclasses.replace(whole, shard_weights_reason=why)
    cost = "not fit" if whole is None else f"leave {say(whole)}"
    return dataclasses.replace(
        sharded, shard_weights_reason=f"auto: whole base weights would {cost}; sharded: {say(sharded)}"
    )


def _plan_memory(
    cfg: RunConfig, shape: ModelShape | None, gpu: _Inputs, *, shard: bool, shard_reason: str
) -> MemoryPlan:
    """`plan_memory` for one choice of `shard` (the base weights over `gpu.world` ranks, or whole on each)."""
    if gpu.mode not in ("sync", "async"):
        raise ValueError(f"plan_memory needs rollout.mode resolved (sync or async), got {gpu.mode!r}")
    batch = rollout_batch(cfg, gpu.mode)
    r, t = cfg.rollout, cfg.trainer
    checkpointing = t.gradient_checkpointing
    start = t.micro_batch_start(r.prompts_per_step * r.group_size, on_gpu=shape is not None)
    if shape is None:
        return MemoryPlan(
            gradient_checkpointing=checkpointing is True,
            micro_batch_size=start,
            checkpointing_reason=SET_IN_CONFIG if checkpointing != "auto" else "auto: off without a GPU",
            micro_batch_reason=_micro_batch_reason(t.micro_batch_size, start, start, on_gpu=False),
            shard_weights=shard,
            shard_weights_reason=shard_reason,
            rollout_batch=batch,
        )
    launch = cfg.engine.launch if isinstance(cfg.engine, SGLangEngineConfig) else SGLangLaunchConfig()
    seq = gpu.prompt_tokens + r.max_new_tokens
    # LoRA weights, gradients and AdamW state in float32 on every GPU (replicated over ranks, which also hold the
    # flat buffer of their gradients' all-reduce: distributed.sum_gradients); PPO's critic adapter and head alike.
    # The critic's passes run after the policy's, over the same micro-batches: their activations are the
    # policy's at most (one position of logits), so the peak does not grow.
    lora_bytes = (shape.lora_params + shape.critic_params) * (20 if gpu.world > 1 else 16)
    resident = shape.weight_bytes() // (gpu.world if shard else 1) + lora_bytes + CUDA_CONTEXT_BYTES
    budget = gpu.gpu_free - SAFETY_BYTES
    # a GPU's share of SGLang (only where it shares the trainer's GPU) and of the batch's KV cache
    fixed, kv_needed = _engine_bytes(cfg, shape, seq=seq, batch=batch, servers=gpu.dp_size, tp=gpu.engine_tp)
    engine_fixed = fixed if gpu.colocated else 0
    # the KV cache can be released only while SGLang is idle (sync rollouts); every rank then gives its cached
    # blocks back after its step (TrainerPlan.empty_cache_after_step)
    saver_allowed = gpu.colocated and (
        launch.memory_saver is True or (launch.memory_saver == "auto" and gpu.saver_available and gpu.mode == "sync")
    )
    fraction: float | None = None
    room = budget - resident - engine_fixed  # for the KV cache and the activations
    kv_min = 0
    if gpu.colocated and launch.mem_fraction_static is None:
        raise ConfigError(
            "engine.launch.mem_fraction_static: null leaves SGLang its own fraction of a GPU the trainer shares "
            "(about 0.84 of an 80 GB GPU, more than a trainer beside it leaves): set it to auto (the run's memory "
            "plan) or to a number"
        )
    if gpu.colocated and isinstance(launch.mem_fraction_static, float):
        kv_min = (
            int(launch.mem_fraction_static * gpu.gpu_total)
            - shape.weight_bytes() // gpu.engine_tp
            - (gpu.gpu_total - gpu.gpu_free)
        )
    elif gpu.colocated:
        kv_min = max(int(kv_needed * 1.5), GIB)  # half again the batch's (SGLang's pages, the prefixes it keeps)

    def act(micro: int, ckpt: bool) -> int:
        return shape.activation_bytes(micro * seq, micro * (r.max_new_tokens + 1), checkpointing=ckpt)

    def choose(train_room: int) -> tuple[bool, int]:
        """(checkpointing, micro-batch) for this much room: without recomputation where a micro-batch of at
        least MIN_MICRO_BATCH fits (halving it costs less than the ~1/3 more compute of recomputing every
        layer), else with it, at the largest halving that fits."""
        micro = start
        if checkpointing != "auto":  # an `auto` micro-batch still halves to fit; a set one is taken as set
            fixed = bool(checkpointing)
            if t.micro_batch_size == "auto":
                micro = _fit(micro, 1, lambda m: act(m, fixed) <= train_room)
            return fixed, micro
        ckpt = act(_fit(micro, MIN_MICRO_BATCH, lambda m: act(m, False) <= train_room), False) > train_room
        return ckpt, _fit(micro, 1 if ckpt else MIN_MICRO_BATCH, lambda m: act(m, ckpt) <= train_room)

    def fits_beside(kv: int) -> tuple[bool, int] | None:
        """The choice beside a KV cache of `kv`; None where not even the smallest fits (choose gives it anyway)."""
        choice = choose(room - kv)
        return choice if act(choice[1], choice[0]) <= room - kv else None

    side_by_side = fits_beside(kv_min)
    if side_by_side is None and launch.mem_fraction_static == "auto":
        # no room for a micro-batch beside half again the batch's cache (or for that cache beside both models'
        # weights): the batch's own cache is all SGLang must have (and the figure a refusal then names)
        kv_min = kv_needed
        side_by_side = fits_beside(kv_min)
    released = choose(room)
    # The memory saver (release the KV cache for each train phase) costs a release, a resume and the trainer's
    # CUDA cache every step: `auto` uses it where it buys a better choice than KV cache and activations side by
    # side, or where nothing fits beside the cache.
    saver = saver_allowed and (
        launch.memory_saver is True or side_by_side is None or _cost(side_by_side) > _cost(released)
    )
    train_room = room if saver else room - kv_min
    ckpt, micro = choose(train_room)
    saver_reason = _saver_reason(
        gpu.colocated, launch.memory_saver, gpu.saver_available, gpu.mode, saver, side_by_side, released
    )
    needed = act(micro, ckpt)
    # the KV cache lives beside the trainer's weights in every phase (released or not, it comes back)
    if needed > train_room or (gpu.colocated and not kv_needed <= kv_min <= room):
        raise ConfigError(
            _does_not_fit(
                cfg,
                shape,
                gpu,
                act={c: act(micro, c) for c in (False, True)},
                room=train_room,
                kv=kv_min,
                kv_needed=kv_needed,
                beside_weights=room,
                micro=micro,
                seq=seq,
                saver_allowed=saver_allowed,
            )
        )
    kv = kv_min
    if gpu.colocated:
        if launch.mem_fraction_static == "auto":
            # the rest of the room goes to the KV cache: all of it with the saver (freed while training), else
            # what the activations leave (a larger cache keeps more prefixes; SGLang never has to retract)
            kv = max(kv_min, room - GIB if saver else room - needed - GIB)
        fraction = min(
            0.95, (kv + shape.weight_bytes() // gpu.engine_tp + (gpu.gpu_total - gpu.gpu_free)) / gpu.gpu_total
        )
    return MemoryPlan(
        gradient_checkpointing=ckpt,
        micro_batch_size=micro,
        checkpointing_reason=SET_IN_CONFIG
        if checkpointing != "auto"
        else "auto: the memory plan: activations "
        + ("do not fit without recomputation" if ckpt else "fit without recomputation"),
        micro_batch_reason=_micro_batch_reason(t.micro_batch_size, start, micro, on_gpu=True),
        mem_fraction_static=fraction,
        memory_saver=saver,
        memory_saver_reason=saver_reason,
        shard_weights=shard,
        shard_weights_reason=shard_reason,
        rollout_batch=batch,
        colocated=gpu.colocated,
        gpu_total=gpu.gpu_total,
        trainer_resident=resident,
        activations=needed,
        engine_fixed=engine_fixed,
        kv_cache=kv,
        kv_needed=kv_needed,
    )


def _micro_batch_reason(setting: int | str, start: int, micro: int, *, on_gpu: bool) -> str:
    """Why the micro-batch is `micro` (`trainer.micro_batch_size` set to `setting`, the plan starting at
    `start`)."""
    if micro < start:
        why = f"the memory plan halved {start} to fit the GPU"
    elif setting != "auto":
        return SET_IN_CONFIG
    else:
        why = f"the batch's rows, at most {MICRO_BATCH_AUTO_MAX}" if on_gpu else "without a GPU to plan"
    return ("auto: " if setting == "auto" else "") + why


def check_engine_alone(
    cfg: RunConfig,
    shape: ModelShape,
    *,
    prompt_tokens: int,
    gpu_total: int,
    servers: int,
    mode: RolloutMode,
    tp: int = 1,
) -> None:
    """Where SGLang runs on GPUs of its own (`placement: split`), one server per GPU: its copy of the model, its
    LoRA pool, its overhead and prefill activations and the KV cache of its share of the rollout batch must fit
    one GPU (`gpu_total` bytes, less `SAFETY_BYTES`), each server's share over its `tp` GPUs. Pure arithmetic.

    Raises:
        ConfigError: they do not fit, naming the sizes and the settings to change.
    """
    seq = prompt_tokens + cfg.rollout.max_new_tokens
    batch = rollout_batch(cfg, mode)
    fixed, kv = _engine_bytes(cfg, shape, seq=seq, batch=batch, servers=servers, tp=tp)
    if fixed + kv > gpu_total - SAFETY_BYTES:
        g = _gib
        raise ConfigError(
            f"SGLang does not fit a GPU of its own ({g(gpu_total)}): a {shape.params / 1e9:.1f}B-parameter model "
            f"over {tp} GPU{'s' if tp > 1 else ''} per server needs {g(fixed)} per GPU with its LoRA pool, "
            f"and the KV cache of {-(-batch // servers)} sequences x {seq} tokens {g(kv)}. Lower "
            "rollout.prompts_per_step, rollout.group_size or rollout.max_new_tokens, give SGLang more GPUs "
            "(placement.engine_gpus, placement.engine_tp), or use larger GPUs"
        )


def _saver_reason(
    colocated: bool,
    setting: bool | str,
    available: bool,
    mode: RolloutMode,
    saver: bool,
    side_by_side: tuple[bool, int] | None,
    released: tuple[bool, int],
) -> str:
    """Why the plan does (not) release SGLang's KV cache while the trainer trains: `(checkpointing, micro-batch)`
    with the KV cache and activations side by side (None: no micro-batch fits beside the cache) against with the
    cache released."""
    say = _trainer_words
    if not colocated:
        return "no trainer shares SGLang's GPU"
    if setting is True or setting is False:
        return f"engine.launch.memory_saver={str(setting).lower()}"
    if setting == "auto" and mode != "sync":
        return "rollout.mode async: SGLang decodes while the trainer trains"
    if setting == "auto" and not available:
        return "torch_memory_saver is not installed beside SGLang"
    if side_by_side is None:
        what = f"no micro-batch fits beside the KV cache; released, {say(released)}"
        return f"releasing the KV cache while training is needed: {what}" if saver else what
    if saver:
        return f"releasing the KV cache while training buys {say(released)} (else {say(side_by_side)})"
    return f"releasing the KV cache would buy nothing: {say(side_by_side)} either way"


def _trainer_words(choice: tuple[bool, int]) -> str:
    """`(checkpointing, micro-batch)` in words, e.g. `micro-batch 8 with recomputation`."""
    return f"micro-batch {choice[1]}{' with recomputation' if choice[0] else ''}"


def _fit(micro: int, smallest: int, fits: Callable[[int], bool]) -> int:
    """`micro` halved until `fits(micro)` or it reaches `smallest`."""
    while micro > smallest and not fits(micro):
        micro //= 2
    return micro


def _does_not_fit(
    cfg: RunConfig,
    shape: ModelShape,
    gpu: _Inputs,
    *,
    act: dict[bool, int],
    room: int,
    kv: int,
    kv_needed: int,
    beside_weights: int,
    micro: int,
    seq: int,
    saver_allowed: bool,
) -> str:
    """The refusal: what does not fit (the KV cache or the activations, in GiB) and the settings that change it
    (only those not already taken). `act`: a micro-batch's activations without and with recomputation; `room`:
    what the activations may take; `kv` / `kv_needed`: the KV cache SGLang gets / the rollout batch needs;
    `beside_weights`: what both models' weights leave; all bytes."""
    g, colocated = _gib, gpu.colocated
    if colocated and kv < kv_needed:
        what = f"the rollout batch's KV cache needs {g(kv_needed)} but SGLang gets {g(kv)}"
    elif colocated and kv > beside_weights:
        takes = f"SGLang's KV cache takes {g(kv)} (the rollout batch needs {g(kv_needed)})"
        what = (
            f"{takes if kv > kv_needed else f'the rollout batch needs a KV cache of {g(kv)}'} and the trainer's and "
            f"SGLang's weights leave {g(beside_weights)}"
        )
    else:
        what = (
            f"a micro-batch of {micro} sequences x {seq} tokens needs {g(act[False])} of activations "
            f"({g(act[True])} with gradient checkpointing) and {g(room)} are left"
        )
    beside = " beside SGLang's copy of the model" if colocated else ""
    fixes = [f"lower rollout.max_new_tokens{' or trainer.micro_batch_size' if micro > 1 else ''}"]
    if cfg.trainer.gradient_checkpointing is False:
        fixes.append("set trainer.gradient_checkpointing: auto")
    launch = cfg.engine.launch if isinstance(cfg.engine, SGLangEngineConfig) else SGLangLaunchConfig()
    if colocated and isinstance(launch.mem_fraction_static, float):
        fixes.append("lower engine.launch.mem_fraction_static or set it to auto")
    if colocated and gpu.mode == "async":
        fixes.append("set rollout.mode: sync (frees the KV cache while training)")
    elif colocated and not saver_allowed and launch.memory_saver is not False:
        fixes.append("install torch-memory-saver beside SGLang (frees the KV cache while training)")
    fixes.append(
        "give SGLang GPUs of its own (placement: split, on a machine of several GPUs)"
        if colocated
        else "shard the trainer over more GPUs (placement: split or colocated on 2 or more GPUs)"
    )
    fix = "; ".join(fixes)
    return (
        f"this run does not fit the GPU ({g(gpu.gpu_total)}, a {shape.params / 1e9:.1f}B-parameter model{beside}): "
        f"{what}. "
        f"{fix[0].upper()}{fix[1:]}"
    )


def log_plan(plan: MemoryPlan) -> None:
    """Log the plan's figures (GiB) at INFO."""
    _log.info("memory plan: %s", plan.summary())
