"""The step loop: the one place that says in which order a training run's phases run.

    publish(0) -> sync                                     the fresh, no-op LoRA is version 0
    for step k = 1 .. steps:
        rollout(k) -> score(k) -> train(k) -> publish(k) -> sync
    flush                                                  every version and checkpoint is in the store

Train and publish take their snapshots at once and hand the store writes (step k's train record and
checkpoint, then version k) to the run's writer, which writes them in order on one background thread while
the next rollout runs (`trainer.background_publish`); sync gives the engines the new version from memory
(docs/DESIGN.md, "Publish and checkpoint in the background"). A failed write is raised by the next train or
publish, or by `flush`, which the loop calls at the end, and on a failure before it raises, so nothing is
still being written when the loop returns.

In `rollout.mode: async` (`ahead` > 0), taking step k's rollout first submits those of steps k .. k + ahead,
so up to `ahead` rollouts are generated while step k trains, each with the version current when it starts
(docs/DESIGN.md, "Asynchronous rollouts"); the trainer drops and corrects stale rows (`TrainBatch.from_scored`).

`run_steps` drives any `StepPhases`: `RunPhases` calls `lora_rl_core.run.phases` and `versions` directly (the
CPU benchmark, tests, scripts), the Prefect flow wraps each phase as a task (`tasks.steps.TaskPhases`: cached,
retried, persisted) and submits async rollouts as task futures. Evaluation and the report stay with the caller.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

from lora_rl_core.errors import BackgroundWriteError
from lora_rl_core.records import RolloutStats, ScoreStats, SyncStats, TrainStats
from lora_rl_core.run import phases, versions
from lora_rl_core.run.components import RunComponents
from lora_rl_core.store import AdapterRef

log = logging.getLogger(__name__)


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

    def flush(self) -> None:
        """Wait until every train record, checkpoint and version handed to the store is written; raise the
        first background write that failed."""
        ...


@dataclass
class LoopResult:
    """What `run_steps` returns.

    Attributes:
        history: one metrics dict per step (`step`, `steps`, every phase's stats, `step_seconds`).
        final: the last published version (version 0 when `steps` is 0), as `publish` returned it: its `sha256`
            may be None (`AdapterStore.ref` gives the complete ref; the version is in the store).
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
        ahead: rollouts generated ahead of the step that trains (`RunPlan.rollouts_ahead()`; 0 = sync mode).
        on_step: called after each step with its metrics (logging, progress events, benchmarks).

    Returns:
        The history and the final version, every version and checkpoint written to the store.

    Raises:
        whatever a phase raised, or `BackgroundWriteError` for a failed store write (naming it); rollouts
        already running ahead finish (and persist their output), and the store writes still queued finish,
        before it propagates.
    """
    rollouts = _Rollouts(run, ahead=ahead, last=steps)
    history: list[dict[str, Any]] = []
    try:
        ref = run.publish(0, {})
        run.sync(ref)
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
    except BaseException as error:
        rollouts.drain()
        _flush_after_failure(run, error)
        raise
    run.flush()  # the final version and checkpoint are complete before the caller evaluates or reports
    return LoopResult(history, ref)


def _flush_after_failure(run: StepPhases, error: BaseException) -> None:
    """Let the queued store writes finish on the way out of a failed loop; the loop's own `error` propagates."""
    try:
        run.flush()
    except Exception as exc:  # noqa: BLE001 - reported, but the step's error is the one that propagates
        if not isinstance(error, BackgroundWriteError):
            log.warning("a store write failed too while the run was failing: %s", exc)


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
        self._pool = ThreadPoolExecutor(max_workers=max(1, run.plan.rollouts_ahead()), thread_name_prefix="rollout")

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

    def flush(self) -> None:
        """`versions.flush`."""
        versions.flush(self.run)
