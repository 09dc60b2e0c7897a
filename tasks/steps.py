"""Prefect tasks of one training step: thin wrappers over `lora_rl_core.session.RunSession`.

Tasks take the run id and small values and return small values (metric dicts,
`AdapterRef`s); models, engines and tensors stay inside the session.

Resume: step tasks persist their results with cache keys that name the run,
the task and the step (`<run>-rollout-000007`), in result storage next to
the run in the adapter store (`step_tasks(result_storage)`). A retried flow
run, or a new flow run with the same run id, takes finished steps from the
cache (their task runs show `Cached`) and resumes with the first unfinished
one; the session restores the trainer from the newest checkpoint. `train_step`
is cached only on checkpoint steps, so a cached update always has a checkpoint
behind it.
"""

from __future__ import annotations

import re
from types import SimpleNamespace
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.filesystems import LocalFileSystem, RemoteFileSystem, WritableFileSystem

from lora_rl_core.config import StoreConfig, config_from_dict
from lora_rl_core.session import get_session, open_session
from lora_rl_core.store import AdapterRef

_NO_CACHE: dict[str, Any] = {"cache_policy": NO_CACHE, "persist_result": False}


def _step_key(context: Any, params: dict[str, Any]) -> str:
    return f"{params['run_id']}-{context.task.name}-{int(params['step']):06d}"


def _train_key(context: Any, params: dict[str, Any]) -> str | None:
    every = get_session(params["run_id"]).cfg.trainer.checkpoint_every
    return _step_key(context, params) if params["step"] % every == 0 else None


def _eval_key(context: Any, params: dict[str, Any]) -> str:
    return f"{params['run_id']}-evaluate-{params['adapter'] or 'base'}"


@task(name="open_run", **_NO_CACHE)
def open_run(config: dict[str, Any], run_id: str) -> dict[str, Any]:
    """Load models, engine, store and data for `run_id` in this process and restore the newest
    checkpoint; returns `{"run_id", "restored_step", "policy_version"}`."""
    return open_session(config_from_dict(config), run_id).resume_info()


@task(name="rollout", task_run_name="rollout-{step}", cache_key_fn=_step_key, persist_result=True)
def rollout(run_id: str, step: int) -> dict[str, float]:
    """Sample completions for step `step` with the current policy adapter."""
    return get_session(run_id).rollout(step)


@task(name="score", task_run_name="score-{step}", cache_key_fn=_step_key, persist_result=True)
def score(run_id: str, step: int) -> dict[str, float]:
    """Reward the step's completions and compute advantages."""
    return get_session(run_id).score(step)


@task(name="train_step", task_run_name="train_step-{step}", cache_key_fn=_train_key, persist_result=True)
def train_step(run_id: str, step: int) -> dict[str, float]:
    """One policy update on the step's scored rollouts (checkpointed every `checkpoint_every` steps)."""
    return get_session(run_id).train_step(step)


@task(
    name="publish_adapter",
    task_run_name="publish_adapter-{step}",
    cache_key_fn=_step_key,
    persist_result=True,
    retries=2,
    retry_delay_seconds=2,
)
def publish_adapter(run_id: str, step: int, metrics: dict[str, float]) -> AdapterRef:
    """Publish the current LoRA weights as immutable version `step` (idempotent on retry)."""
    return get_session(run_id).publish(step, metrics)


@task(name="sync_engines", **_NO_CACHE)
def sync_engines(run_id: str, ref: AdapterRef) -> dict[str, Any]:
    """Load `ref` into the engine(s) under its versioned name and switch rollouts to it (idempotent)."""
    return get_session(run_id).sync(ref)


@task(name="evaluate", cache_key_fn=_eval_key, persist_result=True)
def evaluate(run_id: str, adapter: str | None) -> dict[str, Any]:
    """Greedy held-out accuracy of `adapter` (None = base model)."""
    return get_session(run_id).evaluate(adapter)


@task(name="write_report", **_NO_CACHE)
def write_report(run_id: str, history: list[dict[str, Any]], summary: dict[str, Any]) -> str:
    """Write report.md and reward_curve.png; returns the report path."""
    from lora_rl_core.report import write_report as _write

    session = get_session(run_id)
    return str(_write(session.workdir, run_id, session.cfg, history, summary))


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


def step_tasks(storage: WritableFileSystem) -> SimpleNamespace:
    """The tasks, with persisted results going to `storage`."""
    cached = {
        "rollout": rollout,
        "score": score,
        "train_step": train_step,
        "publish_adapter": publish_adapter,
        "evaluate": evaluate,
    }
    tasks = {name: t.with_options(result_storage=storage) for name, t in cached.items()}
    return SimpleNamespace(open_run=open_run, sync_engines=sync_engines, write_report=write_report, **tasks)
