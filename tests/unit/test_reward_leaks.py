"""The leak check before step 1: a reward term that pays for the prompt's own text stops the run, naming the
term and a row; the built-in terms, and terms that pay less for the restated prompt than for an empty
completion, pass."""

from __future__ import annotations

import re

import pytest

from lora_rl_core.data import Problem
from lora_rl_core.errors import RewardError
from lora_rl_core.rewards import MathReward, MathVerifier, RewardSet, RewardTerm, format_reward
from lora_rl_core.rewards.leaks import LEAK_MAX_FRACTION, check_reward_leaks, restatements

INSTRUCTION = "Give the final answer after ####."
PROBLEMS = [Problem(f"What is {a} + {b}?", str(a + b), f"arith-{a}-{b}") for a in range(10, 30) for b in (41, 57)]


def evaluates_the_expression(prompts, completions, answer, **kw):
    """Like the gamed reward of issue 31: an `a + b` that ends the completion (`To find 76 + 57`) scores when
    it evaluates to the gold answer (math-verify read the last expression so)."""
    out = []
    for text, gold in zip(completions, answer, strict=True):
        found = re.search(r"(\d+) \+ (\d+)$", text)
        out.append(1.0 if found and int(found[1]) + int(found[2]) == int(gold) else 0.0)
    return out


def test_each_prompt_is_restated_three_ways():
    assert restatements(PROBLEMS[0], instruction=INSTRUCTION) == {
        "the prompt": "What is 10 + 41?\nGive the final answer after ####.",
        "the question": "What is 10 + 41?",
        "the question unpunctuated": "What is 10 + 41",
    }


def brevity(prompts, completions, completion_ids, **kw):
    return [1.0 / (1 + len(ids)) for ids in completion_ids]


def _check(*terms, problems=PROBLEMS):
    """Run the check with `terms`: `(name, fn)`, where the `math` entry is a factory given the verifier."""
    with MathVerifier() as verifier:
        built = [RewardTerm(name, fn(verifier) if name == "math" else fn, 1.0) for name, fn in terms]
        with RewardSet(built, verifier, timeout_s=5.0) as rewards:
            check_reward_leaks(rewards, problems, instruction=INSTRUCTION, tokenize=lambda t: [ord(c) for c in t])


def flexible_math(verifier):
    return MathReward(verifier, "flexible")


def test_a_term_that_pays_for_the_restated_question_stops_the_run_naming_it_and_a_row():
    with pytest.raises(
        RewardError,
        match=r"reward 'gamed' gives credit to 40 of 40 held-out prompts restated as the completion \(row "
        r"arith-10-41, the question unpunctuated: 'What is 10 \+ 41' scores 1, an empty completion 0\): "
        r"the policy could earn it by restating the question; fix the reward, or set reward.leak_check=false",
    ):
        _check(("math", flexible_math), ("gamed", evaluates_the_expression))


@pytest.mark.parametrize("answer_format", ["strict", "flexible"])
def test_the_built_in_terms_and_a_length_penalty_pass(answer_format):
    _check(("math", lambda v: MathReward(v, answer_format)), ("format", format_reward), ("brevity", brevity))


def test_chance_agreement_up_to_the_threshold_passes_and_above_it_fails():
    """A word problem whose last number is its answer credits its own prompt in flexible mode, by chance."""
    allowed = int(LEAK_MAX_FRACTION * len(PROBLEMS))  # 2 of 40

    def lucky(i):
        return Problem(f"Tom had 3 pens and now has {i}. How many has he?", str(i), f"lucky-{i}")

    problems = [lucky(i) for i in range(allowed)] + PROBLEMS[allowed:]
    _check(("math", flexible_math), problems=problems)
    problems[allowed] = lucky(allowed)
    with pytest.raises(RewardError, match=rf"reward 'math' gives credit to {allowed + 1} of 40 held-out prompts"):
        _check(("math", flexible_math), problems=problems)
