"""The leak check: before step 1, does any reward term pay for restating the prompt?

Each held-out prompt is restated three ways and each restatement scored as if it were the completion, once
per reward term, beside an empty completion: the prompt's text (its turns without the system prompt: the
question and the instruction), the question alone, and the question without its closing punctuation (as a
completion restates it inside a sentence: "To find 76 + 57, we can start by"). A term that gives a
restatement more than the empty completion, on more than `LEAK_MAX_FRACTION` of the prompts, is a reward the
policy can earn by copying the question: the run stops naming the term and a row (issue 31: the old `math`
reward evaluated the restated problem `What is 91 + 75` to the gold answer on all 128 held-out problems, and
a run learned to copy the question). `reward.leak_check: false` skips the check. No peer framework checks
this; it costs four scoring calls over the held-out prompts.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from lora_rl_core.data import Problem
from lora_rl_core.data.prompts import build_messages
from lora_rl_core.errors import RewardError
from lora_rl_core.rewards.score import RewardBatch, RewardSet

LEAK_MAX_FRACTION = 0.05
"""The share of held-out prompts a term may credit for their own text: chance agreement (a word problem whose
last number is its answer: about 2 % of MAWPS and GSM8K) stays below it; a term that reads the question is
far above."""


def restatements(problem: Problem, *, instruction: str) -> dict[str, str]:
    """The ways a policy could restate `problem`, by name: `the prompt` (its turns' contents without the system
    prompt, one per line), `the question`, `the question unpunctuated` (its closing `?`, `.` or `!` dropped)."""
    turns = build_messages(problem, system_prompt=None, instruction=instruction)
    question = problem.question.strip()
    return {
        "the prompt": "\n".join(m["content"] for m in turns if m["role"] != "system"),
        "the question": question,
        "the question unpunctuated": question.rstrip(" ?.!"),
    }


def check_reward_leaks(
    rewards: RewardSet,
    problems: Sequence[Problem],
    *,
    instruction: str,
    tokenize: Callable[[str], list[int]],
) -> None:
    """Stop a run whose reward pays for restating the prompt (module docstring).

    Args:
        rewards: the run's reward terms.
        problems: the held-out problems.
        instruction: the instruction the run appends to each question (`prompt_instruction`).
        tokenize: a restatement's token ids (`completion_ids` for the terms).

    Raises:
        RewardError: a term credits more than `LEAK_MAX_FRACTION` of the prompts (naming the term, the count,
            a row, the restatement and the fix), or a term failed on these completions.
    """
    if not problems:
        return
    texts = [restatements(p, instruction=instruction) for p in problems]
    ended = ["eos"] * len(problems)  # scored as completions that ended: a term's most generous reading
    empty = rewards.score(RewardBatch.from_problems(problems, [""] * len(problems), [[] for _ in problems], ended))
    scored = {
        kind: rewards.score(
            RewardBatch.from_problems(problems, [t[kind] for t in texts], [tokenize(t[kind]) for t in texts], ended)
        ).terms
        for kind in texts[0]
    }
    for name, baseline in empty.terms.items():
        credited: dict[int, str] = {}  # row -> the first restatement that earned more than the empty completion
        for kind, terms in scored.items():
            for i, (value, floor) in enumerate(zip(terms[name], baseline, strict=True)):
                if value is not None and value > (floor or 0.0):
                    credited.setdefault(i, kind)
        if len(credited) > LEAK_MAX_FRACTION * len(problems):
            i = min(credited)
            kind = credited[i]
            shown = " ".join(texts[i][kind].split())
            shown = shown if len(shown) <= 80 else shown[:77] + "..."
            raise RewardError(
                f"reward {name!r} gives credit to {len(credited)} of {len(problems)} held-out prompts restated as "
                f"the completion (row {problems[i].id}, {kind}: {shown!r} scores {scored[kind][name][i]:g}, an "
                f"empty completion {baseline[i] or 0.0:g}): the policy could earn it by restating the question; "
                "fix the reward, or set reward.leak_check=false"
            )
