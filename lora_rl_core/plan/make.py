"""`make_plan`: the one caller of the rules that resolve `auto` settings, in one pass, before anything starts.

    model.device, model.dtype              runtime.choose_dtype (models.resolve_device)
    trainer.backend                        as set (`trainer.backend.type`; recorded so the log names it)
    trainer.lora_compute_dtype             runtime.choose_lora_compute_dtype
    trainer.liger_kernels                  trainer.kernels.choose_kernels
    trainer.torch_compile                  trainer.kernels.choose_compile
    trainer.gradient_checkpointing,        memory.plan_memory (on a GPU: the model's shape, the batch, the GPU,
      trainer.micro_batch_size,              and a launched SGLang beside the trainer)
      engine.launch.mem_fraction_static,
      engine.launch.memory_saver
    engine.launch.*_backend,               engines.launch.resolve.resolve_launch, after probing the installed
      engine.launch.cuda_graph_max_bs        SGLang (engines.launch.probe)
    engine.tensor_transport                where the servers are (this module, engines.remote.ipc)
    rollout.mode                           plan.placement.rollout_mode (async on a split placement)
    algorithm.off_policy_correction        AlgorithmConfig.correction (rollout.mode resolved)

A new `auto` setting is one rule function beside what it decides, one call here that records a `Choice`,
and one field of the plan section its builder reads.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch

from lora_rl_core.config import (
    CRITIC_LR_FACTOR,
    SET_IN_CONFIG,
    AutoCorrection,
    PlacedGPUs,
    RankedBackend,
    RayBackend,
    RayReplicas,
    RolloutMode,
    RunConfig,
    SGLangEngineConfig,
    sglang_section,
)
from lora_rl_core.data import Problem, PromptStyle
from lora_rl_core.engines.launch.probe import SGLangEnvironment, probe_for_launch
from lora_rl_core.engines.launch.process import LaunchBudget
from lora_rl_core.engines.launch.resolve import ResolvedLaunch, resolve_launch
from lora_rl_core.engines.registry import sync_reads_folder
from lora_rl_core.engines.remote.ipc import is_loopback
from lora_rl_core.errors import ConfigError
from lora_rl_core.memory import MemoryPlan, ModelShape, check_engine_alone, plan_memory
from lora_rl_core.models import model_folder, resolve_device
from lora_rl_core.plan.gpus import physical_gpu, sglang_shares_trainer_gpu
from lora_rl_core.plan.placement import (
    TP_LARGEST,
    TP_SMALLEST,
    Placement,
    launched_here,
    resolve_placement,
    rollout_mode,
)
from lora_rl_core.plan.record import Choice, EnginePlan, RunPlan
from lora_rl_core.records import BatchRules
from lora_rl_core.runtime import DtypeChoice, choose_dtype, choose_lora_compute_dtype, cpu_threads
from lora_rl_core.trainer.kernels import choose_compile, choose_kernels
from lora_rl_core.trainer.plan import CriticSettings, OptimizerSettings, PolicyLoss, TrainerPlan

SET = SET_IN_CONFIG
T = TypeVar("T")


def make_plan(
    cfg: RunConfig, *, tokenizer: Any = None, problems: Sequence[Problem] = (), train: bool = True
) -> RunPlan:
    """Resolve every `auto` setting of `cfg` on this machine (module docstring) and return the run's plan.
    Nothing is started and nothing is written; on a GPU the trainer's GPU memory is read, and a launched
    SGLang's installation is probed (a subprocess of `engine.launch.python`).

    Args:
        cfg: the validated config.
        tokenizer / problems: the model's tokenizer and the training problems: the memory plan sizes the
            longest prompt (of the first 256) on a GPU.
        train: plan a trainer (a training run); False for an evaluation or a server (engine only).

    Raises:
        ConfigError: a setting that cannot hold here (`trainer.lora_compute_dtype: bfloat16` over other base
            weights, `trainer.liger_kernels: true` where Liger cannot run), or a run that does not fit the GPU
            (naming the settings to change).
        EngineError: a launched SGLang's installation cannot be probed.
        ModelError: the model's config cannot be read (`trainer.liger_kernels` other than false).
    """
    choices: dict[str, Choice] = {}
    device = resolve_device(cfg.model.device)
    choices["model.device"] = Choice(str(device), _device_reason(cfg.model.device, device))
    dtype = choose_dtype(cfg.model.dtype, device)
    choices["model.dtype"] = Choice(dtype.name, dtype.reason)
    launch_env = _probe(cfg)
    placement = resolve_placement(cfg, torch.cuda.device_count() if device.type == "cuda" else 0, train=train)
    mode, mode_reason = rollout_mode(cfg, placement) if train else ("sync", "no training")
    trainer: TrainerPlan | None = None
    memory: MemoryPlan | None = None
    trainer_device: torch.device | None = None
    colocated = False
    if train:
        backend = cfg.trainer.backend
        if placement.trainer_gpus:
            trainer_device = torch.device("cuda", placement.trainer_gpus[0])
            colocated = placement.shares_gpus
        else:
            trainer_device = resolve_device(backend.device if isinstance(backend, RankedBackend) else cfg.model.device)
            colocated = sglang_shares_trainer_gpu(cfg, trainer_device)
        plan_for = functools.partial(
            _memory, cfg, trainer_device, colocated, launch_env, tokenizer, problems, placement
        )
        try:
            placement, memory = plan_for(mode)
        except ConfigError:
            if cfg.rollout.mode != "auto" or mode != "async":
                raise
            # async holds twice the rollouts in SGLang's KV cache: where that does not fit, sync may
            placement, memory = plan_for("sync")
            mode, mode_reason = "sync", "auto: rollouts one step ahead do not fit SGLang's memory; sync does"
        choices["rollout.mode"] = Choice(mode, mode_reason)
        # the base weights' dtype on the trainer's device: the engine's unless the trainer is on another kind
        base = dtype if trainer_device.type == device.type else choose_dtype(cfg.model.dtype, trainer_device)
        trainer = _trainer(cfg, trainer_device, base, memory, placement, mode, choices)
    elif placement.engine_gpus:  # servers only: the smallest tensor parallelism whose copy fits (TP_SMALLEST)
        total = torch.cuda.mem_get_info(torch.device("cuda", placement.engine_gpus[0]))[1]
        shape = ModelShape.of(cfg.model, cfg.lora)
        placement, _ = _choose_tp(
            cfg,
            placement,
            lambda p: _engine_alone(cfg, shape, 0, total, p, mode),
            heads=shape.attention_heads,
            largest=False,
        )
    turns = " (rollout.mode sync: the GPUs take turns; async overlaps them)" if train and mode == "sync" else ""
    choices["placement"] = Choice(placement.describe(), placement.reason + (turns if placement.kind == "split" else ""))
    engine = _engine(cfg, device, dtype.name, memory, trainer_device, colocated, launch_env, placement, choices)
    return RunPlan(
        config=cfg,
        device=str(device),
        trainer=trainer,
        engine=engine,
        memory=memory if memory is not None and memory.gpu_total else None,
        cpu_threads=cpu_threads(),
        batch=BatchRules(
            max_staleness=cfg.algorithm.max_staleness,
            skip_uniform=cfg.algorithm.skip_uniform_groups,
            mask_truncated=cfg.algorithm.truncation.type == "mask",
            critic_sees_truncated=cfg.algorithm.advantage == "gae",
        ),
        choices=choices,
        rollout_mode=mode,
    )


def _device_reason(requested: str, device: torch.device) -> str:
    if requested != "auto":
        return SET
    return f"auto: {'cuda is available' if device.type == 'cuda' else 'no cuda here'}"


def _probe(cfg: RunConfig) -> SGLangEnvironment | None:
    """What the installed SGLang offers, where this process launches it with an `auto` setting to resolve."""
    if not launched_here(cfg):
        return None
    return probe_for_launch(sglang_section(cfg.engine, "launching SGLang").launch)


def _memory(
    cfg: RunConfig,
    device: torch.device,
    colocated: bool,
    env: SGLangEnvironment | None,
    tokenizer: Any,
    problems: Sequence[Problem],
    placement: Placement,
    mode: RolloutMode,
) -> tuple[Placement, MemoryPlan]:
    """The GPU memory plan for the trainer's GPU (each of them: the placement's ranks) and a launched SGLang
    beside it (each SGLang server), with the placement's SGLang tensor parallelism resolved (the smallest that
    fits, where `placement.engine_tp` is `auto`); on a CPU only the `auto` values are resolved (gradient
    checkpointing off)."""
    if device.type != "cuda":
        cpu = plan_memory(
            cfg, None, prompt_tokens=0, gpu_free=0, gpu_total=0, colocated=False, saver_available=False, mode=mode
        )
        return placement, cpu
    e = cfg.engine
    saver = (
        colocated
        and isinstance(e, SGLangEngineConfig)
        and e.launch.memory_saver is not False
        and env is not None
        and env.memory_saver
    )
    style = PromptStyle.of(cfg.data, cfg.rollout)
    prompt_tokens = max((len(style.render(tokenizer, p)) for p in problems[:256]), default=0)
    free, total = torch.cuda.mem_get_info(device)
    critic_lora = (cfg.critic.lora or cfg.lora) if cfg.algorithm.advantage == "gae" else None
    shape = ModelShape.of(cfg.model, cfg.lora, critic_lora)  # the trainer's: the critic's state counts

    def fits(p: Placement) -> MemoryPlan:
        if p.engine_gpus and not colocated:  # SGLang on GPUs of its own (split): its copy must fit them
            _engine_alone(cfg, shape, prompt_tokens, total, p, mode)
        return plan_memory(
            cfg,
            shape,
            prompt_tokens=prompt_tokens,
            gpu_free=free,
            gpu_total=total,
            colocated=colocated,
            saver_available=saver,
            mode=mode,
            ranks=p.ranks if p.trainer_gpus else None,
            dp_size=p.dp_size if colocated else 1,
            engine_tp=p.engine_tp if colocated else 1,
        )

    if not placement.engine_gpus:
        return placement, fits(placement)
    # rollouts on SGLang's own GPUs: the largest tensor parallelism (TP_LARGEST); beside the trainer the smallest
    return _choose_tp(cfg, placement, fits, heads=shape.attention_heads, largest=not colocated)


def _engine_alone(
    cfg: RunConfig, shape: ModelShape, prompt_tokens: int, total: int, p: Placement, mode: RolloutMode
) -> None:
    """`memory.check_engine_alone` for the placement's servers."""
    check_engine_alone(
        cfg, shape, prompt_tokens=prompt_tokens, gpu_total=total, servers=p.dp_size, mode=mode, tp=p.engine_tp
    )


def _choose_tp(
    cfg: RunConfig, placement: Placement, fits: Callable[[Placement], T], *, heads: int, largest: bool
) -> tuple[Placement, T]:
    """The placement with the first SGLang tensor parallelism of `placement.tp_choices` (smallest or `largest`
    first, dividing the model's `heads`) for which `fits` passes, and what `fits` returned.

    Raises:
        ConfigError: none fits (the error of the last tried).
    """
    error: ConfigError | None = None
    asked = isinstance(cfg.placement, PlacedGPUs) and cfg.placement.engine_tp != "auto"
    reason = "placement.engine_tp" if asked else TP_LARGEST if largest else TP_SMALLEST
    for tp in placement.tp_choices(cfg, heads=heads, largest=largest):
        candidate = dataclasses.replace(placement, engine_tp=tp, tp_reason=reason)
        try:
            return candidate, fits(candidate)
        except ConfigError as exc:
            error = exc
    assert error is not None
    raise error


def _trainer(
    cfg: RunConfig,
    device: torch.device,
    base: DtypeChoice,
    memory: MemoryPlan,
    placement: Placement,
    mode: RolloutMode,
    choices: dict[str, Choice],
) -> TrainerPlan:
    t, a = cfg.trainer, cfg.algorithm
    backend = t.backend
    if placement.trainer_gpus:  # placed: ranks on the placement's GPUs (one GPU: this process)
        kind, ranks = ("local" if placement.ranks else "in-process"), placement.ranks
        rank_device, gpus = ("cuda" if ranks else str(device)), (placement.trainer_gpus if ranks else ())
        choices["trainer.backend"] = Choice(kind, f"placement {placement.kind}: {ranks or 'no'} FSDP2 ranks")
    else:
        kind, ranks, gpus = backend.type, t.ranks(), ()
        rank_device = backend.device if isinstance(backend, RankedBackend) else str(device)
        choices["trainer.backend"] = Choice(
            kind, f"{backend.world_size} FSDP2 ranks" if isinstance(backend, RankedBackend) else SET
        )
    lora = choose_lora_compute_dtype(t.lora_compute_dtype, device, base.name)
    choices["trainer.lora_compute_dtype"] = Choice(lora.name, lora.reason)
    kernels = choose_kernels(t.liger_kernels, device, _model_type(cfg) if t.liger_kernels else "")
    choices["trainer.liger_kernels"] = Choice(kernels.enabled, kernels.reason)
    compiled = choose_compile(t.torch_compile, device, ranks)
    choices["trainer.torch_compile"] = Choice(compiled.enabled, compiled.reason)
    choices["trainer.gradient_checkpointing"] = Choice(memory.gradient_checkpointing, memory.checkpointing_reason)
    choices["trainer.micro_batch_size"] = Choice(memory.micro_batch_size, memory.micro_batch_reason)
    correction = a.correction(mode)
    critic = _critic(cfg, choices)
    clipped = correction.type != "m2po"  # M2PO's mask bounds the ratios: no PPO clip under it
    choices["algorithm.off_policy_correction"] = Choice(
        correction.model_dump(),
        (SET if not isinstance(a.off_policy_correction, AutoCorrection) else f"auto: rollout.mode {mode}")
        + ("" if clipped else "; no PPO clip: algorithm.clip_eps_low and clip_eps_high are not used"),
    )
    if ranks:
        choices["trainer.shard_weights"] = Choice(memory.shard_weights, memory.shard_weights_reason)
    return TrainerPlan(
        model=cfg.model.model_copy(update={"device": rank_device, "dtype": base.name}),  # no `auto` left in it
        lora=cfg.lora,
        loss=PolicyLoss(
            clip_eps_low=a.clip_eps_low if clipped else None,
            clip_eps_high=a.clip_eps_high if clipped else None,
            kl_coef=0.0 if critic is not None else a.kl_coef,  # under GAE the KL is in the reward
            aggregation=a.loss_aggregation,
            num_minibatches=a.num_minibatches,
            off_policy_correction=correction,
        ),
        optimizer=OptimizerSettings(t.lr, t.betas, t.weight_decay, t.warmup_steps, t.max_grad_norm),
        temperature=cfg.rollout.temperature,
        seed=cfg.run.seed,
        lora_compute_dtype=lora.name,  # type: ignore[arg-type]  # choose_lora_compute_dtype: float32 | bfloat16
        liger_kernels=kernels.enabled,
        torch_compile=compiled.enabled,
        gradient_checkpointing=memory.gradient_checkpointing,
        micro_batch_size=memory.micro_batch_size,
        backend=kind,  # type: ignore[arg-type]  # a TrainerBackend: in-process, local or ray
        world_size=ranks,
        gpus=tuple(gpus),
        empty_cache_after_step=memory.memory_saver,
        shard_weights=memory.shard_weights,
        ray_gpus_per_rank=backend.gpus_per_rank
        if isinstance(backend, RayBackend) and backend.device == "cuda"
        else 0.0,
        critic=critic,
    )


def _critic(cfg: RunConfig, choices: dict[str, Choice]) -> CriticSettings | None:
    """PPO's critic under `algorithm.advantage: gae` (None otherwise), its `None` settings resolved."""
    a, c = cfg.algorithm, cfg.critic
    if a.advantage != "gae":
        return None
    lr = c.lr if c.lr is not None else round(CRITIC_LR_FACTOR * cfg.trainer.lr, 12)  # 0.003, not 0.0029999...
    choices["critic.lr"] = Choice(lr, SET if c.lr is not None else f"{CRITIC_LR_FACTOR:g} x trainer.lr")
    choices["critic.lora"] = Choice(
        (c.lora or cfg.lora).model_dump(), SET if c.lora is not None else "the policy's lora section"
    )
    if a.kl_coef > 0:
        choices["algorithm.kl_coef"] = Choice(a.kl_coef, "in the reward, per token (advantage gae), not the loss")
    return CriticSettings(
        lora=c.lora or cfg.lora,
        lr=lr,
        epochs=c.epochs,
        pretrain_steps=c.pretrain_steps,
        value_clip=c.value_clip,
        loss_coef=c.loss_coef,
        max_grad_norm=c.max_grad_norm,
        head_init_std=c.head_init_std,
        gamma=a.gamma,
        lam=a.lam,
        kl_coef=a.kl_coef,
    )


def _model_type(cfg: RunConfig) -> str:
    """The model's family (`model_type` of its `config.json`), read without loading weights."""
    from transformers import AutoConfig

    folder = model_folder(cfg.model)
    return str(AutoConfig.from_pretrained(folder, trust_remote_code=cfg.model.trust_remote_code).model_type)


def _engine(
    cfg: RunConfig,
    device: torch.device,
    dtype: str,
    memory: MemoryPlan | None,
    trainer_device: torch.device | None,
    colocated: bool,
    env: SGLangEnvironment | None,
    placement: Placement,
    choices: dict[str, Choice],
) -> EnginePlan:
    e = cfg.engine
    batch = memory.rollout_batch if memory is not None else None
    fraction = memory.mem_fraction_static if memory is not None else None
    saver = memory.memory_saver if memory is not None else False
    launch: ResolvedLaunch | None = None
    if env is not None:
        launch = resolve_launch(
            sglang_section(e, "launching SGLang").launch,
            env,
            rollout_batch=batch,
            mem_fraction=fraction,
            memory_saver=saver,
            memory_saver_reason=memory.memory_saver_reason if memory is not None else "no trainer in this run",
        )
        if placement.engine_gpus:  # one SGLang server per group of `engine_tp` GPUs of the placement
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            gpus = tuple(
                ",".join(physical_gpu(torch.device("cuda", i), visible) for i in group)
                for group in placement.server_gpus
            )
            launch = dataclasses.replace(launch, gpus=gpus, tp_size=placement.engine_tp)
            choices["engine.launch.servers"] = Choice(
                placement.dp_size, f"placement {placement.kind}: one per {placement.engine_tp} GPU(s)"
            )
            choices["engine.launch.tp_size"] = Choice(placement.engine_tp, placement.tp_reason or TP_SMALLEST)
        for key, reason in launch.reasons.items():
            choices[f"engine.launch.{key}"] = Choice(getattr(launch, key), reason)
    elif isinstance(e, SGLangEngineConfig) and e.launch.enabled:
        choices["engine.launch"] = Choice(
            "per replica",
            "only each Ray replica's host knows its GPUs: it resolves the `auto` flags when it starts, "
            "before step 1 (run.json `replicas`)",
        )
    elif isinstance(e, RayReplicas) and e.ray_replicas and cfg.model.device == "auto":
        choices["engine.model_device"] = Choice(
            "per replica",
            "only each Ray replica's host knows its devices: it resolves model.device and "
            "model.dtype when it starts, before step 1 (run.json `replicas`)",
        )
    transport = _transport(cfg, trainer_device, colocated, placement)
    choices["engine.tensor_transport"] = transport
    return EnginePlan(
        device=str(device),
        dtype=dtype,
        launch=launch,
        launch_budget=LaunchBudget(batch, fraction, saver)
        if isinstance(e, SGLangEngineConfig) and e.ray_replicas
        else None,
        tensor_transport=transport.value,
        sync_reads_folder=sync_reads_folder(e, transport.value),
    )


def _transport(cfg: RunConfig, trainer_device: torch.device | None, colocated: bool, placement: Placement) -> Choice:
    """`engine.tensor_transport` resolved where the servers are known now (`auto` stays per server where not)."""
    e = cfg.engine
    if not isinstance(e, SGLangEngineConfig):
        return Choice("auto", f"not used by engine.type {e.type}")
    if e.tensor_transport != "auto":
        return Choice(e.tensor_transport, SET)
    per_server = (
        "auto: per server when its client is made (Ray replicas: once each has started, before step 1, run.json "
        "`replicas`): `ipc` for one on this host with CUDA here, else the published folder"
    )
    if e.ray_replicas:
        return Choice("auto", per_server)
    if placement.ranks or placement.dp_size > 1:
        # the adapter is gathered to host memory by the ranks, and every server (each sees only its own GPU) must
        # read it: a local PEFT folder serves them all (CUDA IPC handles do not open on a GPU a server cannot see)
        return Choice("file", f"auto: placement {placement.kind} on several GPUs: a local PEFT folder")
    if e.launch.enabled and trainer_device is not None and trainer_device.type == "cuda" and not colocated:
        # CUDA IPC handles do not open in a server that cannot see the trainer's GPU; inline data costs seconds
        # for a 7B adapter (3.2 s per sync on two H100s); the published folder waits for the store write
        return Choice("file", "auto: SGLang launched on another GPU than the trainer's: a local PEFT folder")
    urls = e.urls or [f"http://{e.launch.host}:{e.launch.port}"]
    if torch.cuda.is_available() and all(is_loopback(url) for url in urls):
        return Choice("ipc", "auto: the servers are on this host and CUDA is here")
    return Choice("auto", per_server)
