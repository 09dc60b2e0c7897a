"""`InFlightRequests.wait_ended`: a waiting call returns at its own answer, at a reason kept for its own
requests, or at its deadline, and no sooner."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future

from lora_rl_core.engines.base import GenerationRequest, SamplingParams
from lora_rl_core.engines.remote.tracking import InFlightRequests


def _requests(*ids: str) -> list[GenerationRequest]:
    return [GenerationRequest([1, 2], "run-v000001", SamplingParams(max_new_tokens=4), request_id=i) for i in ids]


def _wait_in_thread(tracker: InFlightRequests, ids: list[str], call: Future, deadline_s: float) -> tuple[list, list]:
    out: list = []
    took: list = []

    def run() -> None:
        start = time.monotonic()
        out.append(tracker.wait_ended(ids, call, time.monotonic() + deadline_s))
        took.append(time.monotonic() - start)

    threading.Thread(target=run, daemon=True).start()
    return out, took


def _until(cond, timeout_s: float = 5.0) -> None:
    end = time.monotonic() + timeout_s
    while not cond() and time.monotonic() < end:
        time.sleep(0.01)


def test_returns_none_at_its_own_answer_and_not_at_another_calls():
    tracker = InFlightRequests()
    mine, other = Future(), Future()
    with tracker.tracking(_requests("a")), tracker.tracking(_requests("b")):
        out, took = _wait_in_thread(tracker, ["a"], mine, 30.0)
        time.sleep(0.1)
        other.set_result([])
        tracker.keep_reason("b", "aborted")  # another call's request: not ours
        time.sleep(0.2)
        assert out == []  # still waiting
        mine.set_result([])
        _until(lambda: out)
    assert out == [None] and took[0] < 5.0


def test_returns_the_reasons_once_each_of_its_requests_has_one():
    tracker = InFlightRequests()
    call: Future = Future()
    with tracker.tracking(_requests("a", "b")):
        out, _ = _wait_in_thread(tracker, ["a", "b"], call, 30.0)
        tracker.keep_reason("a", "aborted")
        time.sleep(0.2)
        assert out == []  # "b" has no reason yet
        tracker.keep_reason(None, "paused")  # a pause: every request in flight
        _until(lambda: out)
    assert out == [{"a": "aborted", "b": "paused"}]


def test_at_the_deadline_its_requests_end_timeout():
    tracker = InFlightRequests()
    with tracker.tracking(_requests("a")):
        out, took = _wait_in_thread(tracker, ["a"], Future(), 0.3)
        _until(lambda: out)
    assert out == [{"a": "timeout"}] and 0.25 <= took[0] < 3.0
