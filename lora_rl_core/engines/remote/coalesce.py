"""One answer shared by concurrent callers of a read, never older than the call that gets it.

Our engine server resolves the adapter names of every request it admits from the engine's listing; in front of
SGLang that is one `GET /v1/models` per request, which at a few hundred requests a second is most of the
client's and SGLang's HTTP work (the soak, docs/HOTSWAP.md). `FreshCall` sends one read for all the callers that
arrive while none is being sent, and makes a caller that arrives while one is already in flight wait for the
next one: every answer comes from a read sent after its caller arrived, so nothing a caller did before (a load,
an unload) can be missing from it. A cache with a time-to-live would not promise that.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class FreshCall(Generic[T]):
    """Calls `read` on behalf of concurrent callers: at most one read in flight, each caller answered by the
    first read that started after it arrived (or by a later one). A read's exception goes to each caller it
    answers. Thread-safe; `read` runs in the thread of one of its callers.

    Args:
        read: the read to share (e.g. a `GET /v1/models`), called with no arguments.
    """

    def __init__(self, read: Callable[[], T]) -> None:
        self._read = read
        self._cond = threading.Condition()
        self._started = 0  # reads started so far
        self._done = 0  # the number of the last read finished
        self._running = False
        self._outcome: tuple[T | None, BaseException | None] = (None, None)

    def __call__(self) -> T:
        """The answer of a read that started after this call (blocks while one is in flight).

        Raises:
            BaseException: whatever the read that answers this call raised.
        """
        with self._cond:
            wanted = self._started + 1  # a read in flight now started before this caller: it needs the next one
            while self._done < wanted:
                if not self._running:
                    self._running = True
                    self._started += 1
                    number = self._started
                    break
                self._cond.wait()
            else:
                return self._result()
        value: T | None = None
        error: BaseException | None = None
        try:
            value = self._read()
        except BaseException as exc:  # handed to each waiter, then raised here too
            error = exc
        with self._cond:
            self._done, self._running, self._outcome = number, False, (value, error)
            self._cond.notify_all()
            return self._result()

    def _result(self) -> T:
        value, error = self._outcome
        if error is not None:
            raise error
        return value  # type: ignore[return-value]  # None only alongside an error
