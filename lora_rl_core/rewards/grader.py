"""The evaluation's grader: fixed, apart from the training reward, so that a change to a reward can never move
the score (issue 31: a gamed reward that also graded the evaluation reported 100 %).

* `AnswerGrader` (the default, `eval.grader: null`): the built-in answer checker against each problem's gold
  answer (`lora_rl_core.rewards.verify`), in both of lm-eval's gsm8k modes side by side: `strict`
  (`strict-match`: the answer after `####` or in `\\boxed{}`) and `flexible` (`flexible-extract`: else the
  last number). Whatever `reward.answer_format` the run trains with.
* `FunctionGrader` (`eval.grader: <name>`): a function the user names as the grader, with TRL's reward
  signature; a completion succeeds when its value reaches `eval.pass_threshold`.

`build_grader` makes the one the config names; close it when done (it may own worker processes).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from lora_rl_core.errors import RewardError
from lora_rl_core.rewards.answers import ANSWER_FORMATS, AnswerFormat
from lora_rl_core.rewards.builtin import completion_text
from lora_rl_core.rewards.load import load_reward_function
from lora_rl_core.rewards.score import RewardBatch, RewardSet, RewardTerm
from lora_rl_core.rewards.verify import MathVerifier

if TYPE_CHECKING:
    from lora_rl_core.config import EvalConfig, RewardConfig


class Grader(Protocol):
    """Grades evaluation completions: one verdict per completion for each of its `metrics`."""

    @property
    def metrics(self) -> tuple[str, ...]:
        """The verdicts' names, the headline first (`("strict", "flexible")`, or the function's name)."""
        ...

    def grade(self, batch: RewardBatch) -> dict[str, list[bool]]:
        """`{metric: [N] success per completion}` for a batch of `N` completions.

        Raises:
            RewardError: a row the grader cannot grade (no gold answer), or the graded function failed.
        """
        ...

    def close(self) -> None:
        """Stop what the grader started (idempotent)."""
        ...


class AnswerGrader:
    """Strict and flexible accuracy against the gold answers (module docstring).

    Args:
        verify_timeout_s: seconds one symbolic answer may take in math-verify (`reward.verify_timeout_s`).
    """

    metrics: tuple[AnswerFormat, ...] = ANSWER_FORMATS

    def __init__(self, *, verify_timeout_s: float) -> None:
        self.verifier = MathVerifier(timeout_s=verify_timeout_s)

    def grade(self, batch: RewardBatch) -> dict[str, list[bool]]:
        """Whether each completion states its gold answer, per answer format.

        Raises:
            RewardError: a row without a gold answer (set `data.answer_column`, or name an `eval.grader`).
        """
        golds = batch.columns.get("answer") or [None] * len(batch)
        missing = [row for row, gold in zip(batch.row_ids, golds, strict=True) if gold is None]
        if missing:
            raise RewardError(f"the evaluation grades against gold answers and {missing_text(missing)} {NO_GOLD_FIX}")
        texts = [completion_text(c) for c in batch.completions]
        return {fmt: self.verifier.check([str(g) for g in golds], texts, fmt) for fmt in self.metrics}

    def close(self) -> None:
        """Stop the verifier's worker processes."""
        self.verifier.close()


class FunctionGrader:
    """A function the user named as the grader (`eval.grader`): success where its value reaches `threshold`.

    Args:
        label: the metric's name (the function's `__name__`, or the built-in's name).
        rewards: a `RewardSet` of that one function (its checks, timeout and errors).
        threshold: `eval.pass_threshold`.
    """

    def __init__(self, label: str, rewards: RewardSet, threshold: float) -> None:
        self.metrics = (label,)
        self.rewards = rewards
        self.threshold = threshold

    def grade(self, batch: RewardBatch) -> dict[str, list[bool]]:
        """Whether each completion's value reaches the threshold (None: not a success).

        Raises:
            RewardError: the function raised, timed out or returned bad values (naming it and the rows).
        """
        values = self.rewards.score(batch).terms[self.metrics[0]]
        return {self.metrics[0]: [v is not None and v >= self.threshold for v in values]}

    def close(self) -> None:
        """Stop what the function's set owns."""
        self.rewards.close()


NO_GOLD_FIX = "set data.answer_column to the column with the answers, or name a grader in eval.grader"


def missing_text(rows: Sequence[str]) -> str:
    """`"3 problems have none (first: arith-test-7):"` for an error about rows without gold answers."""
    return f"{len(rows)} problem{'s' if len(rows) != 1 else ''} have none (first: {rows[0]}):"


def build_grader(settings: EvalConfig, reward: RewardConfig) -> Grader:
    """The grader `eval.grader` names (module docstring).

    Raises:
        RewardError: a grader name that cannot be resolved.
    """
    if settings.grader is None:
        return AnswerGrader(verify_timeout_s=reward.verify_timeout_s)
    verifier = MathVerifier(timeout_s=reward.verify_timeout_s)
    try:
        fn = load_reward_function(settings.grader, verifier, reward.files_dir, answer_format="strict")
    except RewardError as err:
        verifier.close()
        raise RewardError(f"eval.grader: {err}") from None
    label = settings.grader if ":" not in settings.grader else getattr(fn, "__name__", settings.grader)
    return FunctionGrader(
        label, RewardSet([RewardTerm(label, fn, 1.0)], verifier, timeout_s=reward.timeout_s), settings.pass_threshold
    )
