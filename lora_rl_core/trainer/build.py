"""The trainer's model from its plan (`TrainerPlan`, `lora_rl_core.plan`): the one loader of the base model with
the policy's LoRA (and PPO's critic) that an in-process trainer and every sharded rank use."""

from __future__ import annotations

import torch
from peft import PeftModel
from transformers import PreTrainedTokenizerBase

from lora_rl_core.models import load_model
from lora_rl_core.runtime import configure_allocator
from lora_rl_core.trainer.critic import with_adapters
from lora_rl_core.trainer.kernels import apply_kernels
from lora_rl_core.trainer.plan import TrainerPlan


def policy_model(
    plan: TrainerPlan,
    *,
    device: str | torch.device,
    seed: int | None = None,
    tokenizer: PreTrainedTokenizerBase | None = None,
) -> tuple[PeftModel, int]:
    """The base model `plan.model` on `device` in `plan.dtype`, with Liger's kernels where the plan chose them
    (`plan.liger_kernels`), wrapped with the policy's LoRA and, under GAE, the critic's adapter and head
    (`with_adapters`). With `seed`, torch's RNG is seeded just before the adapters are made (sharded ranks: the
    same init on every rank); without it the caller's RNG state decides (an in-process trainer, seeded with
    `run.seed` by the run's builder). `tokenizer`: the run's, where this process has it (else loaded, for its
    pad token id).

    Returns:
        The model and the tokenizer's pad token id.

    A trainer on the CPU also makes glibc keep the memory each step frees (`runtime.configure_allocator`).

    Raises:
        ModelError: the model cannot be loaded. ConfigError: a LoRA's target modules match no linear module.
    """
    if torch.device(plan.device).type == "cpu":
        configure_allocator()  # process-wide: this process trains on the CPU
    model, tokenizer = load_model(plan.model, device=device, dtype=plan.dtype, tokenizer=tokenizer)
    apply_kernels(model, plan.liger_kernels)
    if seed is not None:
        torch.manual_seed(seed)
    return with_adapters(model, plan), tokenizer.pad_token_id
