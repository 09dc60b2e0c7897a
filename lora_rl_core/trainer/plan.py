"""What the trainer is built from: `TrainerPlan` and its records (`PolicyLoss`, `OptimizerSettings`), made by the
run's plan (`lora_rl_core.plan.make_plan`) with every `auto` setting resolved. Plain frozen dataclasses: they
travel to FSDP2 ranks (spawned processes, Ray actors) pickled, as made, and are never validated again."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from lora_rl_core.config import LoRAConfig, ModelConfig, ResolvedCorrection

TrainerBackend = Literal["in-process", "local", "ray"]
"""Where the trainer runs (`trainer.backend.type`): in this process, as spawned FSDP2 processes (`local`) or as
FSDP2 Ray actors (`ray`)."""


@dataclass(frozen=True)
class PolicyLoss:
    """The policy loss's settings (`algorithm` section, validated once by the config), with the off-policy
    correction resolved for the run's rollout mode.

    Attributes:
        clip_eps_low / clip_eps_high: the PPO clip range below and above 1 (DAPO's clip-higher above); None: no
            clip (M2PO, whose mask bounds the importance ratios instead).
        kl_coef: the k3 KL penalty's weight (0 = off: no reference forward).
        aggregation: how per-token losses become a scalar (`algorithm.loss_aggregation`).
        num_minibatches: optimizer steps per training step.
        off_policy_correction: `algorithm.off_policy_correction` resolved (never `auto`).
    """

    clip_eps_low: float | None
    clip_eps_high: float | None
    kl_coef: float
    aggregation: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"]
    num_minibatches: int
    off_policy_correction: ResolvedCorrection


@dataclass(frozen=True)
class OptimizerSettings:
    """AdamW on the LoRA parameters with a linear warm-up and global-norm gradient clipping (`trainer` section).

    Attributes:
        lr: the peak learning rate. betas / weight_decay: AdamW's. warmup_steps: linear warm-up steps of the
        learning rate. max_grad_norm: the global gradient-norm clip.
    """

    lr: float
    betas: tuple[float, float]
    weight_decay: float
    warmup_steps: int
    max_grad_norm: float


@dataclass(frozen=True)
class CriticSettings:
    """PPO's critic (`algorithm.advantage: gae`; the `critic` section and GAE's settings, resolved once).

    Attributes:
        lora: the critic adapter's shape (`critic.lora`, else the policy's `lora`).
        lr: its AdamW learning rate (`critic.lr`, else `CRITIC_LR_FACTOR` x `trainer.lr`).
        epochs: the critic's passes (and optimizer steps) over each batch (`critic.epochs`).
        pretrain_steps: critic-only steps at the start (`critic.pretrain_steps`).
        value_clip: PPO's value clip (None: unclipped). loss_coef: the value loss's weight.
        max_grad_norm: the critic's gradient-norm clip. head_init_std: the value head's init (0: zeros).
        gamma / lam: GAE's discount and lambda (`algorithm.gamma`, `algorithm.lam`).
        kl_coef: the per-token KL's weight in the reward (`algorithm.kl_coef`; under GAE not in the loss).
    """

    lora: LoRAConfig
    lr: float
    epochs: int
    pretrain_steps: int
    value_clip: float | None
    loss_coef: float
    max_grad_norm: float
    head_init_std: float
    gamma: float
    lam: float
    kl_coef: float


@dataclass(frozen=True)
class TrainerPlan:
    """What builds the trainer, every `auto` resolved (`lora_rl_core.run.components.build_run`). Frozen; sent
    to FSDP2 ranks in other processes and on Ray as it is (pickled), never validated again.

    Attributes:
        model: the `model` section with `device` and `dtype` resolved (the in-process trainer's device, or the
            ranks' kind `cpu` / `cuda`; the base weights' dtype on it).
        lora: the `lora` section (no `auto` in it).
        loss: the policy loss's settings (`PolicyLoss`). optimizer: AdamW's (`OptimizerSettings`).
        temperature: the rollout sampling temperature (the trainer divides its logits by it).
        seed: `run.seed` (the LoRA initialisation, the same on every rank).
        lora_compute_dtype: `float32` or `bfloat16` (`trainer.lora_compute_dtype` resolved).
        liger_kernels: Liger's fused kernels patched into the trainer's model.
        torch_compile: each decoder layer of the in-process trainer's model compiled (`trainer.torch_compile`).
        gradient_checkpointing / micro_batch_size: from the memory plan.
        backend / world_size: where the ranks run and how many (0: in this process; `trainer.backend`).
        ray_gpus_per_rank: GPUs each Ray rank reserves (`trainer.backend.gpus_per_rank`; 0 on a CPU).
        gpus: the CUDA device of each local rank (indices among the driver's visible devices; `placement`);
            () = rank r on `cuda:r`.
        shard_weights: FSDP2 shards the base weights over the ranks (False: each rank holds them whole and only
            the LoRA gradients are summed; `trainer.shard_weights` resolved by the memory plan).
        empty_cache_after_step: give the cached CUDA blocks back after each train step (on every rank): a
            launched SGLang on the same GPUs takes its KV cache back then (the memory plan's `memory_saver`).
        critic: PPO's critic (`CriticSettings`) under `algorithm.advantage: gae`; None otherwise.
    """

    model: ModelConfig
    lora: LoRAConfig
    loss: PolicyLoss
    optimizer: OptimizerSettings
    temperature: float
    seed: int
    lora_compute_dtype: Literal["float32", "bfloat16"]
    liger_kernels: bool
    gradient_checkpointing: bool
    micro_batch_size: int
    backend: TrainerBackend
    world_size: int
    ray_gpus_per_rank: float
    gpus: tuple[int, ...] = ()
    empty_cache_after_step: bool = False
    shard_weights: bool = True
    torch_compile: bool = False
    critic: CriticSettings | None = None

    @property
    def device(self) -> str:
        """The in-process trainer's device (`cpu`, `cuda`, `cuda:1`), or the ranks' kind (`cpu`, `cuda`)."""
        return self.model.device

    @property
    def dtype(self) -> str:
        """The base weights' dtype (`model.dtype` resolved on the trainer's device)."""
        return self.model.dtype

    @property
    def mixed_precision(self) -> bool:
        """FSDP2's bfloat16 mixed precision for sharded ranks: on unless the LoRA computes in float32."""
        return self.lora_compute_dtype != "float32"
