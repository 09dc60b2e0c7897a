"""Seeded synthetic arithmetic problems, e.g. ``"What is 47 + 38?"`` -> ``"85"``.

Choices: problem ``i`` of a generator depends only on ``(seed, stream, i)``
(through SHA-256, not Python's salted ``hash``), so any slice can be
regenerated without the ones before it. Operands with ``d`` digits are drawn
uniformly from ``10**(d-1) .. 10**d - 1`` (1 digit: 1..9). Subtraction may
give negative answers. Division is left out (non-integer answers).

Train/test split (``arithmetic_split``): the held-out test set of a
configuration ``(operations, digits, seed)`` is the first ``test_pool``
problems of a separate ``"test"`` stream; a test split of ``size`` is its
first ``size`` problems, so it is the same on every call. A train split draws
from the ``"train"`` stream and skips every problem whose question is in the
whole test pool, so no train question equals any test question of the same
configuration for any test ``size <= test_pool``.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Literal

from lora_rl_core.data.problems import Problem
from lora_rl_core.data.seeding import stable_seed
from lora_rl_core.errors import DataError

OPERATIONS: dict[str, str] = {"+": "add", "-": "sub", "*": "mul"}
TEST_POOL_SIZE = 512


def _check_operations(operations: Sequence[str]) -> tuple[str, ...]:
    """Validate ``operations``; a single str like ``"+"`` counts as one operation."""
    ops = (operations,) if isinstance(operations, str) else tuple(operations)
    bad = [op for op in ops if op not in OPERATIONS]
    if not ops or bad:
        raise DataError(f"operations must be a non-empty subset of {list(OPERATIONS)}, got {list(ops)!r}")
    return ops


def _check_digits(digits: int | tuple[int, int]) -> tuple[int, int]:
    """Validate ``digits`` (an int or a ``(min, max)`` pair) and return ``(min, max)``."""
    pair = (digits, digits) if isinstance(digits, int) else digits
    is_int = [isinstance(d, int) and not isinstance(d, bool) for d in pair] if isinstance(pair, (tuple, list)) else []
    ok = is_int == [True, True]
    if not ok or not 1 <= pair[0] <= pair[1]:
        raise DataError(f"digits must be an int >= 1 or a (min, max) pair with 1 <= min <= max, got {digits!r}")
    return pair[0], pair[1]


class ArithmeticGenerator:
    """Seeded generator of arithmetic problems, e.g. ``"What is 47 + 38?"`` -> ``"85"``. Each problem's columns
    (given to reward functions by name) are ``answer`` and ``equation_prefix``, the problem in MAWPS's prefix
    notation (``"+ 47 38"``), so an equation-writing reward reads arithmetic and MAWPS rows alike.

    Args:
        operations: a subset of ``"+"``, ``"-"``, ``"*"``; each problem picks one uniformly.
        digits: digits of each operand (2 -> 10..99), or a ``(min, max)`` range of
            digit counts drawn per operand.
        seed: the seed; problem ``i`` depends only on ``(seed, stream, i)``.
        stream: a name separating independent problem streams of one seed
            (``arithmetic_split`` uses ``"train"`` and ``"test"``).

    Raises:
        DataError: an unknown operation or bad ``digits``.
    """

    def __init__(
        self,
        operations: Sequence[str] = ("+",),
        digits: int | tuple[int, int] = 2,
        seed: int = 0,
        *,
        stream: str = "",
    ) -> None:
        self.operations = _check_operations(operations)
        self.digits = _check_digits(digits)
        self.seed = seed
        self.stream = stream
        lo, hi = self.digits
        self._digits_label = f"{lo}d" if lo == hi else f"{lo}-{hi}d"

    def _operand(self, rng: random.Random) -> int:
        """Draw one operand: a digit count in range, then a number with that many digits."""
        n_digits = rng.randint(*self.digits)
        return rng.randint(10 ** (n_digits - 1), 10**n_digits - 1)

    def problem(self, index: int) -> Problem:
        """Return problem ``index`` (>= 0), deterministic in ``(seed, stream, index)``.

        Raises:
            DataError: a negative index.
        """
        if index < 0:
            raise DataError(f"problem index must be >= 0, got {index}")
        rng = random.Random(stable_seed(self.seed, self.stream, index))
        op = rng.choice(self.operations)
        a, b = self._operand(rng), self._operand(rng)
        result = {"+": a + b, "-": a - b, "*": a * b}[op]
        stream = f"{self.stream}-" if self.stream else ""
        problem_id = f"arith-{OPERATIONS[op]}-{self._digits_label}-s{self.seed}-{stream}{index}"
        return Problem(
            prompt=f"What is {a} {op} {b}?",
            answer=str(result),
            id=problem_id,
            columns={"answer": str(result), "equation_prefix": f"{op} {a} {b}"},
        )

    def problems(self, start: int, count: int) -> list[Problem]:
        """Return problems ``start .. start + count - 1``.

        Raises:
            DataError: a negative ``start`` or ``count``.
        """
        if count < 0:
            raise DataError(f"count must be >= 0, got {count}")
        return [self.problem(i) for i in range(start, start + count)]


def _train_problems(ops, digits, seed: int, size: int, test_pool: int) -> list[Problem]:
    """Draw ``size`` train-stream problems whose questions are not in the test pool."""
    held_out = {p.question for p in ArithmeticGenerator(ops, digits, seed, stream="test").problems(0, test_pool)}
    gen = ArithmeticGenerator(ops, digits, seed, stream="train")
    max_draws = 20 * size + 10_000
    out: list[Problem] = []
    for index in range(max_draws):
        if len(out) == size:
            return out
        problem = gen.problem(index)
        if problem.question not in held_out:
            out.append(problem)
    if len(out) == size:
        return out
    raise DataError(
        f"found only {len(out)} of {size} train problems outside the held-out test set in {max_draws} draws: "
        f"operations={list(gen.operations)}, digits={digits!r} has too few distinct problems; "
        "use more digits or a smaller test_pool"
    )


def arithmetic_split(
    operations: Sequence[str],
    digits: int | tuple[int, int],
    *,
    split: Literal["train", "test"],
    size: int,
    seed: int,
    test_pool: int = TEST_POOL_SIZE,
) -> list[Problem]:
    """Return a train or held-out test set of arithmetic problems; the two never share a question.

    The test set of ``(operations, digits, seed)`` is the first ``size`` problems
    of the ``"test"`` stream (identical on every call). The train set is the
    first ``size`` problems of the ``"train"`` stream whose question is not among
    the first ``test_pool`` test-stream questions. Train may repeat a question
    when the problem space is small.

    Args:
        operations: as for ``ArithmeticGenerator``.
        digits: as for ``ArithmeticGenerator``.
        split: ``"train"`` or ``"test"``.
        size: how many problems (>= 1; test: <= ``test_pool``).
        seed: the configuration's seed.
        test_pool: how many test-stream problems train excludes; the largest test size.

    Raises:
        DataError: bad arguments, or too few distinct problems to fill the train set.
    """
    if split not in ("train", "test"):
        raise DataError(f"split must be 'train' or 'test', got {split!r}")
    if size < 1:
        raise DataError(f"size must be >= 1, got {size}")
    if split == "test":
        if size > test_pool:
            raise DataError(f"test size {size} exceeds test_pool={test_pool}; raise test_pool to at least {size}")
        return ArithmeticGenerator(operations, digits, seed, stream="test").problems(0, size)
    return _train_problems(operations, digits, seed, size, test_pool)
