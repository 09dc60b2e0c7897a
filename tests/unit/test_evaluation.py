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
    """Answers each prompt with the completion `script` gives for its question (greedy and sampled alike), ending
    it with `finish` (one reason for all, or a reason per question)."""

    def __init__(self, script, finish="stop"):
        self.script, self.finish, self.requests = script, finish, []

    def generate(self, requests, inline=False):
        from lora_rl_core.engines import Completion

        self.requests += requests
        out = []
        for r in requests:
            prompt = "".join(chr(i) for i in r.prompt_ids)
            question = prompt.split("\n", 1)[0]
            text = self.script[question]
            finish = self.finish if isinstance(self.finish, str) else self.finish[question]
            out.append(Completion("r", r.prompt_ids, [ord(c) for c in text], [0.0] * len(text), finish, None, None))
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
        "question": "What is 10 + 5?", "completion": "10 + 5 = 15", "gold": "15", "strict": False, "flexible": True,
        "finish_reason": "stop", "tokens": 11,
    }  # fmt: skip
    assert (result["truncated"], result["truncated_fraction"]) == (0, 0.0)


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


def test_the_cut_share_counts_greedy_completions_at_the_token_limit():
    from lora_rl_core.data import Problem
    from lora_rl_core.rewards import AnswerGrader

    problems = [Problem(f"What is {a} + 1?", str(a + 1), f"p{a}") for a in range(4)]
    script = {p.question: f"#### {p.answer}" for p in problems}
    finish = {"What is 0 + 1?": "length", "What is 1 + 1?": "eos", "What is 2 + 1?": "length", "What is 3 + 1?": "stop"}
    grader = AnswerGrader(verify_timeout_s=5.0)
    try:
        result = _evaluate(ScriptedEngine(script, finish=finish), problems, grader)
    finally:
        grader.close()
    assert (result["truncated"], result["truncated_fraction"]) == (2, 0.5)
    assert [s["finish_reason"] for s in result["samples"]] == ["length", "eos", "length"]  # the first 3


def test_the_preview_is_a_few_greedy_completions_whatever_eval_samples_says():
    """`preview_run_policy`: the evaluation's code path on the first 4 problems, greedy only, all 4 kept."""
    from lora_rl_core.config import RunConfig
    from lora_rl_core.data import Problem, PromptStyle
    from lora_rl_core.evaluation import preview_run_policy
    from lora_rl_core.rewards import AnswerGrader

    problems = [Problem(f"What is {a} + 2?", str(a + 2), f"p{a}") for a in range(6)]
    script = {p.question: f"{p.question[8:-1]} = {p.answer}" for p in problems}
    engine = ScriptedEngine(script, finish={p.question: "length" if p.id == "p1" else "eos" for p in problems})
    cfg = RunConfig.model_validate({"eval": {"samples_per_prompt": 4}, "run": {"eval_before_after": False}})
    grader = AnswerGrader(verify_timeout_s=5.0)
    try:
        preview = preview_run_policy(
            engine, CharTokenizer(), problems, grader, cfg, adapter="r-v000002", prompt=PromptStyle(None, "Say it.")
        )
    finally:
        grader.close()
    assert len(engine.requests) == 4 and {r.sampling.temperature for r in engine.requests} == {0.0}
    assert {r.adapter for r in engine.requests} == {"r-v000002"}
    assert preview["n"] == 4 and "pass@1/strict" not in preview
    assert [s["question"] for s in preview["samples"]] == [p.question for p in problems[:4]]
    assert preview["samples"][1] == {
        "question": "What is 1 + 2?", "completion": "1 + 2 = 3", "gold": "3", "strict": False, "flexible": True,
        "finish_reason": "length", "tokens": 9,
    }  # fmt: skip


def test_the_runs_preview_passes_over_problems_without_gold_under_the_default_grader():
    """`run.samples.heldout_preview`: an unevaluated run's held-out split need not have gold answers; the
    default grader grades against them, so those problems are passed over, and with none left nothing is shown."""
    from types import SimpleNamespace

    from lora_rl_core.config import RunConfig
    from lora_rl_core.data import Problem, PromptStyle
    from lora_rl_core.rewards import AnswerGrader
    from lora_rl_core.run.samples import heldout_preview

    problems = [Problem(f"What is {a} + 3?", None if a % 2 else str(a + 3), f"p{a}") for a in range(10)]
    engine = ScriptedEngine({p.question: f"#### {p.answer}" for p in problems}, finish="eos")
    grader = AnswerGrader(verify_timeout_s=5.0)

    def run_of(test):
        inputs = SimpleNamespace(tokenizer=CharTokenizer(), test=test, grader=grader)
        return SimpleNamespace(engine=engine, inputs=inputs, cfg=RunConfig(), prompt=PromptStyle(None, "Say it."))

    run = run_of(problems)
    try:
        preview = heldout_preview(run, "r-v000003")
        assert [s["question"] for s in preview["samples"]] == [f"What is {a} + 3?" for a in (0, 2, 4, 6)]
        assert preview["accuracy/strict"] == 1.0 and preview["adapter"] == "r-v000003"
        assert heldout_preview(run_of(problems[1::2]), "r-v000003") is None
    finally:
        grader.close()
