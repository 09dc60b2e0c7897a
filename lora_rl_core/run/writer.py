"""`StoreWriter`: a run's store writes (train records, checkpoints, adapter versions) off the step's critical path.

What is written is a snapshot taken by the caller (copies and bytes the next train step cannot change); the
writer only runs the writes, on ONE thread, in the order they were handed over, so the store always holds a
prefix of them: a checkpoint is complete only if every earlier version is, and a version only if its step's
checkpoint is. Each write keeps the store's own rule (data files first, the manifest last), so a version or
checkpoint becomes visible only when complete.

* Back-pressure: at most `max_pending` writes are queued or running; `submit` waits for a slot, so a trainer
  that gets ahead of a slow store waits instead of piling up snapshots in memory.
* Failures: once a write fails, every later one is skipped (nothing newer than a missing write lands), and the
  failure is raised by the next `submit`, `check` or `flush` as a `BackgroundWriteError` naming the write and
  the cause. What was stored before it stays intact; resuming the run redoes the rest.
* `background=False` runs each write at once on the caller's thread (its errors raise as they are): the
  `trainer.background_publish: false` switch.
* `close` waits for the writes still queued and stops the thread: nothing outlives the run that owns it.

Left out: retrying a failed write (`StoreIO` already retries transient store errors with backoff; a write
that still fails fails the run, and the resume redoes it).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_all
from typing import Any, TypeVar

from lora_rl_core.errors import BackgroundWriteError, LoraRLError

log = logging.getLogger(__name__)
T = TypeVar("T")

MAX_PENDING = 2
"""Writes queued or running at most: one step's checkpoint (with its train record) and its adapter version."""


class StoreWriter:
    """Runs store writes in order on one background thread (module docstring).

    Args:
        background: False runs each write on the caller's thread when it is submitted.
        max_pending: writes queued or running at most (>= 1); `submit` waits beyond that.
    """

    def __init__(self, *, background: bool = True, max_pending: int = MAX_PENDING) -> None:
        if max_pending < 1:
            raise LoraRLError(f"max_pending must be >= 1, got {max_pending}")
        self.background = background
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="store-writer") if background else None
        self._slots = threading.BoundedSemaphore(max_pending)
        self._lock = threading.Lock()
        self._futures: list[Future[Any]] = []
        self._failure: BackgroundWriteError | None = None
        self._reported = False  # the failure was raised to a caller
        self._closed = False

    def submit(self, label: str, write: Callable[[], T]) -> Future[T]:
        """Hand `write` over; it runs after every write submitted before it.

        Args:
            label: what it writes, for errors (e.g. `adapter version run-v000003`).
            write: writes a snapshot to the store (and may first serialise it); raises on failure.

        Returns:
            A future that is done when the write is, with what `write` returned; its `result()` raises
            `BackgroundWriteError` if it failed.

        Raises:
            BackgroundWriteError: an earlier write failed (before anything is queued).
            LoraRLError: the writer is closed.
            Exception: with `background=False`, whatever `write` raised.
        """
        self.check()
        if self._closed:
            raise LoraRLError(f"the store writer is closed: {label} cannot be written")
        if self._pool is None:
            done: Future[T] = Future()
            done.set_result(write())
            return done
        self._slots.acquire()  # back-pressure: wait until fewer than max_pending writes are outstanding
        try:
            self.check()  # one may have failed while this waited
            future = self._pool.submit(self._run, label, write)
        except BaseException:
            self._slots.release()
            raise
        future.add_done_callback(lambda _: self._slots.release())
        with self._lock:
            self._futures = [f for f in self._futures if not f.done()] + [future]
        return future

    def _run(self, label: str, write: Callable[[], T]) -> T:
        with self._lock:
            earlier = self._failure
        if earlier is not None:
            raise BackgroundWriteError(f"{label} was not written: an earlier background write failed ({earlier})")
        try:
            return write()
        except Exception as exc:
            error = BackgroundWriteError(
                f"writing {label} to the store in the background failed: {type(exc).__name__}: {exc}. What was "
                "stored before it is intact; resume the run to redo the rest"
            )
            error.__cause__ = exc  # before others can see it (`check` raises from the cause)
            with self._lock:
                self._failure = self._failure or error
            raise error from exc

    def check(self) -> None:
        """Raise the first background failure, if any.

        Raises:
            BackgroundWriteError: a write failed (its message names the write and the cause).
        """
        with self._lock:
            failure = self._failure
            self._reported = self._reported or failure is not None
        if failure is not None:
            raise BackgroundWriteError(str(failure)) from failure.__cause__

    def flush(self) -> None:
        """Wait until every write submitted so far is done.

        Raises:
            BackgroundWriteError: a write failed.
        """
        with self._lock:
            futures = list(self._futures)
        wait_all(futures)
        self.check()

    def close(self) -> None:
        """Wait for the writes still queued, then stop the thread; idempotent. A failure nobody has been told
        of yet is logged, not raised (`close` runs on the way out of a failed run too: use `flush` to see it)."""
        if self._closed:
            return
        self._closed = True
        with self._lock:
            futures, reported = list(self._futures), self._reported
        wait_all(futures)
        if self._failure is not None and not reported:
            log.error("%s", self._failure)
        if self._pool is not None:
            self._pool.shutdown(wait=True)
