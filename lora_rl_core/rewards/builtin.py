"""The built-in reward functions, with TRL's signature `f(prompts, completions, completion_ids, **columns)`:

* `math`: 1.0 when the answer the completion states (`reward.answer_format`: after `####` or in `\\boxed{}`;
  `flexible` also the last number) equals the gold answer (`answer` column), else 0.0; None for a row
  without a gold answer (`lora_rl_core.rewards.verify`: a numeric gold matches only a stated number; a
  symbolic one goes through math-verify in worker processes).
* `format`: 1.0 when the completion states a number after its last `####` (GSM8K's answer format), else 0.0.
  It pays as much for an answer followed by more text to the token limit as for one that stops.
* `answer_then_stop`: 1.0 only when the completion's one answer line (`#### <number>` or `\\boxed{}`) is its last
  content and the completion ended there, by end-of-sequence or a stop sequence, never by the length limit
  (the `finish_reason` column: a completion cut at `#### 16` of `#### 166` earns nothing), else 0.0. It pays
  for the format the instruction asks for and for stopping after it (issue 43).

Completions come as text (TRL's standard format) or as `[{"role": "assistant", "content": ...}]` (TRL's
conversational format); `completion_text` reads either.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from lora_rl_core.errors import RewardError
from lora_rl_core.rewards.answers import AnswerFormat, answer_is_last, has_gsm8k_answer
from lora_rl_core.rewards.verify import MathVerifier


def completion_text(completion: Any) -> str:
    """The text of one completion: itself (standard format) or its last message's content (conversational)."""
    if isinstance(completion, str):
        return completion
    return str(completion[-1]["content"])


class MathReward:
    """`math`: 1.0 when the completion states the row's gold answer, 0.0 when not, None without a gold answer.

    Args:
        verifier: checks answers (`MathVerifier`, owned by the caller).
        answer_format: where a completion states its answer (`reward.answer_format`, the one source of its
            default).
    """

    def __init__(self, verifier: MathVerifier, answer_format: AnswerFormat) -> None:
        self.verifier = verifier
        self.answer_format = answer_format

    def __call__(
        self,
        prompts: Sequence[Any],
        completions: Sequence[Any],
        completion_ids: Sequence[Sequence[int]] | None = None,
        answer: Sequence[str | None] | None = None,
        **columns: Any,
    ) -> list[float | None]:
        """One value per completion.

        Raises:
            RewardError: the rows carry no `answer` column (set `data.answer_column`, or drop the `math` term).
        """
        if answer is None:
            raise RewardError(
                "the math reward needs each row's gold answer, and the dataset has no answer column: set "
                "data.answer_column, or use a reward that needs none"
            )
        texts = [completion_text(c) for c in completions]
        rows = [i for i, gold in enumerate(answer) if gold is not None]
        verdicts = self.verifier.check([str(answer[i]) for i in rows], [texts[i] for i in rows], self.answer_format)
        out: list[float | None] = [None] * len(texts)
        for i, right in zip(rows, verdicts, strict=True):
            out[i] = 1.0 if right else 0.0
        return out


def format_reward(
    prompts: Sequence[Any], completions: Sequence[Any], completion_ids: Any = None, **columns: Any
) -> list[float | None]:
    """`format`: 1.0 when the completion states a number after its last `####`, else 0.0."""
    return [1.0 if has_gsm8k_answer(completion_text(c)) else 0.0 for c in completions]


ENDED = ("eos", "stop")
"""Finish reasons of a completion that ended by itself: end-of-sequence, or a stop sequence."""


def answer_then_stop(
    prompts: Sequence[Any],
    completions: Sequence[Any],
    completion_ids: Any = None,
    finish_reason: Sequence[str] | None = None,
    **columns: Any,
) -> list[float | None]:
    """`answer_then_stop`: 1.0 when the completion ended by end-of-sequence or a stop sequence (`finish_reason`
    `eos` or `stop`) and its one answer line is its last content (`answers.answer_is_last`), else 0.0.

    Raises:
        RewardError: no `finish_reason` column (lora-rl passes it; a caller of its own must too).
    """
    if finish_reason is None:
        raise RewardError(
            "the answer_then_stop reward needs each completion's finish_reason (eos, stop or length); lora-rl "
            "passes it, a caller of its own must pass finish_reason=[...] too"
        )
    return [
        1.0 if reason in ENDED and answer_is_last(completion_text(c)) else 0.0
        for c, reason in zip(completions, finish_reason, strict=True)
    ]


class RightAnswerThenStop:
    """`right_answer_then_stop`: 1.0 when the completion ended by itself with its one answer line last
    (`answer_then_stop`) and that answer, read strictly (after `####` or in `\\boxed{}`), equals the row's gold
    answer; 0.0 when not; None for a row without a gold answer. The format term with the task inside it: a bare
    `#### 7`, or an example copied from the prompt, earns nothing.

    Args:
        verifier: checks answers (`MathVerifier`, owned by the caller).
    """

    def __init__(self, verifier: MathVerifier) -> None:
        self.right = MathReward(verifier, "strict")

    def __call__(
        self,
        prompts: Sequence[Any],
        completions: Sequence[Any],
        completion_ids: Sequence[Sequence[int]] | None = None,
        answer: Sequence[str | None] | None = None,
        finish_reason: Sequence[str] | None = None,
        **columns: Any,
    ) -> list[float | None]:
        """One value per completion.

        Raises:
            RewardError: no `answer` column, or no `finish_reason` column.
        """
        stopped = answer_then_stop(prompts, completions, finish_reason=finish_reason)
        right = self.right(prompts, completions, completion_ids, answer=answer)
        return [None if r is None else r * (s or 0.0) for r, s in zip(right, stopped, strict=True)]


BUILTIN_REWARDS: dict[str, Callable[[MathVerifier, AnswerFormat], Callable[..., list[float | None]]]] = {
    "math": MathReward,
    "format": lambda verifier, answer_format: format_reward,
    "answer_then_stop": lambda verifier, answer_format: answer_then_stop,
    "right_answer_then_stop": lambda verifier, answer_format: RightAnswerThenStop(verifier),
}
"""Built-in rewards by name: each a factory given the run's `MathVerifier` and `reward.answer_format`."""
