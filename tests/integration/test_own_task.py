"""A user's own task through the real flow, written the way TRL users write one: a JSONL dataset in TRL's
conversational format with extra columns and no answer column, and reward functions in a file beside the config
(one plain, one `async def`, reading a dataset column). The run trains, logs each term as
`rewards/<name>/mean` in the step metrics and the report, and evaluates with pass@k; a reward that raises
fails the run naming the function and the rows."""

from __future__ import annotations

import json

import pytest

from lora_rl_core.errors import RewardError
from tests.integration.tiny_run import write_tiny_config

pytestmark = pytest.mark.slow  # the flow under the Prefect test server

REWARDS = '''
import asyncio


def short_and_sweet(prompts, completions, completion_ids, target_length, **kwargs):
    """Closer to the row's `target_length` tokens is better; None for rows without one."""
    return [None if t is None else 1.0 / (1 + abs(len(ids) - t)) for ids, t in zip(completion_ids, target_length)]


async def polite(prompts, completions, **kwargs):
    """A judge behind an API would await here."""
    await asyncio.sleep(0.01)
    return [float(any(ch.isdigit() for ch in c[-1]["content"])) for c in completions]


def broken(prompts, completions, **kwargs):
    raise KeyError("no such column")
'''


def _own_task(tmp_path, tiny_model_dir, name: str, rewards: list[dict]) -> str:
    rows = [
        {
            "prompt": [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": f"Count to {i}."}],
            "target_length": None if i % 2 == 0 else i,
        }
        for i in range(1, 13)
    ]
    for split, part in (("train", rows[:8]), ("test", rows[8:])):
        (tmp_path / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))
    (tmp_path / "my_rewards.py").write_text(REWARDS)
    data = {
        "source": "dataset",
        "train_path": str(tmp_path / "train.jsonl"),
        "test_path": str(tmp_path / "test.jsonl"),
        "eval_size": 4,
    }
    path = write_tiny_config(
        tmp_path,
        tiny_model_dir,
        name,
        data=data,
        reward={"functions": rewards},
        # no gold answers: the user names the evaluation's grader (here one of their rewards)
        eval={"samples_per_prompt": 2, "temperature": 1.0, "pass_threshold": 0.5, "grader": "my_rewards.py:polite"},
    )
    return str(path)


def test_own_dataset_and_trl_style_rewards_train_log_each_term_and_report_pass_at_k(tiny_model_dir, tmp_path):
    from flows.grpo_lora import train

    rewards = [{"name": "my_rewards.py:short_and_sweet"}, {"name": "my_rewards.py:polite", "weight": 0.5}]
    summary = train(config_path=_own_task(tmp_path, tiny_model_dir, "own", rewards), run_id="own-run")

    history = json.loads((tmp_path / "runs" / "own-run" / "history.json").read_text())
    assert [h["step"] for h in history] == [1, 2]
    sweet = [h["rewards/short_and_sweet/mean"] for h in history if "rewards/short_and_sweet/mean" in h]
    assert sweet and all(0.0 <= v <= 1.0 for v in sweet)  # left out of a step where no row had a target_length
    assert all(0.0 <= h["rewards/polite/mean"] <= 1.0 for h in history)
    scored = [
        row
        for step in (1, 2)
        for row in json.loads((tmp_path / "store" / "own-run" / "scored" / f"step-{step:06d}.json").read_text())["rows"]
    ]
    assert {r["answer"] for r in scored} == {None}  # the dataset has no answer column: rewards need none
    assert any(r["rewards"]["short_and_sweet"] is None for r in scored)  # rows without target_length
    assert all(not r["skipped"] for r in scored)  # `polite` scored them all
    final = summary["final_eval"]
    assert final["n"] == 4 and final["samples_per_prompt"] == 2 and final["metrics"] == ["polite"]
    pass1, pass2, mean2 = final["pass@1/polite"], final["pass@2/polite"], final["mean@2/polite"]
    assert 0.0 <= pass1 <= pass2 <= 1.0 and mean2 == pytest.approx(pass1)
    report = (tmp_path / "runs" / "own-run" / "report.md").read_text()
    assert "rewards/short_and_sweet/mean" in report and "pass@2/polite" in report


def test_a_reward_that_raises_fails_the_run_naming_it_and_the_rows(tiny_model_dir, tmp_path):
    from flows.grpo_lora import train

    path = _own_task(tmp_path, tiny_model_dir, "own-broken", [{"name": "my_rewards.py:broken"}])
    with pytest.raises(RewardError, match=r"reward 'broken' raised on the batch of 8 completions .*KeyError"):
        train(config_path=path, overrides=["run.eval_before_after=false"], run_id="own-broken-run")
