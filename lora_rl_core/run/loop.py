"""The step loop: the one place that says in which order a training run's phases run.

    publish(0) -> sync                                     the fresh, no-op LoRA is version 0
    for step k = 1 .. steps:
        rollout(k) -> score(k) -> train(k) -> publish(k) -> sync

In `rollout.mode: async` (`ahead` > 0), taking step k's rollout first submits those of steps k .. k + ahead,
so up to `ahead` rollouts are generated while step k trains, each with the version current when it starts
(docs/DESIGN.md, "Asynchronous rollouts"); the trainer drops and corrects stale rows (`TrainBatch.from_scored`).

`run_steps` drives any `StepPhases`: `RunPhases` calls `lora_rl_core.run.phases` and `versions` directly (the
CPU benchmark, tests, scripts), the Prefect flow wraps each phase as a task (`tasks.steps.TaskPhases`: cached,
retried, persisted) and submits async rollouts as task futures. Evaluation and the report stay with the caller.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

from lora_rl_core.records import RolloutStats, ScoreStats, SyncStats, TrainStats
from lora_rl_core.run import phases, versions
from lora_rl_core.run.components import RunComponents
from lora_rl_core.store import AdapterRef


class Pending(Protocol):
    """A rollout submitted ahead (a `concurrent.futures.Future`, a Prefect task future)."""

    def result(self) -> RolloutStats:
        """Wait for the rollout; raises what it raised."""
        ...


class StepPhases(Protocol):
    """The phases of one training step, as `run_steps` calls them."""

    def publish(self, step: int, metrics: Mapping[str, Any]) -> AdapterRef:
        """Publish the trainer's adapter as version `step` (numeric `metrics` go into its manifest)."""
        ...

    def sync(self, ref: AdapterRef) -> SyncStats:
        """Make version `ref` the one rollouts use."""
        ...

    def rollout(self, step: int) -> RolloutStats:
        """Sample step `step`'s completions now."""
        ...

    def submit_rollout(self, step: int) -> Pending:
        """Start step `step`'s rollout in the background."""
        ...

    def score(self, step: int) -> ScoreStats:
        """Reward step `step`'s completions and compute advantages."""
        ...

    def train(self, step: int) -> TrainStats:
        """One policy update on step `step`'s scored rollouts."""
        ...


@dataclass
class LoopResult:
    """What `run_steps` returns.

    Attributes:
        history: one metrics dict per step (`step`, `steps`, every phase's stats, `step_seconds`).
        final: the last published version (version 0 when `steps` is 0).
    """

    history: list[dict[str, Any]]
    final: AdapterRef


def run_steps(
    run: StepPhases,
    *,
    steps: int,
    ahead: int = 0,
    on_step: Callable[[dict[str, Any]], None] | None = None,
) -> LoopResult:
    """Publish and sync version 0, then run steps 1 .. `steps` (module docstring), calling `on_step` with each
    step's metrics.

    Args:
        run: the phases (`RunPhases`, or the flow's tasks).
        steps: the number of training steps (`trainer.steps`).
        ahead: rollouts generated ahead of the step that trains (`RunConfig.rollouts_ahead()`; 0 = sync mode).
        on_step: called after each step with its metrics (logging, progress events, benchmarks).

    Raises:
        whatever a phase raised; rollouts already running ahead finish (and persist their output) first.
    """
    ref = run.publish(0, {})
    run.sync(ref)
    rollouts = _Rollouts(run, ahead=ahead, last=steps)
    history: list[dict[str, Any]] = []
    try:
        for step in range(1, steps + 1):
            start = time.perf_counter()
            metrics: dict[str, Any] = {"step": step, "steps": steps}
            metrics.update(rollouts.take(step).metrics())
            metrics.update(run.score(step).metrics())
            metrics.update(run.train(step).metrics())
            ref = run.publish(step, metrics)
            metrics.update(run.sync(ref).metrics(), step_seconds=time.perf_counter() - start)
            history.append(metrics)
            if on_step is not None:
                on_step(metrics)
    finally:
        rollouts.drain()
    return LoopResult(history, ref)


@dataclass
class _Rollouts:
    """The rollouts of a loop. Sync mode (`ahead` 0): a step's rollout runs when the step needs it. Async mode:
    taking step k's rollout first submits those of steps k .. k + ahead (not beyond `last`)."""

    run: StepPhases
    ahead: int
    last: int
    pending: dict[int, Pending] = field(default_factory=dict)

    def take(self, step: int) -> RolloutStats:
        if self.ahead == 0 and step not in self.pending:
            return self.run.rollout(step)
        for s in range(step, min(self.last, step + self.ahead) + 1):
            if s not in self.pending:
                self.pending[s] = self.run.submit_rollout(s)
        return self.pending.pop(step).result()

    def drain(self) -> None:
        """Wait for the rollouts still running (after a failed step their results persist for a resume, or
        they fail on their own; either way nothing runs on once the loop has returned)."""
        for pending in self.pending.values():
            try:
                pending.result()
            except Exception:  # noqa: BLE001 - the step's own error is the one that propagates
                pass
        self.pending.clear()


class RunPhases:
    """`StepPhases` over a run's components, without Prefect: each phase is a call into `run.phases` /
    `run.versions`; async rollouts run on worker threads. Use as a context manager (the threads stop on exit).

    Args:
        run: the components (`build_run`).
    """

    def __init__(self, run: RunComponents) -> None:
        self.run = run
        self._pool = ThreadPoolExecutor(max_workers=max(1, run.cfg.rollouts_ahead()), thread_name_prefix="rollout")

    def __enter__(self) -> RunPhases:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Wait for rollouts still running, then stop the threads."""
        self._pool.shutdown(wait=True, cancel_futures=True)

    def publish(self, step: int, metrics: Mapping[str, Any]) -> AdapterRef:
        """`versions.publish`."""
        return versions.publish(self.run, step, dict(metrics))

    def sync(self, ref: AdapterRef) -> SyncStats:
        """`versions.sync`."""
        return versions.sync(self.run, ref)

    def rollout(self, step: int) -> RolloutStats:
        """`phases.rollout`, on this thread."""
        return phases.rollout(self.run, step)

    def submit_rollout(self, step: int) -> Future[RolloutStats]:
        """`phases.rollout` on a worker thread."""
        return self._pool.submit(phases.rollout, self.run, step)

    def score(self, step: int) -> ScoreStats:
        """`phases.score`."""
        return phases.score(self.run, step)

    def train(self, step: int) -> TrainStats:
        """`phases.train`."""
        return phases.train(self.run, step)
