"""Evaluation beyond greedy accuracy: the unbiased pass@k estimator (Chen et al. 2021) on hand-computed
values."""

from __future__ import annotations

import math

import pytest

from lora_rl_core.evaluation import pass_at_k


@pytest.mark.parametrize(
    ("n", "c", "k", "expected"),
    [
        (5, 2, 1, 0.4),  # pass@1 is the success rate
        (5, 2, 2, 1 - 3 / 10),  # 1 - C(3, 2) / C(5, 2)
        (5, 2, 4, 1.0),  # n - c < k: every draw of 4 holds a success
        (4, 0, 2, 0.0),
        (4, 4, 1, 1.0),
        (10, 3, 5, 1 - math.comb(7, 5) / math.comb(10, 5)),
    ],
)
def test_pass_at_k_is_the_unbiased_estimator(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected)


@pytest.mark.parametrize(("n", "c", "k"), [(4, 5, 1), (4, 1, 0), (4, 1, 5), (4, -1, 1)])
def test_pass_at_k_refuses_impossible_counts(n, c, k):
    with pytest.raises(ValueError, match="pass@k needs"):
        pass_at_k(n, c, k)


class CharTokenizer:
    """One token per character (no chat template): enough for rendering prompts and decoding completions."""

    chat_template = None

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [ord(ch) for ch in text]}

    def batch_decode(self, ids, skip_special_tokens=True):
        return ["".join(chr(i) for i in row) for row in ids]


class ScriptedEngine:
    """Answers each prompt with the completion `script` gives for its question (greedy and sampled alike)."""

    def __init__(self, script, finish="stop"):
        self.script, self.finish, self.requests = script, finish, []

    def generate(self, requests, inline=False):
        from lora_rl_core.engines import Completion

        self.requests += requests
        out = []
        for r in requests:
            prompt = "".join(chr(i) for i in r.prompt_ids)
            text = self.script[prompt.split("\n", 1)[0]]
            out.append(
                Completion("r", r.prompt_ids, [ord(c) for c in text], [0.0] * len(text), self.finish, None, None)
            )
        return out


def _evaluate(engine, problems, grader, samples=1):
    from lora_rl_core.config import EvalConfig
    from lora_rl_core.data import PromptStyle
    from lora_rl_core.evaluation import evaluate_policy

    return evaluate_policy(
        engine,
        CharTokenizer(),
        problems,
        grader,
        adapter=None,
        prompt=PromptStyle(None, "Give the final answer after ####."),
        max_new_tokens=48,
        settings=EvalConfig(samples_per_prompt=samples),
    )


def test_the_evaluation_grades_strict_and_flexible_with_the_fixed_grader_not_the_reward():
    from lora_rl_core.data import Problem
    from lora_rl_core.rewards import AnswerGrader

    problems = [Problem(f"What is {a} + {b}?", str(a + b), f"p{a}") for a, b in ((76, 57), (34, 49), (10, 5), (2, 2))]
    script = {
        "What is 76 + 57?": "To find 76 + 57, we can start by",  # restated: no answer in either mode
        "What is 34 + 49?": "The answer is 34 + 49.",  # an expression: no answer
        "What is 10 + 5?": "10 + 5 = 15",  # right, but not in the asked format: flexible only
        "What is 2 + 2?": "2 + 2 = 4\n#### 4",  # right in both
    }
    grader = AnswerGrader(verify_timeout_s=5.0)
    try:
        result = _evaluate(ScriptedEngine(script), problems, grader, samples=2)
    finally:
        grader.close()
    assert result["metrics"] == ["strict", "flexible"]
    assert (result["accuracy/strict"], result["accuracy/flexible"], result["accuracy"]) == (0.25, 0.5, 0.25)
    assert (result["pass@2/strict"], result["pass@2/flexible"], result["mean@2/flexible"]) == (0.25, 0.5, 0.5)
    assert result["pass@1/strict"] == 0.25 and "pass@1" not in result  # per metric only, no unsuffixed copy
    assert result["samples"][2] == {
        "question": "What is 10 + 5?", "completion": "10 + 5 = 15", "gold": "15", "strict": False, "flexible": True
    }  # fmt: skip
    assert result["truncated"] == 0


def test_a_named_grader_decides_success_and_aborted_completions_never_succeed(tmp_path):
    from lora_rl_core.config import EvalConfig, RewardConfig
    from lora_rl_core.data import Problem
    from lora_rl_core.rewards import build_grader

    (tmp_path / "judge.py").write_text(
        "def judge(prompts, completions, **kw):\n    return [len(c) / 10 for c in completions]\n"
    )
    grader = build_grader(
        EvalConfig(grader="judge.py:judge", pass_threshold=0.5), RewardConfig(files_dir=str(tmp_path))
    )
    problems = [Problem("short", None, "a"), Problem("long", None, "b")]
    try:
        assert grader.metrics == ("judge",)
        result = _evaluate(ScriptedEngine({"short": "abc", "long": "abcdefgh"}), problems, grader)
        assert (result["accuracy"], result["accuracy/judge"]) == (0.5, 0.5)
        aborted = _evaluate(ScriptedEngine({"short": "abc", "long": "abcdefgh"}, finish="abort"), problems, grader)
        assert aborted["accuracy"] == 0.0 and aborted["aborted"] == 2
    finally:
        grader.close()


def test_the_default_grader_refuses_rows_without_gold_and_a_bad_grader_name_is_named():
    from lora_rl_core.config import EvalConfig, RewardConfig
    from lora_rl_core.data import Problem
    from lora_rl_core.errors import RewardError
    from lora_rl_core.rewards import AnswerGrader, build_grader

    grader = AnswerGrader(verify_timeout_s=5.0)
    with pytest.raises(RewardError, match=r"grades against gold answers and 1 problem have none \(first: a\)"):
        _evaluate(ScriptedEngine({"x": "#### 1"}), [Problem("x", None, "a")], grader)
    with pytest.raises(RewardError, match=r"eval.grader: unknown reward 'acc'"):
        build_grader(EvalConfig(grader="acc"), RewardConfig())
