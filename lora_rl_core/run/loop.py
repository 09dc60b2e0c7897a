"""The step loop: the one place that says in which order a training run's phases run.

    publish(0) -> sync                                     the fresh, no-op LoRA is version 0
    for step k = 1 .. steps:
        rollout(k) -> score(k) -> train(k) -> publish(k) -> sync
    flush                                                  every version and checkpoint is in the store

Train and publish take their snapshots at once and hand the store writes (step k's train record, then
version k) to the run's writer, which writes them in order on one background thread while the next rollout
runs (`trainer.background_publish`); the trainer's ranks upload step k's checkpoint themselves, and its
manifest follows version k (`lora_rl_core.run.checkpoints`); sync gives the engines the new version from
memory (docs/DESIGN.md, "Publish and checkpoint in the background"). A failed write is raised by the next train or
publish, or by `flush`, which the loop calls at the end, and on a failure before it raises, so nothing is
still being written when the loop returns.

In `rollout.mode: async` (`ahead` > 0), taking step k's rollout first submits those of steps k .. k + ahead,
so up to `ahead` rollouts are generated while step k trains, each with the version current when it starts
(docs/DESIGN.md, "Asynchronous rollouts"); the trainer drops and corrects stale rows (`TrainBatch.from_scored`).

`run_steps` calls each phase function (`lora_rl_core.run.phases`, `versions`) through a `PhaseRunner`, which
runs it now (`call`) or in the background (`submit`): `RunPhases` calls it directly on the run's components (the
CPU benchmark, tests, scripts); the Prefect flow runs it as the task of the same name (`tasks.steps.TaskPhases`:
cached, retried, persisted), so a phase has one name from this loop to the task run the UI shows. Evaluation and
the report stay with the caller.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Concatenate, ParamSpec, Protocol, TypeVar

from lora_rl_core.errors import BackgroundWriteError
from lora_rl_core.records import RolloutStats
from lora_rl_core.run import phases, versions
from lora_rl_core.run.components import RunComponents
from lora_rl_core.store import AdapterRef

log = logging.getLogger(__name__)
P = ParamSpec("P")
T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)


class Pending(Protocol[T_co]):
    """A phase submitted to run in the background (a `concurrent.futures.Future`, a Prefect task future)."""

    def result(self) -> T_co:
        """Wait for the phase; raises what it raised."""
        ...


class PhaseRunner(Protocol):
    """Runs a phase function of the run (its first argument, the run's components, is the runner's)."""

    def call(self, phase: Callable[Concatenate[RunComponents, P], T], /, *args: P.args, **kwargs: P.kwargs) -> T:
        """Run `phase(run, *args, **kwargs)` now and return what it returned."""
        ...

    def submit(
        self, phase: Callable[Concatenate[RunComponents, P], T], /, *args: P.args, **kwargs: P.kwargs
    ) -> Pending[T]:
        """Start `phase(run, *args, **kwargs)` in the background."""
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
    runner: PhaseRunner,
    *,
    steps: int,
    ahead: int = 0,
    on_step: Callable[[dict[str, Any]], None] | None = None,
) -> LoopResult:
    """Publish and sync version 0, then run steps 1 .. `steps` (module docstring), calling `on_step` with each
    step's metrics.

    Args:
        runner: runs the phase functions (`RunPhases`, or the flow's `TaskPhases`).
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
    rollouts = _Rollouts(runner, ahead=ahead, last=steps)
    history: list[dict[str, Any]] = []
    try:
        ref = runner.call(versions.publish, 0, {})
        runner.call(versions.sync, ref)
        for step in range(1, steps + 1):
            start = time.perf_counter()
            metrics: dict[str, Any] = {"step": step, "steps": steps}
            metrics.update(rollouts.take(step).metrics())
            metrics.update(runner.call(phases.score, step).metrics())
            metrics.update(runner.call(phases.train, step).metrics())
            ref = runner.call(versions.publish, step, metrics)
            metrics.update(runner.call(versions.sync, ref).metrics(), step_seconds=time.perf_counter() - start)
            history.append(metrics)
            if on_step is not None:
                on_step(metrics)
    except BaseException as error:
        rollouts.drain()
        _flush_after_failure(runner, error)
        raise
    runner.call(versions.flush)  # the final version and checkpoint are complete before the caller evaluates or reports
    return LoopResult(history, ref)


def _flush_after_failure(runner: PhaseRunner, error: BaseException) -> None:
    """Let the queued store writes finish on the way out of a failed loop; the loop's own `error` propagates."""
    try:
        runner.call(versions.flush)
    except Exception as exc:  # noqa: BLE001 - reported, but the step's error is the one that propagates
        if not isinstance(error, BackgroundWriteError):
            log.warning("a store write failed too while the run was failing: %s", exc)


@dataclass
class _Rollouts:
    """The rollouts of a loop. Sync mode (`ahead` 0): a step's rollout runs when the step needs it. Async mode:
    taking step k's rollout first submits those of steps k .. k + ahead (not beyond `last`)."""

    runner: PhaseRunner
    ahead: int
    last: int
    pending: dict[int, Pending[RolloutStats]] = field(default_factory=dict)

    def take(self, step: int) -> RolloutStats:
        if self.ahead == 0 and step not in self.pending:
            return self.runner.call(phases.rollout, step)
        for s in range(step, min(self.last, step + self.ahead) + 1):
            if s not in self.pending:
                self.pending[s] = self.runner.submit(phases.rollout, s)
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
    """A `PhaseRunner` over a run's components, without Prefect: each phase is a direct call; submitted ones
    run on worker threads. Use as a context manager (the threads stop on exit).

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
        """Wait for phases still running, then stop the threads."""
        self._pool.shutdown(wait=True, cancel_futures=True)

    def call(self, phase: Callable[Concatenate[RunComponents, P], T], /, *args: P.args, **kwargs: P.kwargs) -> T:
        """`phase(run, ...)` on this thread."""
        return phase(self.run, *args, **kwargs)

    def submit(
        self, phase: Callable[Concatenate[RunComponents, P], T], /, *args: P.args, **kwargs: P.kwargs
    ) -> Future[T]:
        """`phase(run, ...)` on a worker thread."""
        return self._pool.submit(phase, self.run, *args, **kwargs)
