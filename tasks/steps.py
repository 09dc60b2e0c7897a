"""Prefect tasks of one training step: thin wrappers over `lora_rl_core.run` (phases, versions, resume), and
`TaskPhases`, which hands them to the library's step loop (`lora_rl_core.run.loop.run_steps`).

Tasks take the run id and small values and return small typed records (`lora_rl_core.records` stats,
`AdapterRef`s); models, engines and tensors stay in the run's components, which `tasks.registry` keeps.

Resume: `rollout` and `score` persist their results with cache keys that name
the run, the task and the step (`<run>-rollout-000007`), in result storage next
to the run in the adapter store (`step_tasks(result_storage)`). A retried flow
run, or a new flow run with the same run id, takes them from the cache (their
task runs show `Cached`); `open_run` restores the trainer from the newest
checkpoint. `train_step` and `publish_adapter` are not cached: they return as
soon as their snapshot is handed to the run's store writer, before the store
holds it, so a cached result could name a checkpoint or version a crash never
let land. The library answers them from the store instead: a step the restored
checkpoint holds replays its recorded stats, a version the store holds is
returned as stored (`lora_rl_core.run.phases.train`, `versions.publish`).
`flush_writes` waits for the writes at the end of the steps (and on a failure).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from prefect import Task, task
from prefect.cache_policies import NO_CACHE
from prefect.filesystems import LocalFileSystem, RemoteFileSystem, WritableFileSystem
from prefect.futures import PrefectFuture

from lora_rl_core.config import RunConfig, StoreConfig
from lora_rl_core.records import ResumeInfo, RolloutStats, ScoreStats, SyncStats, TrainStats
from lora_rl_core.run import phases, versions
from lora_rl_core.store import AdapterRef
from tasks import registry

_NO_CACHE: dict[str, Any] = {"cache_policy": NO_CACHE, "persist_result": False}


def _step_key(context: Any, params: dict[str, Any]) -> str:
    return f"{params['run_id']}-{context.task.name}-{int(params['step']):06d}"


def _eval_key(context: Any, params: dict[str, Any]) -> str:
    # "graded": evaluations by the fixed grader (issue 31); one cached by a run of an older version, graded by
    # the training reward, is not reused when the run resumes
    return f"{params['run_id']}-evaluate-graded-{params['adapter'] or 'base'}"


@task(name="open_run", **_NO_CACHE)
def open_run(cfg: RunConfig, run_id: str) -> ResumeInfo:
    """Plan run `run_id` from its validated config, build its models, engine, store and data in this process
    and restore the newest checkpoint."""
    return registry.open_run(cfg, run_id)


@task(name="rollout", task_run_name="rollout-{step}", cache_key_fn=_step_key, persist_result=True)
def rollout(run_id: str, step: int) -> RolloutStats:
    """Sample completions for step `step` with the current policy adapter."""
    return phases.rollout(registry.get_run(run_id), step)


@task(name="score", task_run_name="score-{step}", cache_key_fn=_step_key, persist_result=True)
def score(run_id: str, step: int) -> ScoreStats:
    """Reward the step's completions and compute advantages."""
    return phases.score(registry.get_run(run_id), step)


@task(name="train_step", task_run_name="train_step-{step}", **_NO_CACHE)
def train_step(run_id: str, step: int) -> TrainStats:
    """One policy update on the step's scored rollouts; its record and checkpoint (every `checkpoint_every`
    steps) are written in the background. A step the restored checkpoint holds replays its recorded stats."""
    return phases.train(registry.get_run(run_id), step)


@task(name="publish_adapter", task_run_name="publish_adapter-{step}", **_NO_CACHE)
def publish_adapter(run_id: str, step: int, metrics: dict[str, Any]) -> AdapterRef:
    """Publish the current LoRA weights as immutable version `step`: returns its ref at once, the upload runs
    in the background (a version already in the store is returned as stored). Not retried: the store retries
    transient errors itself, and a failed background write fails the run until it is resumed."""
    return versions.publish(registry.get_run(run_id), step, metrics)


@task(name="flush_writes", **_NO_CACHE)
def flush_writes(run_id: str) -> None:
    """Wait until every train record, checkpoint and version of the run is in the store; raise a failed one."""
    versions.flush(registry.get_run(run_id))


@task(name="sync_engines", **_NO_CACHE)
def sync_engines(run_id: str, ref: AdapterRef) -> SyncStats:
    """Load `ref` into the engine(s) under its versioned name and switch rollouts to it (idempotent)."""
    return versions.sync(registry.get_run(run_id), ref)


@task(name="evaluate", cache_key_fn=_eval_key, persist_result=True)
def evaluate(run_id: str, adapter: str | None) -> dict[str, Any]:
    """Greedy held-out accuracy of `adapter` (None = base model)."""
    return phases.evaluate(registry.get_run(run_id), adapter)


@task(name="step_samples", **_NO_CACHE)
def step_samples(run_id: str, steps: int) -> list[dict[str, Any]]:
    """Sample completions of the first, middle and last steps, with their prompts and reward terms."""
    from lora_rl_core.run.samples import step_samples as _samples

    return _samples(registry.get_run(run_id), steps)


@task(name="heldout_preview", **_NO_CACHE)
def heldout_preview(run_id: str, adapter: str) -> dict[str, Any] | None:
    """Greedy completions of `adapter` on the first few held-out problems, for the report of a run that does not
    evaluate (`run.eval_before_after: false`)."""
    from lora_rl_core.run.samples import heldout_preview as _preview

    return _preview(registry.get_run(run_id), adapter)


@task(name="write_report", **_NO_CACHE)
def write_report(run_id: str, history: list[dict[str, Any]], summary: dict[str, Any]) -> str:
    """Write report.md and reward_curve.png; returns the report path."""
    from lora_rl_core.report import write_report as _write

    run = registry.get_run(run_id)
    return str(_write(run.workdir, run_id, run.cfg, history, summary))


def result_storage(store: StoreConfig, run_id: str) -> WritableFileSystem:
    """Where task results persist: `<store>/<run_id>/prefect-results` (local folder or fsspec remote),
    saved as a block named after the run so a retry on any worker reads the same results."""
    url = f"{store.build().uri.rstrip('/')}/{run_id}/prefect-results"
    block = (
        LocalFileSystem(basepath=url.removeprefix("file://"))
        if url.startswith("file://")
        else RemoteFileSystem(basepath=url, settings=store.storage_options)
    )
    block.save(f"lora-rl-results-{prefect_slug(run_id)}"[:120], overwrite=True)
    return block


def prefect_slug(text: str) -> str:
    """`text` as a Prefect block/artifact key: lowercase letters, digits and dashes."""
    return re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")


@dataclass(frozen=True)
class StepTasks:
    """The tasks of a run, the cached ones persisting their results to the run's result storage."""

    open_run: Task[..., ResumeInfo]
    rollout: Task[..., RolloutStats]
    score: Task[..., ScoreStats]
    train_step: Task[..., TrainStats]
    publish_adapter: Task[..., AdapterRef]
    sync_engines: Task[..., SyncStats]
    flush_writes: Task[..., None]
    evaluate: Task[..., dict[str, Any]]
    step_samples: Task[..., list[dict[str, Any]]]
    heldout_preview: Task[..., dict[str, Any] | None]
    write_report: Task[..., str]


def step_tasks(storage: WritableFileSystem) -> StepTasks:
    """The tasks, with persisted results going to `storage`."""
    return StepTasks(
        open_run=open_run,
        rollout=rollout.with_options(result_storage=storage),
        score=score.with_options(result_storage=storage),
        train_step=train_step,
        publish_adapter=publish_adapter,
        sync_engines=sync_engines,
        flush_writes=flush_writes,
        evaluate=evaluate.with_options(result_storage=storage),
        step_samples=step_samples,
        heldout_preview=heldout_preview,
        write_report=write_report,
    )


@dataclass(frozen=True)
class TaskPhases:
    """The step phases of run `run_id` as Prefect tasks, for `lora_rl_core.run.loop.run_steps`: each phase is a
    task run (cached, retried and persisted as its decorator says); async rollouts are task futures, run by the
    flow's task runner while the flow goes on to train."""

    t: StepTasks
    run_id: str

    def publish(self, step: int, metrics: Mapping[str, Any]) -> AdapterRef:
        """The `publish_adapter` task."""
        return self.t.publish_adapter(self.run_id, step, dict(metrics))

    def sync(self, ref: AdapterRef) -> SyncStats:
        """The `sync_engines` task."""
        return self.t.sync_engines(self.run_id, ref)

    def rollout(self, step: int) -> RolloutStats:
        """The `rollout` task, run now."""
        return self.t.rollout(self.run_id, step)

    def submit_rollout(self, step: int) -> PrefectFuture[RolloutStats]:
        """The `rollout` task, submitted to the flow's task runner."""
        return self.t.rollout.submit(self.run_id, step)

    def score(self, step: int) -> ScoreStats:
        """The `score` task."""
        return self.t.score(self.run_id, step)

    def train(self, step: int) -> TrainStats:
        """The `train_step` task."""
        return self.t.train_step(self.run_id, step)

    def flush(self) -> None:
        """The `flush_writes` task."""
        self.t.flush_writes(self.run_id)
