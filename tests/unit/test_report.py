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

    def ev(strict, flexible, cut):
        return {"accuracy": strict, "metrics": ["strict", "flexible"], "accuracy/strict": strict,
                "accuracy/flexible": flexible, "n": 128, "truncated_fraction": cut,
                "samples": [{"question": "What is 2 + 2?", "completion": "2 + 2 = 4", "gold": "4", "strict": False,
                             "flexible": True, "finish_reason": "eos", "tokens": 9}]}  # fmt: skip

    # noqa: E731
    history = [
        {"step": 1, "step_seconds": 1.0, "rollout_seconds": 1.0, "completions": 4, "truncated_fraction": 0.75},
        {"step": 2, "step_seconds": 1.0, "rollout_seconds": 1.0, "completions": 4, "truncated_fraction": 0.0},
    ]
    summary = run_summary("r", history, ev(0.0, 0.047, 0.62), ev(0.5, 0.8, 0.03), "r-v000002", 9.0, "file:///s")
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
    assert "- greedy completions cut at the token limit, before -> after training: 62% -> 3%\n" in report
    assert report.endswith(
        "## Greedy completions after training (held-out)\n\n- **Q:** What is 2 + 2?  \n"
        "  **A:** `'2 + 2 = 4'` (gold 4; strict wrong; flexible right; 9 tokens, ended by end-of-sequence)\n"
    )  # the final evaluation's samples, no preview note


def _metrics(step, **kw):
    return {"step": step, "steps": 25, "step_seconds": 1.0, "rollout_seconds": 1.0, "completions": 64, **kw}


def test_the_step_line_and_the_table_say_how_long_completions_are_and_how_they_ended():
    from lora_rl_core.progress import format_step

    m = _metrics(3, completion_length=21.04, truncated_fraction=2 / 64, ended_fraction=62 / 64,
                 finish_reasons={"eos": 60, "stop": 2, "length": 2})  # fmt: skip
    assert " len 21.0 cut 3% end 97% 0.0 compl/s " in format_step(m)
    assert " cut 0% end 0% " in format_step(_metrics(1))  # a record from before `end`: nothing ended counted
    row = step_table([m])[0]
    assert (row["completion_length"], row["truncated_fraction"], row["ended_fraction"]) == (21.04, 0.0312, 0.9688)
    assert row["finish_reasons"] == "eos:60 stop:2 length:2"
    columns = list(row)
    at = columns.index("completion_length")
    assert columns[at : at + 4] == ["completion_length", "truncated_fraction", "ended_fraction", "finish_reasons"]


def test_the_done_line_gives_the_greedy_cut_share_before_and_after():
    from lora_rl_core.progress import format_done

    def ev(accuracy, cut):
        return {"accuracy": accuracy, "metrics": ["strict"], "accuracy/strict": accuracy, "n": 128,
                "truncated": round(cut * 128), "truncated_fraction": cut}  # fmt: skip

    history = [_metrics(1), _metrics(2)]
    summary = run_summary("r", history, ev(0.1, 0.625), ev(0.5, 0.03125), "r-v000002", 59.0, "file:///s")
    assert (summary["base_truncated_fraction"], summary["final_truncated_fraction"]) == (0.625, 0.03125)
    assert format_done(summary) == (
        "run r: accuracy strict 10.0% -> 50.0%; cut 62% -> 3%, 2 steps, 59 s wall, 1.0 s/step, 64.00 completions/s"
    )
    old = {k: v for k, v in summary.items() if "truncated" not in k}  # a summary from before the cut shares
    assert "; cut n/a -> n/a, 2 steps" in format_done(old)
    unevaluated = run_summary("r", history, None, None, "r-v000002", 59.0, "file:///s")
    assert "accuracy n/a -> n/a; cut n/a -> n/a," in format_done(unevaluated)


def test_a_run_without_evaluation_still_shows_greedy_completions_and_how_they_ended(tmp_path):
    """`run.eval_before_after: false`: no accuracy, but the report shows the preview's greedy completions."""
    from lora_rl_core.config import RunConfig
    from lora_rl_core.report import write_report

    cfg = RunConfig.model_validate({"run": {"eval_before_after": False}})
    history = [_metrics(1, finish_reasons={"eos": 40, "stop": 0, "length": 24}, ended_fraction=0.625)]
    summary = run_summary("r", history, None, None, "r-v000001", 9.0, "file:///s")

    def sample(question, completion, gold, flexible, finish, tokens):
        return {"question": question, "completion": completion, "gold": gold, "strict": False, "flexible": flexible,
                "finish_reason": finish, "tokens": tokens}  # fmt: skip

    summary["final_preview"] = {
        "accuracy": 0.0, "metrics": ["strict", "flexible"], "n": 4, "truncated": 1, "truncated_fraction": 0.25,
        "samples": [
            sample("What is 76 + 57?", "76 + 57 = 133", "133", True, "eos", 13),
            sample("What is 34 + 49?", "To find 34 + 49, we", "83", False, "length", 48),
            sample("What is 10 + 5?", "10 + 5 = 15", "15", True, "stop", 11),
            sample("What is 2 + 2?", "2 + 2 = 4", "4", True, "eos", 9),
        ],
    }  # fmt: skip
    report = write_report(tmp_path, "r", cfg, history, summary).read_text()
    section = report.split("## Greedy completions after training (held-out)\n\n", 1)[1]
    assert section.startswith("Not evaluated (`run.eval_before_after: false`): the first 4 problems.\n\n")
    assert "(none)" not in section and section.count("- **Q:**") == 4
    assert (
        "- **Q:** What is 34 + 49?  \n  **A:** `'To find 34 + 49, we'` (gold 83; strict wrong; flexible wrong; "
        "48 tokens, cut at the token limit)\n"
    ) in section
    assert "(gold 133; strict wrong; flexible right; 13 tokens, ended by end-of-sequence)" in section
    assert "(gold 15; strict wrong; flexible right; 11 tokens, ended by a stop sequence)" in section
    assert "greedy accuracy after training: not measured" in report
    assert "- graded by the answer checker (strict: after `####`" in report  # the preview's grader
    assert "- greedy completions cut at the token limit, before -> after training: n/a -> n/a\n" in report
    assert "| finish_reasons |" in report and "| eos:40 stop:0 length:24 |" in report
    del summary["final_preview"]  # e.g. a held-out split without gold answers: nothing to show
    assert write_report(tmp_path, "r", cfg, history, summary).read_text().endswith("(held-out)\n\n(none)\n")
