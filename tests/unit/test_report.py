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
