"""Trainer plans for tests and benchmarks that build a `PolicyTrainer` on a model of their own: the run's
plan (`lora_rl_core.plan.make_plan`) of a config made of the given sections, on the CPU unless told."""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

from lora_rl_core.algorithm import ppo_clip_loss
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
    """`ppo_clip_loss`'s keyword arguments as the run's plan sets them for `algorithm` (default: the config's
    defaults): the fields of `TrainerPlan.loss` (`PolicyLoss`) that the loss takes by name, as `PolicyTrainer`
    passes them, for tests and benchmarks that call the loss on their own tensors. Read from the two
    definitions, so a field renamed in one and not the other drops out here and the loss call fails.

    Raises:
        ConfigError: as `make_plan`.
    """
    loss = trainer_plan(algorithm=algorithm).loss
    taken = inspect.signature(ppo_clip_loss).parameters
    return {f.name: getattr(loss, f.name) for f in dataclasses.fields(loss) if f.name in taken}
