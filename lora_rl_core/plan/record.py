"""The run's plan as records: `RunPlan` (every `auto` setting resolved, with the reason for each choice) and
`TrainerPlan`, the part the trainer is built from, which travels as JSON to trainer ranks (spawned processes,
Ray actors). Made once, by `lora_rl_core.plan.make.make_plan`, before any engine, worker or store write."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from lora_rl_core.config import RolloutMode, RunConfig, TensorTransport
from lora_rl_core.engines.launch.process import LaunchBudget
from lora_rl_core.engines.launch.resolve import ResolvedLaunch
from lora_rl_core.memory import MemoryPlan
from lora_rl_core.records import BatchRules
from lora_rl_core.trainer.plan import TrainerPlan


@dataclass(frozen=True)
class Choice:
    """One resolved setting.

    Attributes:
        value: what it resolved to (JSON-safe: a string, number, bool or None).
        reason: one line: why (`auto: ...`), or `set in the config`.
    """

    value: Any
    reason: str


@dataclass(frozen=True)
class EnginePlan:
    """How this run's engine is built, every `auto` resolved that can be resolved here.

    Attributes:
        device / dtype: the embedded engine's model device and dtype (this process).
        launch: the SGLang server this process launches, its `auto` settings resolved against the installed
            SGLang (`engines.launch.resolve`); None when none is launched here.
        launch_budget: what Ray SGLang replicas resolve their own `auto` settings with on their hosts.
        tensor_transport: `engine.tensor_transport` resolved where the servers are known (`auto` stays for
            servers whose host is known only at connect time: then per server, `ipc` on this host with CUDA,
            else the published folder).
        sync_reads_folder: a sync reads the version's published folder, so it waits for the store write.
    """

    device: str
    dtype: str
    launch: ResolvedLaunch | None
    launch_budget: LaunchBudget | None
    tensor_transport: TensorTransport
    sync_reads_folder: bool


@dataclass(frozen=True)
class RunPlan:
    """Everything a run decides before it starts: the validated config, each `auto` setting resolved with
    its reason, the memory plan and the build plans of the engine and the trainer. Made once
    (`make_plan`); `run.json` and the run log show it once (`summary`, `describe`); the builders take its
    sections (`trainer`, `engine`) and never a rewritten config.

    Attributes:
        config: the run's config as validated (frozen sections: never rewritten).
        device: the model's device in this process (the embedded engine's; `model.device` resolved).
        trainer: the trainer's build plan; None for an evaluation or a server (no trainer).
        engine: the engine's build plan.
        memory: the GPU memory plan (None on a CPU).
        cpu_threads: torch's intra-op threads in this process.
        batch: which scored rows a train step uses (the `algorithm` section's rules: `BatchRules`).
        choices: every resolved setting by its dotted config name, with the reason (read-only).
        rollout_mode: `rollout.mode` resolved (`sync` or `async`; `plan.placement.rollout_mode`).

    A run's local files go to `workdir(run_id)`: `<run.output_dir>/<run_id>`.
    """

    config: RunConfig
    device: str
    trainer: TrainerPlan | None
    engine: EnginePlan
    memory: MemoryPlan | None
    cpu_threads: int
    batch: BatchRules
    choices: Mapping[str, Choice] = field(default_factory=dict)
    rollout_mode: RolloutMode = "sync"

    def __post_init__(self) -> None:
        # deeply frozen: the config's sections are frozen models, and the choices a read-only view
        object.__setattr__(self, "choices", MappingProxyType(dict(self.choices)))

    def rollouts_ahead(self) -> int:
        """How many steps ahead of the training step rollouts run (`algorithm.max_staleness` in async mode, 0 in
        sync mode): the step loop's `ahead`."""
        return self.config.rollouts_ahead(self.rollout_mode)

    def workdir(self, run_id: str) -> Path:
        """The run's local folder: the report, plots and launched servers' logs (`<run.output_dir>/<run_id>`)."""
        return Path(self.config.run.output_dir) / run_id

    def summary(self) -> dict[str, Any]:
        """The plan as JSON-safe values, for `run.json`, the report and the run's resume record: the device,
        the model and LoRA compute dtypes with their reasons (the keys the report reads), CPU threads, every
        choice (`{setting: {"value", "reason"}}`) and the memory plan (GiB; GPU runs only)."""
        c = self.choices
        out: dict[str, Any] = {
            "device": self.device,
            "dtype": c["model.dtype"].value,
            "dtype_reason": c["model.dtype"].reason,
            "cpu_threads": self.cpu_threads,
            "choices": {name: {"value": ch.value, "reason": ch.reason} for name, ch in c.items()},
        }
        if "trainer.lora_compute_dtype" in c:
            out["lora_compute_dtype"] = c["trainer.lora_compute_dtype"].value
            out["lora_compute_dtype_reason"] = c["trainer.lora_compute_dtype"].reason
        if self.memory is not None:
            out["memory_plan"] = self.memory.summary()
        return out
