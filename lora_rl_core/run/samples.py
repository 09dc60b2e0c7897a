"""What the model writes: sample completions of a run's steps, for `report.md` and the Prefect artifact
(TRL's `log_completions`), and a few greedy held-out completions of the final adapter when the run does not
evaluate. A score is a claim about what the model writes; these let a reader check it."""

from __future__ import annotations

from typing import Any

from lora_rl_core.errors import LoraRLError
from lora_rl_core.evaluation import preview_run_policy
from lora_rl_core.records import ScoredBatch
from lora_rl_core.run.components import RunComponents

SAMPLES_PER_STEP = 3
"""Completions shown per sampled step (the first sample of each of the first groups: distinct prompts)."""


def sampled_steps(steps: int) -> list[int]:
    """The steps whose completions the report shows: the first, the middle and the last (fewer when equal)."""
    return sorted({1, (steps + 1) // 2, steps}) if steps >= 1 else []


def step_samples(run: RunComponents, steps: int, per_step: int = SAMPLES_PER_STEP) -> list[dict[str, Any]]:
    """Sample completions of the first, middle and last of `steps` steps, read from the run's scored records.

    Returns:
        one dict per completion: `step`, `problem_id`, `prompt` (the question), `completion` (decoded text),
        `gold`, `reward` (weighted sum), `rewards` (each term's value, None where it did not apply),
        `finish_reason` (`length`: cut at `rollout.max_new_tokens`), `tokens`. A step whose record cannot be
        read is left out (logged by the caller's report as missing).
    """
    out: list[dict[str, Any]] = []
    for step in sampled_steps(steps):
        try:
            rows = run.run_dir.read_phase("scored", step, ScoredBatch).rows
        except LoraRLError:
            continue
        firsts = [row for i, row in enumerate(rows) if i == 0 or rows[i - 1].group != row.group][:per_step]
        texts = run.inputs.tokenizer.batch_decode([row.completion_ids for row in firsts], skip_special_tokens=True)
        out += [
            {
                "step": step,
                "problem_id": row.problem_id,
                "prompt": run.inputs.problem(row.problem_id).question,
                "completion": text,
                "gold": row.answer,
                "reward": row.reward,
                "rewards": dict(row.rewards),
                "finish_reason": row.finish_reason,
                "tokens": len(row.completion_ids),
            }
            for row, text in zip(firsts, texts, strict=True)
        ]
    return out


def heldout_preview(run: RunComponents, adapter: str) -> dict[str, Any] | None:
    """Greedy completions of `adapter` on the first few held-out problems, graded by the run's fixed grader
    (`lora_rl_core.evaluation.preview_run_policy`: the evaluation's code path on a subset): what the report
    shows of a run that does not evaluate (`run.eval_before_after: false`). With the default grader, problems
    without a gold answer are passed over (only an evaluating run requires them); None when none is left."""
    problems = [p for p in run.inputs.test if run.cfg.eval.grader is not None or p.answer is not None]
    if not problems:
        return None
    return preview_run_policy(
        run.engine, run.inputs.tokenizer, problems, run.inputs.grader, run.cfg, adapter=adapter, prompt=run.prompt
    )


def report(run: RunComponents, history: list[dict[str, Any]], summary: dict[str, Any]) -> str:
    """Write the run's `report.md`, `reward_curve.png` and `history.json` to its working folder
    (`lora_rl_core.report.write_report`); returns the report's path."""
    from lora_rl_core.report import write_report

    return str(write_report(run.workdir, run.run_id, run.cfg, history, summary))
