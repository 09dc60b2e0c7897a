"""Pure tensor functions of the RL algorithm: advantages and losses.

No model, no config object, no ``torch.distributed``: the trainer passes
tensors in and gets tensors (and metric floats) back.
"""

from lora_rl_core.algorithm.advantages import (
    ADVANTAGE_ESTIMATORS,
    critic_advantages,
    drgrpo_advantages,
    group_has_signal,
    grpo_advantages,
    masked_group_advantages,
    rloo_advantages,
)
from lora_rl_core.algorithm.logprobs import token_logprobs, token_logprobs_and_entropy
from lora_rl_core.algorithm.losses import (
    LOSS_AGGREGATIONS,
    OFF_POLICY_MODES,
    aggregate,
    kl_k3,
    m2po_keep_mask,
    m2po_weights,
    off_policy_weights,
    ppo_clip_loss,
)

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "LOSS_AGGREGATIONS",
    "OFF_POLICY_MODES",
    "aggregate",
    "critic_advantages",
    "drgrpo_advantages",
    "group_has_signal",
    "grpo_advantages",
    "masked_group_advantages",
    "kl_k3",
    "m2po_keep_mask",
    "m2po_weights",
    "off_policy_weights",
    "ppo_clip_loss",
    "rloo_advantages",
    "token_logprobs",
    "token_logprobs_and_entropy",
]
