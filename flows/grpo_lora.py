"""`lora-rl-train`: GRPO + LoRA as a Prefect flow.

Reads like the algorithm: open the run, publish and sync the initial adapter
(version 0, a no-op LoRA), measure the base model, then per step
rollout -> score -> train_step -> publish_adapter -> sync_engines, and finally
measure the trained adapter and write the report and artifacts.
With `rollout.mode: async` the rollouts of the next `algorithm.max_staleness`
steps are submitted as task futures before a step trains, so they are generated
while it trains, each with the version current when it starts (docs/DESIGN.md,
"Asynchronous rollouts").
Runs on an ephemeral Prefect server when no `PREFECT_API_URL` is set.
"""

from __future__ import annotations

import time
from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.futures import PrefectFuture, wait
from prefect.runtime import flow_run

from lora_rl_core import progress
from lora_rl_core.config import load_config
from lora_rl_core.records import RolloutStats
from lora_rl_core.report import run_summary, step_table, summary_markdown
from tasks.registry import close_run
from tasks.steps import StepTasks, prefect_slug, result_storage, step_tasks


@flow(name="lora-rl-train")
def train(
    config_path: str | None = None, overrides: list[str] | None = None, run_id: str | None = None
) -> dict[str, Any]:
    """Train a LoRA policy with GRPO and publish every step's adapter to the store.

    Args:
        config_path: YAML run config (None = built-in defaults).
        overrides: dotted `key=value` overrides, e.g. `["lora.rank=32"]`.
        run_id: run id (default: `run.id`, else `<run.name>-<timestamp>`).

    Returns:
        summary: run_id, final_adapter, base/final accuracy, wall_seconds, seconds_per_step,
        completions_per_second, report path.
    """
    start = time.perf_counter()
    cfg = load_config(config_path, overrides or [])
    # A retry of this flow run keeps its id, so it resumes the same run.
    run_id = run_id or cfg.run.id or f"{cfg.run.name}-{str(flow_run.id)[:8]}"
    logger = get_run_logger()
    steps = cfg.trainer.steps
    t = step_tasks(result_storage(cfg.store, run_id))
    resumed = t.open_run(cfg.model_dump(mode="json"), run_id)
    rollouts = Rollouts(t, run_id)
    try:
        progress.emit("run_started", {"steps": steps, **resumed.model_dump()})
        logger.info(f"run {run_id}: {steps} steps, resuming after checkpoint step {resumed.restored_step}")
        logger.info(progress.format_runtime(resumed.runtime))
        ref = t.publish_adapter(run_id, 0, {})
        t.sync_engines(run_id, ref)
        base_eval = _evaluate(t, run_id, None, "before", cfg.run.eval_before_after, logger)
        history: list[dict[str, Any]] = []
        ahead = cfg.rollouts_ahead()
        for step in range(1, steps + 1):
            t0 = time.perf_counter()
            metrics: dict[str, Any] = {"step": step, "steps": steps}
            metrics.update(rollouts.take(step, ahead=ahead, last=steps).metrics())
            metrics.update(t.score(run_id, step).metrics())
            metrics.update(t.train_step(run_id, step).metrics())
            ref = t.publish_adapter(run_id, step, metrics)
            metrics.update(t.sync_engines(run_id, ref).metrics(), step_seconds=time.perf_counter() - t0)
            history.append(metrics)
            logger.info(progress.format_step(metrics))
            progress.emit("step", metrics)
        final_eval = _evaluate(t, run_id, ref.name, "after", cfg.run.eval_before_after, logger)
        summary = run_summary(
            run_id,
            history,
            base_eval,
            final_eval,
            ref.name,
            time.perf_counter() - start,
            resumed.store_uri,
            resumed.runtime,
        )
        summary["report"] = t.write_report(run_id, history, summary)
        _artifacts(run_id, cfg, history, summary)
        progress.emit("run_finished", summary)
        return summary
    finally:
        rollouts.drain()  # rollouts running ahead finish (and persist) before the engine closes
        close_run(run_id)


class Rollouts:
    """The rollout task runs of a flow run. Sync mode: a step's rollout runs when the step needs it. Async
    mode: taking step k's rollout first submits those of steps k .. k + ahead as Prefect task futures (the
    flow's task runner runs them while the flow goes on to train), so up to `ahead` rollouts run beside each
    training step."""

    def __init__(self, t: StepTasks, run_id: str) -> None:
        self.t, self.run_id = t, run_id
        self.futures: dict[int, PrefectFuture[RolloutStats]] = {}

    def take(self, step: int, *, ahead: int, last: int) -> RolloutStats:
        """Step `step`'s rollout, after submitting the next `ahead` ones (not beyond step `last`).

        Raises:
            whatever the rollout task raised (e.g. `EngineError`).
        """
        if ahead == 0 and step not in self.futures:
            return self.t.rollout(self.run_id, step)
        for s in range(step, min(last, step + ahead) + 1):
            if s not in self.futures:
                self.futures[s] = self.t.rollout.submit(self.run_id, s)
        return self.futures.pop(step).result()

    def drain(self) -> None:
        """Wait for the rollouts still running (a failed step leaves them; their results persist for a
        resume, or they fail on their own)."""
        wait(list(self.futures.values()))
        self.futures.clear()


def _evaluate(
    t: StepTasks, run_id: str, adapter: str | None, phase: str, enabled: bool, logger: Any
) -> dict[str, Any] | None:
    if not enabled:
        return None
    result = t.evaluate(run_id, adapter)
    logger.info(f"greedy accuracy {phase} training: {100 * result['accuracy']:.1f}% on {result['n']} held-out problems")
    progress.emit("eval", {"phase": phase, **result})
    return result


def _artifacts(run_id: str, cfg: Any, history: list[dict[str, Any]], summary: dict[str, Any]) -> None:
    key = prefect_slug(run_id)
    create_table_artifact(step_table(history), key=f"{key}-step-metrics", description=f"Step metrics of {run_id}")
    create_markdown_artifact(
        summary_markdown(run_id, cfg, summary), key=f"{key}-summary", description=f"Summary of {run_id}"
    )
