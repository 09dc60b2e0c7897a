"""Math answers checked with Hugging Face's `math-verify` (Apache-2.0; TRL's and Open-R1's accuracy reward use
it): `parse` the gold answer and the completion's answer span, then `verify(gold, answer)` (gold first: the
check is not symmetric).

math-verify's own timeouts use `signal.alarm`, which works only on a process's main thread (Math-Verify #50,
#55), and a pathological expression can keep sympy busy for minutes. So `MathVerifier` runs every check in a
worker process (a `pebble.ProcessPool`, spawned on first use) with math-verify's own timeouts off and a
deadline per answer: an answer that takes longer is not verified (0.0) and its worker is replaced, so the
step goes on. The pool belongs to whoever made the verifier (`close()`, or a `with` block); it never outlives
it.
"""

from __future__ import annotations

import logging
import multiprocessing
import threading
from collections.abc import Sequence
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from lora_rl_core.rewards.answers import answer_span, stated_text

VERIFY_TIMEOUT_S = 5.0
"""Default seconds one answer may take to parse and verify (math-verify's own default, 5 s)."""


def check_answer(gold: str, completion: str) -> bool:
    """Whether `completion` states `gold` (math-verify on `answer_span(completion)`; a gold answer math-verify
    finds no math in is compared as case-folded text with `stated_text`), in this process, without a timeout:
    the body of a worker's task."""
    from math_verify import parse, verify

    logging.getLogger("math_verify").setLevel(logging.ERROR)  # it warns on every call that its timeout is off
    gold_parsed = parse(gold, parsing_timeout=None)  # None: no signal-based timeout
    if not gold_parsed:  # a gold answer that is no math (`Yes`, a name): compared as text
        return _normalized(stated_text(completion)) == _normalized(gold)
    answer = parse(answer_span(completion), parsing_timeout=None)
    return bool(verify(gold_parsed, answer, timeout_seconds=None))


def _normalized(text: str) -> str:
    return " ".join(text.split()).strip(" .").casefold()


class MathVerifier:
    """Checks answers in worker processes with a deadline per answer (module docstring).

    Args:
        timeout_s: seconds one answer may take (`reward.verify_timeout_s`).
        workers: worker processes.
    """

    def __init__(self, *, timeout_s: float = VERIFY_TIMEOUT_S, workers: int = 1) -> None:
        self.timeout_s = timeout_s
        self.workers = workers
        self.timeouts = 0
        self.crashes = 0
        self._closed = False
        self._pool: Any = None
        self._lock = threading.Lock()

    def check(self, golds: Sequence[str], completions: Sequence[str]) -> list[bool]:
        """Whether each completion states its gold answer; an answer past the deadline, or one whose worker
        died (sympy can exhaust memory), counts as not stated (`timeouts`, `crashes`).

        Raises:
            RuntimeError: the verifier is closed.
        """
        from pebble import ProcessExpired

        pool = self._start()
        futures = [
            pool.schedule(check_answer, args=(g, c), timeout=self.timeout_s)
            for g, c in zip(golds, completions, strict=True)
        ]
        out = []
        for future in futures:
            try:
                out.append(bool(future.result()))
            except FutureTimeout:
                self.timeouts += 1
                out.append(False)
            except ProcessExpired:
                self.crashes += 1
                out.append(False)
        return out

    def _start(self) -> Any:
        with self._lock:
            if self._closed:
                raise RuntimeError("the math verifier is closed")
            if self._pool is None:
                from pebble import ProcessPool  # lazy: only runs that verify math answers start workers

                # spawn: a fresh interpreter, never a fork of a process that runs torch threads
                self._pool = ProcessPool(max_workers=self.workers, context=multiprocessing.get_context("spawn"))
            return self._pool

    def close(self) -> None:
        """Stop the worker processes (idempotent)."""
        with self._lock:
            self._closed = True
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.stop()
            pool.join(timeout=10)

    def __enter__(self) -> MathVerifier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
