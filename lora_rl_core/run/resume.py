"""Checkpoints and resume of a run: what a crashed or retried run restores before its next step.

A checkpoint (`lora_rl_core.checkpoint`, every `trainer.checkpoint_every` steps) holds the trainer state
(LoRA weights, AdamW moments, scheduler, per-rank RNG) and the Python and torch RNG states of this process.
It does not hold the prompt sampler: the prompts of step `k` are a function of `(run.seed, k)`
(`lora_rl_core.run.phases.rollout` places the sampler's cursor from the step), so a resumed run draws the
same prompts whichever phases came from Prefect's cache. The train phase starts it; the trainer's ranks
write their parts and the run's writer its manifest, after that step's train record
(`lora_rl_core.run.checkpoints`).

Resuming = restore the newest checkpoint, then make the engines serve the newest published adapter version.
What a crash leaves: the newest version is at least the checkpoint's step minus one (a crash between the
step's checkpoint and its version: the resumed run publishes that version from the restored trainer); it can
be ahead of the newest checkpoint (a checkpoint completes while the next step trains, and versions between
checkpoints are published every step): those steps are trained again and their stored versions kept
(docs/DESIGN.md "Resume").
"""

from __future__ import annotations

import logging
import random
from collections.abc import Sequence

import torch

from lora_rl_core.config import load_config
from lora_rl_core.records import ResumeInfo
from lora_rl_core.run import components
from lora_rl_core.run.components import RunComponents
from lora_rl_core.run.state import Restored
from lora_rl_core.run.versions import sync

log = logging.getLogger(__name__)


def restore(run: RunComponents) -> ResumeInfo:
    """Load the newest checkpoint (trainer, RNG states) and sync the newest published version to the engines;
    record both in `run.restored`.

    Returns:
        Where the run starts: the checkpoint step (0 when fresh) and the policy version served.

    Raises:
        StoreError: a checkpoint or version that cannot be read or fails verification.
        EngineError: the newest version cannot be loaded and no earlier version serves.
    """
    step = run.checkpoints.latest(run.run_id)
    if step is not None:
        state = run.checkpoints.load(run.run_id, step)
        run.trainer.load_state_dict(state["trainer"])
        torch.set_rng_state(state["torch_rng"])
        version, internal, gauss = state["python_rng"]
        random.setstate((version, tuple(internal), gauss))
        trained = state.get("rollout_mode")  # absent in checkpoints of older runs
        if trained is not None and trained != run.plan.rollout_mode:
            log.warning(
                "run %s resumes in rollout.mode %s after training in %s up to step %d (%s); set rollout.mode: %s "
                "to keep it",
                run.run_id,
                run.plan.rollout_mode,
                trained,
                step,
                run.plan.choices["rollout.mode"].reason,
                trained,
            )
    latest = run.store.latest(run.run_id)
    run.restored = Restored(step=step or 0, newest_version=latest.version if latest else None)
    if latest is not None:
        sync(run, latest)
    return ResumeInfo(
        run_id=run.run_id,
        restored_step=step or 0,
        policy_version=run.policy.version,
        runtime=run.runtime,
        store_uri=run.store.uri,
        rollouts_ahead=run.plan.rollouts_ahead(),
    )


def resume_run(run_id: str | None, config_path: str | None, overrides: Sequence[str], unique: str) -> ResumeInfo:
    """Restore run `run_id` from its newest checkpoint (`restore`): the run open in this process under that id
    (`lora-rl train` builds it before its flow starts), else one built here from the config, validated once
    (`load_config`) and built once (`components.open_run`: a deployment's flow run, a retry from the UI), its id
    `components.default_run_id(cfg, unique)` when `run_id` is None. A run built here that fails to restore is
    closed again.

    Args:
        run_id: the run's id, or None for the config's default.
        config_path / overrides: the YAML config and its dotted overrides (read only where no run is open).
        unique: what the default id's suffix comes from (the flow run's id).

    Raises:
        ConfigError: a bad config; as `components.open_run` and `restore`.
    """
    if run_id is not None and components.is_open(run_id):
        return restore(components.get_run(run_id))
    cfg = load_config(config_path, list(overrides))
    run = components.open_run(cfg, run_id or components.default_run_id(cfg, unique))
    try:
        return restore(run)
    except BaseException:
        run.close()
        raise
