"""The policy trainer: one PPO-clip update of the LoRA parameters per training step, in this process or as
FSDP2 ranks.

`plan`: `TrainerPlan` (what a trainer is built from, every `auto` resolved by the run's plan); `build`:
`policy_model`, the one loader of the trainer's model (the run's builder picks the backend); `base`: the
`Trainer` protocol; `policy`: `PolicyTrainer` (in-process, or one rank of a sharded trainer); `batching`: rows
into tensors (`pack`) and rows to ranks (`rank_micro_batches`); `workers`: the ranks as spawned processes
(`TrainerWorkers`); `ray_actors`: the ranks as Ray actors (`RayTrainer`); `reduce`: what a step combines over
micro-batches and ranks (metrics, M2PO's batch mask). The sharding itself is `lora_rl_core.distributed`.
"""

from lora_rl_core.trainer.base import Trainer
from lora_rl_core.trainer.batching import PackedBatch, pack, rank_micro_batches
from lora_rl_core.trainer.build import policy_model
from lora_rl_core.trainer.plan import TrainerPlan
from lora_rl_core.trainer.policy import PolicyTrainer

__all__ = ["PackedBatch", "PolicyTrainer", "Trainer", "TrainerPlan", "pack", "policy_model", "rank_micro_batches"]
