"""A run's checkpoints, written by the trainer's ranks (docs/DESIGN.md, "Checkpoints written by the ranks").

Every `trainer.checkpoint_every` steps the train phase starts one (`start_checkpoint`): each rank snapshots its
own part of the trainer state and uploads it on a thread of its own while the next step trains, so nothing
passes through rank 0 or this process. When every rank has reported its files (`commit_checkpoints`, at the
next train phase and at `flush`), the run's writer writes the run's own part (RNG states, rollout mode) and the
manifest, last, after that step's train record (`write_checkpoint`); a checkpoint exists once its manifest
does. With `trainer.background_publish: false` the ranks' writes are waited for at once, and the checkpoint
is complete before the step's version is published.
"""

from __future__ import annotations

import functools
import random
from typing import Any

import torch

from lora_rl_core.checkpoint import SHARDED, CheckpointTarget
from lora_rl_core.errors import BackgroundWriteError
from lora_rl_core.faults import maybe_fail
from lora_rl_core.run.components import RunComponents
from lora_rl_core.run.state import PendingCheckpoint


def start_checkpoint(run: RunComponents, step: int) -> None:
    """Start the checkpoint after `step`: the trainer's ranks snapshot and upload their parts
    (`Trainer.save_checkpoint`); the run's own part (its step, the resolved `rollout.mode`, this process's
    Python and torch RNG states) is taken now and kept until the ranks are done (`commit_checkpoints`)."""
    cfg = run.cfg
    run.trainer.save_checkpoint(CheckpointTarget(run.store.uri, run.run_id, step, dict(cfg.store.storage_options)))
    state = {
        "step": step,
        "rollout_mode": run.plan.rollout_mode,
        "trainer": SHARDED,
        "torch_rng": torch.get_rng_state(),
        "python_rng": random.getstate(),
    }
    run.pending_checkpoints[step] = PendingCheckpoint(state)


def commit_checkpoints(run: RunComponents, *, wait: bool = False) -> None:
    """Hand every started checkpoint whose ranks have all reported their files to the run's writer
    (`write_checkpoint`), oldest first. `wait`: wait for every rank's writes first (the end of a run).

    Raises:
        BackgroundWriteError: a rank could not write its part (naming the rank, the step and the cause); the
            checkpoints already complete are intact and the run resumes from the newest.
    """
    if not run.pending_checkpoints:  # nothing to ask the ranks: no round trip to them in a step without one
        return
    assert run.plan.trainer is not None  # a training run's plan (`build_run` refuses one without)
    ranks = max(1, run.plan.trainer.world_size)
    for report in run.trainer.written_checkpoints(wait):
        if report.error is not None:
            run.pending_checkpoints.pop(report.step, None)
            raise BackgroundWriteError(
                f"trainer rank {report.rank} could not write its part of the checkpoint of step {report.step} of "
                f"run {run.run_id}: {report.error}"
            )
        pending = run.pending_checkpoints.get(report.step)
        if pending is not None:
            pending.files.update(report.files)
            pending.ranks.add(report.rank)
    for step in sorted(s for s, p in run.pending_checkpoints.items() if len(p.ranks) == ranks):
        pending = run.pending_checkpoints.pop(step)
        write = functools.partial(write_checkpoint, run, step, pending.state, pending.files)
        run.writer.submit(f"the checkpoint of step {step} of run {run.run_id}", write)


def write_checkpoint(run: RunComponents, step: int, state: dict[str, Any], shards: dict[str, Any]) -> None:
    """Write the run's part of the checkpoint of `step` and its manifest, listing the ranks' files (`shards`),
    then prune to `trainer.keep_checkpoints`. Fault point `checkpoint` fires with every file written and the
    manifest not yet.

    Raises:
        StoreError: the store failed (after retries).
    """
    fault = functools.partial(maybe_fail, "checkpoint", step, run.run_dir)
    run.checkpoints.save(run.run_id, step, state, shards=shards, before_manifest=fault)
    run.checkpoints.prune(run.run_id, keep_last=run.cfg.trainer.keep_checkpoints)
