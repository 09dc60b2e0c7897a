"""Run summary and report files."""

from __future__ import annotations

import pytest

from lora_rl_core.report import run_summary, step_table


def test_run_summary_numbers():
    history = [
        {"step": 1, "step_seconds": 10.0, "rollout_seconds": 4.0, "completions": 64.0, "reward_mean": 0.123456},
        {"step": 2, "step_seconds": 20.0, "rollout_seconds": 12.0, "completions": 64.0, "reward_mean": 0.5},
    ]
    s = run_summary("r", history, {"accuracy": 0.05}, {"accuracy": 0.75}, "r-v000002", 99.0, "file:///s")
    assert s["seconds_per_step"] == pytest.approx(15.0)
    assert s["completions_per_second"] == pytest.approx(128 / 16)
    assert (s["base_accuracy"], s["final_accuracy"], s["steps"]) == (0.05, 0.75, 2)
    assert run_summary("r", [], None, None, "r-v000000", 1.0, "u")["final_accuracy"] is None
    assert step_table(history)[0]["reward_mean"] == 0.1235


def test_the_report_shows_what_the_model_writes_and_both_grades(tmp_path):
    from lora_rl_core.config import RunConfig
    from lora_rl_core.progress import accuracy_change, format_step
    from lora_rl_core.report import write_report
    from lora_rl_core.run.samples import sampled_steps

    assert sampled_steps(25) == [1, 13, 25] and sampled_steps(2) == [1, 2] and sampled_steps(1) == [1]

    def ev(strict, flexible):
        return {"accuracy": strict, "metrics": ["strict", "flexible"], "accuracy/strict": strict,
                "accuracy/flexible": flexible, "n": 128}  # fmt: skip

    # noqa: E731
    history = [
        {"step": 1, "step_seconds": 1.0, "rollout_seconds": 1.0, "completions": 4, "truncated_fraction": 0.75},
        {"step": 2, "step_seconds": 1.0, "rollout_seconds": 1.0, "completions": 4, "truncated_fraction": 0.0},
    ]
    summary = run_summary("r", history, ev(0.0, 0.047), ev(0.5, 0.8), "r-v000002", 9.0, "file:///s")
    assert accuracy_change(summary) == "strict 0.0% -> 50.0%, flexible 4.7% -> 80.0%"
    assert " cut 75% " in format_step(history[0])
    summary["step_samples"] = [
        {"step": 1, "problem_id": "p", "prompt": "What is 76 + 57?", "completion": "To find 76 + 57, we",
         "gold": "133", "reward": 0.0, "rewards": {"math": 0.0, "mine": None}, "finish_reason": "length", "tokens": 48},
    ]  # fmt: skip
    report = write_report(tmp_path, "r", RunConfig(), history, summary).read_text()
    assert "greedy accuracy after training: strict 50.0% flexible 80.0% (128 problems)" in report
    assert "### Step 1" in report and "'To find 76 + 57, we'` (48 tokens, cut at the token limit)" in report
    assert "reward 0.000: math 0 mine none" in report
    assert "| truncated_fraction |" in report and "| 0.75 |" in report  # the step table's cut column
