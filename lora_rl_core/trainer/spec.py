"""What the trainer is built from: `TrainerPlan`, every `auto` setting resolved (by the run's plan,
`lora_rl_core.plan.make_plan`). JSON-safe, so it travels to FSDP2 ranks in other processes and on Ray."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

from lora_rl_core.config import AlgorithmConfig, LoRAConfig, ModelConfig, ResolvedCorrection, TrainerConfig

TrainerBackend = Literal["in-process", "local", "ray"]
"""Where the trainer runs (`trainer.backend.type`): in this process, as spawned FSDP2 processes (`local`) or as
FSDP2 Ray actors (`ray`)."""


class TrainerPlan(BaseModel):
    """What builds the trainer, every `auto` resolved (`lora_rl_core.trainer.build.build_trainer`). Frozen;
    JSON-safe, so it travels to FSDP2 ranks in other processes and on Ray.

    Attributes:
        model / lora / algorithm / trainer: the config sections the trainer reads (lr, betas, clip ranges...).
            Their `auto` fields are not read: the resolved values below are.
        temperature: the rollout sampling temperature (the trainer divides its logits by it).
        seed: `run.seed` (the LoRA initialisation, the same on every rank).
        device: the in-process trainer's device (`cpu`, `cuda`, `cuda:1`), or the ranks' kind (`cpu`, `cuda`).
        dtype: the base weights' dtype (`model.dtype` resolved on the trainer's device).
        lora_compute_dtype: `float32` or `bfloat16` (`trainer.lora_compute_dtype` resolved).
        liger_kernels: Liger's fused kernels patched into the trainer's model.
        torch_compile: each decoder layer of the in-process trainer's model compiled (`trainer.torch_compile`).
        gradient_checkpointing / micro_batch_size: from the memory plan.
        off_policy_correction: `algorithm.off_policy_correction` resolved for `rollout.mode` (never `auto`).
        backend / world_size: where the ranks run and how many (0: in this process; `trainer.backend`).
        ray_gpus_per_rank: GPUs each Ray rank reserves (`trainer.backend.gpus_per_rank`; 0 on a CPU).
        gpus: the CUDA device of each local rank (indices among the driver's visible devices; `placement`);
            () = rank r on `cuda:r`.
        shard_weights: FSDP2 shards the base weights over the ranks (False: each rank holds them whole and only
            the LoRA gradients are summed; `trainer.shard_weights` resolved by the memory plan).
        empty_cache_after_step: give the cached CUDA blocks back after each train step (on every rank): a
            launched SGLang on the same GPUs takes its KV cache back then (the memory plan's `memory_saver`).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: ModelConfig
    lora: LoRAConfig
    algorithm: AlgorithmConfig
    trainer: TrainerConfig
    temperature: float
    seed: int
    device: str
    dtype: str
    lora_compute_dtype: Literal["float32", "bfloat16"]
    liger_kernels: bool
    gradient_checkpointing: bool
    micro_batch_size: int
    off_policy_correction: ResolvedCorrection
    backend: TrainerBackend
    world_size: int
    ray_gpus_per_rank: float
    gpus: tuple[int, ...] = ()
    empty_cache_after_step: bool = False
    shard_weights: bool = True
    torch_compile: bool = False

    @property
    def mixed_precision(self) -> bool:
        """FSDP2's bfloat16 mixed precision for sharded ranks: on unless the LoRA computes in float32."""
        return self.lora_compute_dtype != "float32"
