"""Trainer plans for tests and benchmarks that build a `PolicyTrainer` on a model of their own: the run's
plan (`lora_rl_core.plan.make_plan`) of a config made of the given sections, on the CPU unless told."""

from __future__ import annotations

from typing import Any

from lora_rl_core.config import AlgorithmConfig, ModelConfig, RunConfig, TrainerConfig
from lora_rl_core.plan import make_plan
from lora_rl_core.trainer.plan import TrainerPlan


def trainer_plan(
    *,
    algorithm: AlgorithmConfig | None = None,
    trainer: TrainerConfig | None = None,
    model: ModelConfig | None = None,
    **sections: Any,
) -> TrainerPlan:
    """`make_plan(RunConfig(...)).trainer` for these sections (`model` default: `device: cpu`).

    Raises:
        ConfigError: as `make_plan` (e.g. bfloat16 LoRA compute over float32 base weights).
    """
    cfg = RunConfig(
        algorithm=algorithm or AlgorithmConfig(),
        trainer=trainer or TrainerConfig(),
        model=model or ModelConfig(device="cpu"),
        **sections,
    )
    plan = make_plan(cfg).trainer
    assert plan is not None
    return plan


def loss_kwargs(algorithm: AlgorithmConfig | None = None) -> dict[str, Any]:
    """`ppo_clip_loss`'s keyword arguments as the run's plan sets them (`TrainerPlan.loss`) for `algorithm`,
    for tests and benchmarks that call the loss on their own tensors."""
    loss = trainer_plan(algorithm=algorithm).loss
    return {
        "clip_eps_low": loss.clip_eps_low,
        "clip_eps_high": loss.clip_eps_high,
        "aggregation": loss.aggregation,
        "kl_coef": loss.kl_coef,
    }
