"""Whether a completion states the gold answer: the stated answer alone (`answers.extract_answer`, in
`reward.answer_format`) is graded, never the rest of the completion.

* A numeric gold answer (`1,250`, `-3.5`, `3/4`, `45%`) matches only a stated number (`answers.stated_number`,
  `numbers_equal`), in this process: an expression that evaluates to the gold (`76 + 57`) is no stated number.
* A symbolic gold answer (LaTeX, `\\frac{\\pi}{2}`, intervals, sets) goes to Hugging Face's `math-verify`
  (Apache-2.0; TRL's and Open-R1's accuracy reward use it): `parse` the gold answer and the extracted span
  only, then `verify(gold, answer)` (gold first: the check is not symmetric). A gold answer math-verify
  finds no math in (`Yes`, a name) is compared with the span as case-folded text.

math-verify's own timeouts use `signal.alarm`, which works only on a process's main thread (Math-Verify #50,
#55), and a pathological expression can keep sympy busy for minutes. So `MathVerifier` runs every symbolic
check in a worker process (a `pebble.ProcessPool`, spawned on first use) with math-verify's own timeouts off
and a deadline per answer: an answer that takes longer is not verified (0.0) and its worker is replaced, so
the step goes on. The pool belongs to whoever made the verifier (`close()`, or a `with` block); it never
outlives it.
"""

from __future__ import annotations

import logging
import multiprocessing
import re
import threading
from collections.abc import Sequence
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from lora_rl_core.rewards.answers import (
    AnswerFormat,
    check_answer_format,
    extract_answer,
    numbers_equal,
    parse_gold_number,
    stated_number,
)

VERIFY_TIMEOUT_S = 5.0
"""Default seconds one answer may take to parse and verify (math-verify's own default, 5 s)."""


def numeric_verdict(gold: str, completion: str, answer_format: AnswerFormat) -> bool | None:
    """Whether `completion` states the numeric `gold` answer (module docstring); None when `gold` is not one
    number (a symbolic or text gold: `check_answer` sends it to math-verify)."""
    gold_number = parse_gold_number(gold)
    if gold_number is None:
        return None
    span = extract_answer(completion, answer_format)
    stated = stated_number(span) if span is not None else None
    return stated is not None and numbers_equal(gold_number, stated)


def check_answer(gold: str, completion: str, answer_format: AnswerFormat) -> bool:
    """Whether `completion` states `gold` (module docstring), in this process, without a timeout: the body of a
    worker's task.

    Raises:
        ValueError: an unknown `answer_format`.
    """
    numeric = numeric_verdict(gold, completion, answer_format)
    if numeric is not None:
        return numeric
    span = extract_answer(completion, answer_format)
    if span is None:
        return False
    if _WORDS_RE.fullmatch(gold.strip()):  # a gold answer that is no math (`Yes`, a name): compared as text
        return _normalized(span) == _normalized(gold)
    from math_verify import verify

    logging.getLogger("math_verify").setLevel(logging.ERROR)  # it warns on every call that its timeout is off
    return bool(verify(_parse(gold), _parse(span), timeout_seconds=None))


def _parse(text: str) -> list[Any]:
    """math-verify's reading of one answer: as LaTeX math (`$...$`, so `(1, 2]`, `\\{1, 2\\}` and `x^2 + 1`
    parse whole), else as math-verify finds it in the text."""
    from math_verify import parse

    inline = parse(f"${text}$", parsing_timeout=None) if "$" not in text else []  # None: no signal-based timeout
    return inline or parse(text, parsing_timeout=None)


_WORDS_RE = re.compile(r"[^\W\d_][\w .'-]*", re.UNICODE)
"""A gold answer of words (`Yes`, `New York`): no math in it."""


def _normalized(text: str) -> str:
    return " ".join(text.split()).strip(" .").casefold()


def _import_math_verify() -> None:
    """A worker's initializer: import math-verify and sympy before the first task's deadline starts."""
    import math_verify  # noqa: F401


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

    def check(self, golds: Sequence[str], completions: Sequence[str], answer_format: AnswerFormat) -> list[bool]:
        """Whether each completion states its gold answer (`check_answer`). Numeric golds are graded here;
        symbolic ones in the worker processes, where an answer past the deadline, or one whose worker died
        (sympy can exhaust memory), counts as not stated (`timeouts`, `crashes`).

        Raises:
            RuntimeError: the verifier is closed.
            ValueError: an unknown `answer_format`.
        """
        if self._closed:
            raise RuntimeError("the math verifier is closed")
        check_answer_format(answer_format)  # also where every gold is symbolic and only a worker reads it
        verdicts = [numeric_verdict(g, c, answer_format) for g, c in zip(golds, completions, strict=True)]
        symbolic = [i for i, v in enumerate(verdicts) if v is None]
        if not symbolic:
            return [bool(v) for v in verdicts]
        from pebble import ProcessExpired

        pool = self._start()
        futures = {
            i: pool.schedule(check_answer, args=(golds[i], completions[i], answer_format), timeout=self.timeout_s)
            for i in symbolic
        }
        out = [bool(v) for v in verdicts]
        for i, future in futures.items():
            try:
                out[i] = bool(future.result())
            except FutureTimeout:
                self.timeouts += 1
            except ProcessExpired:
                self.crashes += 1
        return out

    def _start(self) -> Any:
        with self._lock:
            if self._closed:
                raise RuntimeError("the math verifier is closed")
            if self._pool is None:
                from pebble import ProcessPool  # lazy: only runs that verify math answers start workers

                # spawn: a fresh interpreter, never a fork of a process that runs torch threads. The initializer
                # imports math-verify (sympy: seconds on a busy CPU) before the worker takes a task, so the
                # per-answer deadline never counts the import (it did: a first answer timed out under load).
                self._pool = ProcessPool(
                    max_workers=self.workers,
                    context=multiprocessing.get_context("spawn"),
                    initializer=_import_math_verify,
                )
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
