"""`FreshCall`: one read shared by concurrent callers, each answered by a read sent after it arrived."""

from __future__ import annotations

import threading
import time

import pytest

from lora_rl_core.engines.remote.coalesce import FreshCall


class SlowCounter:
    """A read that takes `seconds` and returns (its number, when it started)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.reads = 0
        self.lock = threading.Lock()

    def __call__(self) -> tuple[int, float]:
        with self.lock:
            self.reads += 1
            number = self.reads
        started = time.monotonic()
        time.sleep(self.seconds)
        return number, started


def test_concurrent_callers_share_reads_and_each_answer_started_after_its_caller():
    read = SlowCounter(0.05)
    call = FreshCall(read)
    answers: list[tuple[float, tuple[int, float]]] = []
    lock = threading.Lock()

    def caller() -> None:
        for _ in range(10):
            arrived = time.monotonic()
            answer = call()
            with lock:
                answers.append((arrived, answer))

    threads = [threading.Thread(target=caller) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(answers) == 160
    # 160 calls in ~2 rounds per caller-round: far fewer reads than calls
    assert read.reads <= 40, read.reads
    for arrived, (_, started) in answers:
        assert started >= arrived  # never an answer older than the call


def test_a_failed_read_raises_in_each_caller_it_answers_and_the_next_call_reads_again():
    outcomes = iter([RuntimeError("server gone"), "listed"])

    def read() -> str:
        outcome = next(outcomes)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    call = FreshCall(read)
    with pytest.raises(RuntimeError, match="server gone"):
        call()
    assert call() == "listed"
