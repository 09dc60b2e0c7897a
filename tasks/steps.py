"""Prefect tasks of one training step: thin wrappers over `lora_rl_core.session.RunSession`.

Tasks take the run id and small values and return small values (metric dicts,
`AdapterRef`s); models, engines and tensors stay inside the session. Results
are not persisted or cached here (`NO_CACHE`): every phase writes its own
output under the run folder.
"""

from __future__ import annotations

from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from lora_rl_core.config import config_from_dict
from lora_rl_core.session import get_session, open_session
from lora_rl_core.store import AdapterRef

_OPTS: dict[str, Any] = {"cache_policy": NO_CACHE, "persist_result": False}


@task(name="open_run", **_OPTS)
def open_run(config: dict[str, Any], run_id: str) -> str:
    """Load models, engine, store and data for `run_id` in this process; returns the run id."""
    open_session(config_from_dict(config), run_id)
    return run_id


@task(name="rollout", **_OPTS)
def rollout(run_id: str, step: int) -> dict[str, float]:
    """Sample completions for step `step` with the current policy adapter."""
    return get_session(run_id).rollout(step)


@task(name="score", **_OPTS)
def score(run_id: str, step: int) -> dict[str, float]:
    """Reward the step's completions and compute advantages."""
    return get_session(run_id).score(step)


@task(name="train_step", **_OPTS)
def train_step(run_id: str, step: int) -> dict[str, float]:
    """One policy update on the step's scored rollouts."""
    return get_session(run_id).train_step(step)


@task(name="publish_adapter", retries=2, retry_delay_seconds=2, **_OPTS)
def publish_adapter(run_id: str, version: int, metrics: dict[str, float]) -> AdapterRef:
    """Publish the current LoRA weights as immutable version `version` (idempotent on retry)."""
    return get_session(run_id).publish(version, metrics)


@task(name="sync_engines", **_OPTS)
def sync_engines(run_id: str, ref: AdapterRef) -> dict[str, Any]:
    """Load `ref` into the engine(s) under its versioned name and switch rollouts to it."""
    return get_session(run_id).sync(ref)


@task(name="evaluate", **_OPTS)
def evaluate(run_id: str, adapter: str | None) -> dict[str, Any]:
    """Greedy held-out accuracy of `adapter` (None = base model)."""
    return get_session(run_id).evaluate(adapter)


@task(name="write_report", **_OPTS)
def write_report(run_id: str, history: list[dict[str, Any]], summary: dict[str, Any]) -> str:
    """Write report.md and reward_curve.png; returns the report path."""
    from lora_rl_core.report import write_report as _write

    session = get_session(run_id)
    return str(_write(session.workdir, run_id, session.cfg, history, summary))
