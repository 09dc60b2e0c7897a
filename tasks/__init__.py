"""Prefect tasks: thin wrappers over lora_rl_core (retries and caching live here)."""

from tasks.steps import evaluate, open_run, publish_adapter, rollout, score, sync_engines, train_step, write_report

__all__ = ["evaluate", "open_run", "publish_adapter", "rollout", "score", "sync_engines", "train_step", "write_report"]
