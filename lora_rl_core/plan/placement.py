"""`resolve_placement`: which GPUs the trainer ranks and a launched SGLang's servers use
(`placement`, `lora_rl_core.config.placement`), decided once by the run's plan from the visible GPUs.

    colocated   gpus G0..Gn-1: trainer rank i and SGLang server i on Gi (one rank: in this process)
    split       SGLang servers on the first k of the gpus, trainer ranks on the other n-k

SGLang's data parallelism is one server per GPU (a `MultiEngine` over them: a group's samples on one server):
SGLang 0.5.17 refuses dynamic LoRA loads with `--dp-size` > 1 ("dp_size must be 1 or dp attention must be
enabled for dynamic lora loading", seen on two H100s).
    auto        one GPU, or settings that place the run already: as configured; several GPUs with a launched
                SGLang: `AUTO_SEVERAL` (split, measured)
    manual      as `trainer.backend`, `model.device` and `engine.launch.env` say

Pure: the number of visible GPUs is an argument, so every rule is tested without GPUs.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from lora_rl_core.config import (
    AutoPlacement,
    ColocatedPlacement,
    InProcessBackend,
    ManualPlacement,
    PlacedGPUs,
    RolloutMode,
    RunConfig,
    SGLangEngineConfig,
    SplitPlacement,
)
from lora_rl_core.errors import ConfigError

AUTO_SEVERAL = "split"
"""`placement: auto` on several GPUs with a launched SGLang, by measurement (7B shape, 16 x 8 x 256, two H100s of
one host; benchmarks/results/gpu_scale/7b-2gpu-*.json): split 3.93 s/step (async rollouts), colocated 9.26 s,
one GPU 7.66 s. Decoding reads the whole model per token whatever the batch, so a second SGLang server buys
colocated rollouts little (2.76 s against 3.27), and its sharded train phase ran slower than one process."""


TP_SMALLEST = "auto: the smallest tensor parallelism whose memory plan fits"
TP_LARGEST = (
    "auto: the largest tensor parallelism over SGLang's own GPUs that fits and divides the attention heads: "
    "decoding reads every weight once per token, so splitting the weights over GPUs shortens each token step "
    "where more servers do not (7B, 4 H100s: one tp-2 server rolled out 16 x 8 x 256 tokens in 2.37 s, two "
    "servers in 2.82 s)"
)
"""`placement.engine_tp: auto`. Rollouts on SGLang's own GPUs (split) take the largest (measured:
benchmarks/results/gpu_scale/7b-4gpu-split*.json); where SGLang shares the trainer's GPUs, or only serves, the
smallest that fits (not measured with tp > 1; a server per GPU serves more requests at once)."""


@dataclass(frozen=True)
class Placement:
    """Where the trainer and a launched SGLang run.

    Attributes:
        kind: `colocated`, `split`, or `as configured` (one GPU, manual, or settings that place the run).
        trainer_gpus: the trainer's CUDA devices, indices among this process's visible ones, one per FSDP2
            rank (one: the trainer runs in this process there); () = as configured.
        engine_gpus: the launched SGLang's GPUs (same indexing), `engine_tp` per server; () = as configured
            (`engine.launch.env`).
        engine_tp: GPUs per SGLang server (`--tp-size`); the plan resolves `placement.engine_tp: auto`.
        tp_reason: why `engine_tp`, once the plan chose it (`TP_LARGEST`, `TP_SMALLEST` or the setting).
        reason: why, for the run log and `run.json`.
    """

    kind: str
    trainer_gpus: tuple[int, ...] = ()
    engine_gpus: tuple[int, ...] = ()
    reason: str = ""
    engine_tp: int = 1
    tp_reason: str = ""

    def tp_choices(self, cfg: RunConfig, *, heads: int = 0, largest: bool = False) -> list[int]:
        """The tensor parallel sizes to try in order: `placement.engine_tp`, or (`auto`) each of 1, 2, 4, 8 that
        divides the engine GPUs and the model's `heads` attention heads (0: unknown), smallest first or
        `largest` first."""
        asked = cfg.placement.engine_tp if isinstance(cfg.placement, PlacedGPUs) else "auto"
        n = len(self.engine_gpus)
        if isinstance(asked, int):
            if n % asked:
                raise ConfigError(f"placement.engine_tp {asked} does not divide SGLang's {n} GPUs {self.engine_gpus}")
            return [asked]
        options = [t for t in (1, 2, 4, 8) if n % t == 0 and (heads == 0 or heads % t == 0)] or [1]
        return options[::-1] if largest else options

    @property
    def server_gpus(self) -> tuple[tuple[int, ...], ...]:
        """The GPUs of each SGLang server: consecutive groups of `engine_tp`."""
        tp = self.engine_tp
        return tuple(self.engine_gpus[i : i + tp] for i in range(0, len(self.engine_gpus), tp))

    @property
    def ranks(self) -> int:
        """FSDP2 ranks this placement starts: one per trainer GPU where there are several, else 0 (the trainer
        in this process)."""
        return len(self.trainer_gpus) if len(self.trainer_gpus) > 1 else 0

    @property
    def dp_size(self) -> int:
        """SGLang's data parallelism: servers of `engine_tp` GPUs each (1 as configured)."""
        return max(1, len(self.engine_gpus) // self.engine_tp)

    @property
    def shares_gpus(self) -> bool:
        """Trainer and SGLang share their GPUs (colocated)."""
        return bool(set(self.trainer_gpus) & set(self.engine_gpus))

    def describe(self) -> str:
        """One line, e.g. `colocated: 2 trainer ranks on GPUs 0,1; 2 SGLang servers on GPUs 0,1`."""
        if not self.trainer_gpus:
            return self.kind
        trainer = "trainer in this process" if self.ranks == 0 else f"{self.ranks} trainer ranks"
        on = lambda g: f"GPU{'s' if len(g) > 1 else ''} {','.join(map(str, g))}"  # noqa: E731
        servers = f"{self.dp_size} SGLang server{'s' if self.dp_size > 1 else ''}"
        tp = f" (tp {self.engine_tp})" if self.engine_tp > 1 else ""
        return f"{self.kind}: {trainer} on {on(self.trainer_gpus)}; {servers}{tp} on {on(self.engine_gpus)}"


def rollout_mode(cfg: RunConfig, placement: Placement) -> tuple[RolloutMode, str]:
    """`rollout.mode` resolved, with the reason: `auto` is `async` where the placement gives SGLang and the trainer
    GPUs of their own (split: rollouts one step ahead keep both busy; 7B on 2 H100s: 3.9 s/step async) and
    `algorithm.max_staleness` >= 1 lets rollouts run ahead with an off-policy correction, else `sync` (one GPU,
    colocated, a CPU, or as configured: the trainer and the engine take turns)."""
    mode = cfg.rollout.mode
    if mode != "auto":
        return mode, "set in the config"
    if placement.kind != "split":
        return "sync", f"auto: placement {placement.kind}: the trainer and the engine take turns"
    if cfg.algorithm.max_staleness < 1:
        return "sync", "auto: algorithm.max_staleness 0 keeps every rollout on the newest version"
    if cfg.algorithm.correction("async").type == "none":
        return "sync", "auto: algorithm.off_policy_correction none: no importance weights for rollouts one step behind"
    return "async", "auto: placement split: SGLang and the trainer on GPUs of their own, rollouts one step ahead"


def launched_here(cfg: RunConfig) -> bool:
    """This process launches one SGLang server (Ray replicas launch their own on their hosts)."""
    e = cfg.engine
    return isinstance(e, SGLangEngineConfig) and e.launch.enabled and not e.ray_replicas


def _placed_by_settings(cfg: RunConfig) -> list[str]:
    """The settings that place the run's GPUs themselves."""
    placed = []
    if not isinstance(cfg.trainer.backend, InProcessBackend):
        placed.append(f"trainer.backend {cfg.trainer.backend.type}")
    if isinstance(cfg.engine, SGLangEngineConfig) and "CUDA_VISIBLE_DEVICES" in cfg.engine.launch.env:
        placed.append("engine.launch.env CUDA_VISIBLE_DEVICES")
    if re.fullmatch(r"cuda:\d+", cfg.model.device):
        placed.append(f"model.device {cfg.model.device}")
    return placed


def resolve_placement(cfg: RunConfig, visible_gpus: int, *, train: bool = True) -> Placement:
    """The run's placement (module docstring) on a machine with `visible_gpus` CUDA devices (0: none). Without
    a trainer (`train=False`: `lora-rl serve`, an evaluation) every GPU of a placement gets an SGLang server.

    Raises:
        ConfigError: `colocated` or `split` without a launched SGLang or a CUDA device, beside settings that
            place the run themselves, with GPUs that are not visible, or a split without GPUs for both.
    """
    placement = _resolve(cfg, visible_gpus)
    if train or not placement.engine_gpus:
        return placement
    gpus = tuple(sorted(placement.trainer_gpus + placement.engine_gpus))
    return Placement(
        placement.kind, (), tuple(dict.fromkeys(gpus)), f"{placement.reason}; no trainer: SGLang on every GPU"
    )


def _resolve(cfg: RunConfig, visible_gpus: int) -> Placement:
    p = cfg.placement
    if isinstance(p, ManualPlacement):
        return Placement("as configured", reason="placement: manual")
    placed = _placed_by_settings(cfg)
    if isinstance(p, AutoPlacement):
        if placed:
            return Placement("as configured", reason=f"auto: {', '.join(placed)} place the run")
        if not launched_here(cfg) or visible_gpus < 2 or cfg.model.device == "cpu":
            why = "no SGLang launched here" if not launched_here(cfg) else f"{visible_gpus} GPU visible"
            return Placement("as configured", reason=f"auto: {why}")
        why = f"auto: {visible_gpus} GPUs (split measured fastest: 3.9 s/step against 9.3 colocated, 7B on 2 H100s)"
        return _place(cfg, AUTO_SEVERAL, list(range(visible_gpus)), "auto", visible_gpus, why)
    kind = p.type
    if placed:
        raise ConfigError(
            f"placement: {kind} places the GPUs itself, but {', '.join(placed)} also do; remove them or set "
            "placement: manual"
        )
    if not launched_here(cfg):
        raise ConfigError(
            f"placement: {kind} places a launched SGLang: set engine.type: sglang and engine.launch.enabled: true "
            "(without engine.ray_replicas), or placement: manual"
        )
    if visible_gpus < 1 or cfg.model.device == "cpu":
        raise ConfigError(f"placement: {kind} needs CUDA GPUs; this process sees {visible_gpus}")
    gpus = list(range(visible_gpus)) if p.gpus == "all" else list(p.gpus)
    engine_gpus = p.engine_gpus if isinstance(p, SplitPlacement) else "auto"
    return _place(cfg, kind, gpus, engine_gpus, visible_gpus, "set")


def _place(cfg: RunConfig, kind: str, gpus: list[int], engine_gpus: int | str, visible: int, why: str) -> Placement:
    missing = [g for g in gpus if g >= visible]
    if missing:
        raise ConfigError(f"placement.gpus {missing} are not visible here ({visible} GPUs: 0..{visible - 1})")
    if kind == "colocated":
        assert isinstance(cfg.placement, AutoPlacement | ColocatedPlacement)
        return Placement("colocated", tuple(gpus), tuple(gpus), f"{why}: trainer and SGLang on every GPU")
    if len(gpus) < 2:
        raise ConfigError(f"placement: split needs 2 or more GPUs, got {gpus}")
    k = max(1, len(gpus) // 2) if engine_gpus == "auto" else int(engine_gpus)
    if k >= len(gpus):
        raise ConfigError(f"placement.engine_gpus {k} leaves none of GPUs {gpus} to the trainer")
    return Placement("split", tuple(gpus[k:]), tuple(gpus[:k]), f"{why}: SGLang on {k} GPUs, the trainer on the rest")
