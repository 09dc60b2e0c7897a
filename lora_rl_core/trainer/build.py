"""The one place that builds a run's trainer from its plan (`TrainerPlan`, `lora_rl_core.plan`)."""

from __future__ import annotations

import logging

from lora_rl_core.models import load_model
from lora_rl_core.trainer.base import Trainer
from lora_rl_core.trainer.critic import with_adapters
from lora_rl_core.trainer.kernels import apply_kernels, compile_layers
from lora_rl_core.trainer.plan import TrainerPlan
from lora_rl_core.trainer.policy import PolicyTrainer

log = logging.getLogger(__name__)


def build_trainer(plan: TrainerPlan, *, pad_id: int) -> Trainer:
    """The trainer `plan.backend` names: `in-process` (this process: its own copy of the base model with a
    fresh LoRA, seeded by the caller), `local` (`plan.world_size` spawned FSDP2 processes, `TrainerWorkers`)
    or `ray` (FSDP2 Ray actors, `RayTrainer`).

    Raises:
        ModelError: the model cannot be loaded; TrainerWorkerError: ranks did not start.
    """
    if plan.backend == "ray":
        from lora_rl_core.trainer.ray_actors import RayTrainer  # lazy: Ray only when asked for

        return RayTrainer(plan)
    if plan.backend == "local":
        from lora_rl_core.trainer.workers import TrainerWorkers

        return TrainerWorkers(plan)
    model, _ = load_model(plan.model, device=plan.device, dtype=plan.dtype)
    apply_kernels(model, plan.liger_kernels)
    peft_model = with_adapters(model, plan)  # the policy's LoRA, and PPO's critic under GAE
    if plan.torch_compile:
        layers = compile_layers(peft_model)
        log.info("trainer: %d decoder layers compiled (trainer.torch_compile); step 1 pays the compilation", layers)
    return PolicyTrainer(peft_model, plan, pad_id=pad_id)
