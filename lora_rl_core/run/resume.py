"""Checkpoints and resume of a run: what a crashed or retried run restores before its next step.

A checkpoint (`lora_rl_core.checkpoint`, every `trainer.checkpoint_every` steps) holds the trainer state
(LoRA weights, AdamW moments, scheduler, per-rank RNG) and the Python and torch RNG states of this process.
It does not hold the prompt sampler: the prompts of step `k` are a function of `(run.seed, k)`
(`lora_rl_core.run.phases.rollout` places the sampler's cursor from the step), so a resumed run draws the
same prompts whichever phases came from Prefect's cache.

Resuming = restore the newest checkpoint, then make the engines serve the newest published adapter version
(which may be one step ahead of the checkpoint when a run died between publish and the next checkpoint; the
flow's cached tasks then replay from the checkpoint step, docs/DESIGN.md "Resume").
"""

from __future__ import annotations

import random

import torch

from lora_rl_core.records import ResumeInfo
from lora_rl_core.run.components import RunComponents
from lora_rl_core.run.versions import sync


def save_checkpoint(run: RunComponents, step: int) -> None:
    """Checkpoint the trainer and the RNG states after `step`, then prune to `trainer.keep_checkpoints`."""
    state = {
        "step": step,
        "trainer": run.trainer.state_dict(),
        "torch_rng": torch.get_rng_state(),
        "python_rng": random.getstate(),
    }
    run.checkpoints.save(run.run_id, step, state)
    run.checkpoints.prune(run.run_id, keep_last=run.cfg.trainer.keep_checkpoints)


def restore(run: RunComponents) -> ResumeInfo:
    """Load the newest checkpoint (trainer, RNG states) and sync the newest published version to the engines.

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
    latest = run.store.latest(run.run_id)
    if latest is not None:
        sync(run, latest)
    return ResumeInfo(
        run_id=run.run_id,
        restored_step=step or 0,
        policy_version=run.policy.version,
        runtime=run.runtime,
        store_uri=run.store.uri,
    )
