"""`lora-rl-train`: GRPO + LoRA as a Prefect flow.

Reads like the algorithm: open the run, measure the base model, run the steps (the library's step loop,
`lora_rl_core.run.loop.run_steps`: publish and sync version 0, then per step rollout -> score -> train ->
publish -> sync, each phase a Prefect task, the checkpoint and version uploads running in the background
until `flush`), and finally measure the trained adapter (or, with `run.eval_before_after: false`, take a
few of its greedy held-out completions) and write the report and artifacts. With
`rollout.mode: async` the loop submits the rollouts of the next `algorithm.max_staleness` steps as task
futures before a step trains, so they are generated while it trains, each with the version current when it
starts (docs/DESIGN.md, "Asynchronous rollouts").
Runs on an ephemeral Prefect server when no `PREFECT_API_URL` is set.
"""

from __future__ import annotations

import time
from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact, create_table_artifact

from lora_rl_core import progress
from lora_rl_core.report import artifact_markdown, run_summary, step_table
from lora_rl_core.run import close_run, get_run, phases, samples
from lora_rl_core.run.loop import run_steps
from tasks.steps import TaskPhases, open_run, prefect_slug, result_storage


@flow(name="lora-rl-train")
def train(
    config_path: str | None = None,
    overrides: list[str] | None = None,
    run_id: str | None = None,
) -> dict[str, Any]:
    """Train a LoRA policy with GRPO and publish every step's adapter to the store.

    Args:
        config_path: YAML run config (None = built-in defaults).
        overrides: dotted `key=value` overrides, e.g. `["lora.rank=32"]`.
        run_id: run id (default: `run.id`, else `<run.name>-<first 8 characters of the flow run id>`, so a
            retry of the flow run resumes the same run). A run of that id open in this process (`lora-rl train`
            opens it before the flow starts) is the one trained; else it is built from the config here.

    Returns:
        summary: run_id, final_adapter, base/final accuracy, wall_seconds, seconds_per_step,
        completions_per_second, report path.
    """
    start, opened = time.perf_counter(), None
    try:
        resumed = open_run(config_path, list(overrides or []), run_id)
        run_id = opened = resumed.run_id
        run = get_run(run_id)
        start, cfg = min(start, run.began), run.cfg  # `lora-rl train` built the run before the flow: counted
        logger = get_run_logger()
        steps = cfg.trainer.steps
        t = TaskPhases(run_id, result_storage(resumed.store_uri, cfg.store.storage_options, run_id))
        progress.emit("run_started", {"steps": steps, **resumed.model_dump()})
        logger.info(f"run {run_id}: {steps} steps, resuming after checkpoint step {resumed.restored_step}")
        logger.info(progress.format_runtime(resumed.runtime))
        base_eval = _evaluate(t, None, "before", cfg.run.eval_before_after, logger)

        def on_step(metrics: dict[str, Any]) -> None:
            logger.info(progress.format_step(metrics))
            progress.emit("step", metrics)

        done = run_steps(t, steps=steps, ahead=resumed.rollouts_ahead, on_step=on_step)
        final_eval = _evaluate(t, done.final.name, "after", cfg.run.eval_before_after, logger)
        summary = run_summary(
            run_id,
            done.history,
            base_eval,
            final_eval,
            done.final.name,
            time.perf_counter() - start,
            resumed.store_uri,
            resumed.runtime,
        )
        summary["step_samples"] = t.call(samples.step_samples, len(done.history))
        if final_eval is None:  # not evaluated: the report still shows what the trained adapter writes
            summary["final_preview"] = t.call(samples.heldout_preview, done.final.name)
        summary["report"] = t.call(samples.report, done.history, summary)
        _artifacts(run_id, cfg, done.history, summary)
        progress.emit("run_finished", summary)
        return summary
    finally:
        if opened is not None:
            close_run(opened)  # the loop has waited for rollouts running ahead: the engine can close


def _evaluate(t: TaskPhases, adapter: str | None, phase: str, enabled: bool, logger: Any) -> dict[str, Any] | None:
    if not enabled:
        return None
    result = t.call(phases.evaluate, adapter)
    logger.info(
        f"greedy accuracy {phase} training: {progress.format_accuracy(result)} on {result['n']} held-out problems"
    )
    progress.emit("eval", {"phase": phase, **result})
    return result


def _artifacts(run_id: str, cfg: Any, history: list[dict[str, Any]], summary: dict[str, Any]) -> None:
    key = prefect_slug(run_id)
    create_table_artifact(step_table(history), key=f"{key}-step-metrics", description=f"Step metrics of {run_id}")
    create_markdown_artifact(
        artifact_markdown(run_id, cfg, summary), key=f"{key}-summary", description=f"Summary of {run_id}"
    )
