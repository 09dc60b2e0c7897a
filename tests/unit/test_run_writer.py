"""`StoreWriter`: a run's store writes on one background thread, in order, at most `max_pending` outstanding; a
failed write stops every later one and is raised, naming it and its cause, by the next submit, check or flush;
close waits for what is queued and leaves no thread behind."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from lora_rl_core.errors import BackgroundWriteError, LoraRLError
from lora_rl_core.run.writer import StoreWriter


def writer_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("store-writer")]


@pytest.fixture
def writer():
    w = StoreWriter()
    yield w
    w.close()


def test_writes_run_in_order_on_one_background_thread(writer):
    done: list[tuple[int, str]] = []
    for i in range(5):
        writer.submit(f"write {i}", lambda i=i: done.append((i, threading.current_thread().name)))
    writer.flush()
    assert [i for i, _ in done] == [0, 1, 2, 3, 4]
    assert {name for _, name in done} == {writer_threads()[0].name} != {threading.current_thread().name}


def test_submit_returns_before_the_write_is_done_and_its_future_says_when(writer):
    gate = threading.Event()
    future = writer.submit("slow write", lambda: gate.wait() and "ref")
    assert not future.done()
    gate.set()
    assert future.result(timeout=5) == "ref"  # what the write returned (a version's complete ref)


def test_a_third_write_waits_while_two_are_outstanding():
    writer = StoreWriter(max_pending=2)
    gate, submitted = threading.Event(), threading.Event()
    try:
        writer.submit("blocked", gate.wait)
        writer.submit("queued", lambda: None)
        third = threading.Thread(target=lambda: (writer.submit("third", lambda: None), submitted.set()))
        third.start()
        assert not submitted.wait(0.3)  # back-pressure: the trainer waits instead of piling up snapshots
        gate.set()
        assert submitted.wait(5)
        third.join(5)
    finally:
        gate.set()
        writer.close()


def test_a_failed_write_is_raised_by_the_next_submit_with_its_name_and_cause(writer):
    def fail() -> None:
        raise OSError("disk full")

    failed = writer.submit("adapter version r-v000003", fail)
    with pytest.raises(BackgroundWriteError, match="adapter version r-v000003.*OSError: disk full") as info:
        failed.result(timeout=5)
    assert isinstance(info.value.__cause__, OSError)
    ran: list[str] = []
    with pytest.raises(BackgroundWriteError, match="r-v000003.*disk full") as again:
        writer.submit("the checkpoint of step 4", lambda: ran.append("ckpt"))
    assert isinstance(again.value.__cause__, OSError) and ran == []
    with pytest.raises(BackgroundWriteError, match="r-v000003"):
        writer.flush()


def test_writes_queued_behind_a_failed_one_never_run(writer):
    gate = threading.Event()
    ran: list[str] = []

    def fail() -> None:
        gate.wait()
        raise OSError("connection reset")

    writer.submit("the checkpoint of step 2", fail)
    later = writer.submit("adapter version r-v000002", lambda: ran.append("v2"))  # queued while the first runs
    gate.set()
    with pytest.raises(BackgroundWriteError, match="r-v000002 was not written.*checkpoint of step 2"):
        later.result(timeout=5)
    assert ran == []  # nothing newer than a missing write lands in the store
    with pytest.raises(BackgroundWriteError, match="checkpoint of step 2.*connection reset"):
        writer.check()


def test_close_waits_for_queued_writes_and_stops_the_thread():
    writer = StoreWriter()
    done: list[int] = []
    writer.submit("slow", lambda: (time.sleep(0.2), done.append(1)))
    writer.submit("next", lambda: done.append(2))
    writer.close()
    writer.close()  # idempotent
    assert done == [1, 2] and not writer_threads()
    with pytest.raises(LoraRLError, match="closed"):
        writer.submit("late", lambda: None)


def test_close_logs_a_failure_nobody_was_told_of(caplog):
    writer = StoreWriter()
    writer.submit("adapter version r-v000001", lambda: 1 / 0)
    with caplog.at_level(logging.ERROR, logger="lora_rl_core.run.writer"):
        writer.close()
    assert "r-v000001" in caplog.text and "ZeroDivisionError" in caplog.text and not writer_threads()


def test_without_background_writes_run_at_once_and_raise_as_they_are():
    writer = StoreWriter(background=False)
    ran: list[str] = []
    future = writer.submit("now", lambda: ran.append(threading.current_thread().name))
    assert future.done() and ran == [threading.current_thread().name] and not writer_threads()
    with pytest.raises(ZeroDivisionError):
        writer.submit("bad", lambda: 1 / 0)
    writer.close()
