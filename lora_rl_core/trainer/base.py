"""The trainer protocol: what the step loop needs of a trainer, whichever backend runs it."""

from __future__ import annotations

from typing import Any, Protocol

import torch

from lora_rl_core.checkpoint import CheckpointTarget, ShardReport
from lora_rl_core.records import TrainBatch


class Trainer(Protocol):
    """What a run needs from its trainer, in-process (`PolicyTrainer`) or sharded over worker processes
    (`lora_rl_core.trainer.workers.TrainerWorkers`). Built by `lora_rl_core.run.components.build_run`.

    Not here, as a run never calls it: `profiled_train_step` (`train_step` under `torch.profiler`), which every
    built trainer also has, for `benchmarks/gpu_scale.py --profile-step`."""

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """One policy update on `batch`; returns the step's metrics (loss, kl, entropy, clip_fraction, ...)."""
        ...

    def adapter_state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """The full adapter: PEFT-keyed float32 CPU tensors and the JSON-safe PEFT config. The tensors are copies
        that later train steps do not change (a version is written, and engines keep it, while training goes on)."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume (`PolicyTrainer.state_dict` format, loadable at any world size), as copies
        that later train steps do not change, gathered whole into this process (a run's checkpoints are
        written by the ranks instead: `save_checkpoint`)."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a `state_dict()`, or a checkpoint's trainer state (`CheckpointStore.load`), of any world size."""
        ...

    def save_checkpoint(self, target: CheckpointTarget) -> None:
        """Every rank snapshots its part of the state now and writes it to the store in the background
        (`CheckpointStore.write_shard`); the next train step may start at once."""
        ...

    def written_checkpoints(self, wait: bool = False) -> list[ShardReport]:
        """The ranks' checkpoint writes that ended since the last call, one report per rank and checkpoint
        (`wait`: every write queued, waited for)."""
        ...

    def close(self) -> None:
        """Release what the trainer started (worker processes); idempotent."""
        ...
