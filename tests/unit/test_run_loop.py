"""`run_steps`: the one place that says the step order, in sync and async mode, and what it does on a failure.

A recording `PhaseRunner` stands in for the run (no model): the test asserts the exact sequence of phase calls,
the metrics handed to `on_step`, that the store writes are flushed at the end, and that rollouts submitted ahead
and the store writes are waited for when a step fails. The real
phases run through the same loop in the flow tests and `benchmarks/cpu_step.py`.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass

import pytest

from lora_rl_core.errors import BackgroundWriteError
from lora_rl_core.run.loop import run_steps


@dataclass
class Stats:
    values: dict

    def metrics(self) -> dict:
        return dict(self.values)


@dataclass
class Ref:
    version: int

    @property
    def name(self) -> str:
        return f"r-v{self.version:06d}"


class Recorder:
    """A `PhaseRunner` that records every phase it is given by the phase function's name; `fail_train` makes
    that step's train raise, `fail_flush` every flush."""

    def __init__(self, fail_train: int | None = None, fail_flush: Exception | None = None) -> None:
        self.calls: list[str] = []
        self.fail_train = fail_train
        self.fail_flush = fail_flush
        self.waited: list[int] = []

    def call(self, phase, *args):
        return getattr(self, phase.__name__)(*args)

    def submit(self, phase, step):
        assert phase.__name__ == "rollout"
        self.calls.append(f"submit{step}")
        recorder = self

        class Pending(Future):
            def result(self, timeout=None):
                recorder.waited.append(step)
                recorder.calls.append(f"result{step}")
                return Stats({"completions": 4, "rollout_step": step})

        return Pending()

    def publish(self, step, metrics):
        self.calls.append(f"publish{step}")
        return Ref(step)

    def sync(self, ref):
        self.calls.append(f"sync{ref.version}")
        return Stats({"adapter": ref.name})

    def rollout(self, step):
        self.calls.append(f"rollout{step}")
        return Stats({"completions": 4, "rollout_step": step})

    def score(self, step):
        self.calls.append(f"score{step}")
        return Stats({"reward_mean": step / 10})

    def train(self, step):
        self.calls.append(f"train{step}")
        if step == self.fail_train:
            raise RuntimeError(f"train {step} failed")
        return Stats({"loss": -step})

    def flush(self):
        self.calls.append("flush")
        if self.fail_flush is not None:
            raise self.fail_flush


def test_sync_mode_runs_the_phases_in_order_and_reports_each_step():
    phases, seen = Recorder(), []
    done = run_steps(phases, steps=2, on_step=seen.append)
    assert phases.calls == [
        "publish0", "sync0",
        "rollout1", "score1", "train1", "publish1", "sync1",
        "rollout2", "score2", "train2", "publish2", "sync2",
        "flush",
    ]  # fmt: skip
    assert done.final.version == 2 and done.history == seen
    assert [m["step"] for m in seen] == [1, 2] and all(m["steps"] == 2 for m in seen)
    assert seen[1]["rollout_step"] == 2 and seen[1]["reward_mean"] == 0.2 and seen[1]["loss"] == -2
    assert seen[1]["adapter"] == "r-v000002" and seen[1]["step_seconds"] >= 0


def test_async_mode_submits_rollouts_ahead_of_the_step_that_trains():
    phases = Recorder()
    run_steps(phases, steps=3, ahead=1)
    assert phases.calls == [
        "publish0", "sync0",
        "submit1", "submit2", "result1", "score1", "train1", "publish1", "sync1",
        "submit3", "result2", "score2", "train2", "publish2", "sync2",
        "result3", "score3", "train3", "publish3", "sync3",
        "flush",
    ]  # fmt: skip


def test_a_failed_step_waits_for_the_rollouts_running_ahead_and_the_store_writes_then_raises():
    phases = Recorder(fail_train=1)
    with pytest.raises(RuntimeError, match="train 1 failed"):
        run_steps(phases, steps=3, ahead=2)
    assert phases.calls[-2:] == ["result3", "flush"] and sorted(phases.waited) == [1, 2, 3]  # nothing left running
    assert "publish1" not in phases.calls


def test_a_failed_step_raises_its_own_error_even_when_the_store_writes_failed_too():
    phases = Recorder(fail_train=2, fail_flush=BackgroundWriteError("writing adapter version r-v000001 failed"))
    with pytest.raises(RuntimeError, match="train 2 failed"):
        run_steps(phases, steps=3)
    assert phases.calls[-1] == "flush"


def test_a_failed_background_write_fails_the_loop_after_the_last_step():
    """The flush after the last step waits for the final version and checkpoint and raises a failed write."""
    phases = Recorder(fail_flush=BackgroundWriteError("writing adapter version r-v000002 failed: disk full"))
    with pytest.raises(BackgroundWriteError, match="r-v000002 failed: disk full"):
        run_steps(phases, steps=2)
    assert phases.calls[-3:] == ["publish2", "sync2", "flush"]


def test_zero_steps_publishes_and_syncs_version_zero_only():
    phases = Recorder()
    done = run_steps(phases, steps=0, ahead=1)
    assert phases.calls == ["publish0", "sync0", "flush"] and done.final.version == 0 and done.history == []
