"""Group-relative advantage estimators: one scalar advantage per completion.

Rewards arrive grouped: ``rewards_NG`` is a float tensor ``[N, G]`` with N
groups (one per prompt) of G = ``group_size`` completions each. Every
estimator returns float advantages ``[N, G]``; the loss broadcasts each
completion's advantage over its tokens.

Choices made here:

* GRPO divides by the *unbiased* (Bessel, G - 1) standard deviation of the
  group, as TRL's ``GRPOTrainer`` does with ``torch.std``. DeepSeekMath
  (Shao et al. 2024, sec. 4.1.2) writes "std" without saying which.
* A group whose rewards are all equal gets zero advantages from every
  estimator (GRPO's ``eps`` keeps 0 / 0 finite), so it adds no policy
  gradient; ``group_has_signal`` finds such groups so the trainer can drop
  them.
* GRPO and RLOO need ``group_size >= 2`` (the std and the leave-one-out mean
  are undefined for one completion) and raise ``ValueError`` otherwise.
  Dr. GRPO is defined for ``group_size == 1`` and gives zeros.
* A new estimator is a new function plus an entry in
  ``ADVANTAGE_ESTIMATORS``, never a branch.

``gae`` (PPO with a learned critic) makes per-token advantages in the train
phase (``lora_rl_core.algorithm.gae``, ``lora_rl_core.trainer.critic``); its
entry here gives the score phase zeros. Left out: batch-level (rather than
group-level) std normalisation as in REINFORCE++.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor


def _check_grouped(rewards_NG: Tensor, *, min_group_size: int = 1) -> Tensor:
    """Return ``rewards_NG`` as a floating tensor; raise ``ValueError`` unless it is ``[N, G]`` with G >= min."""
    if rewards_NG.dim() != 2:
        raise ValueError(f"rewards_NG must be 2-D [num_groups, group_size], got shape {tuple(rewards_NG.shape)}")
    if rewards_NG.shape[1] < min_group_size:
        raise ValueError(
            f"group_size must be >= {min_group_size} for this estimator, "
            f"got rewards_NG of shape {tuple(rewards_NG.shape)}"
        )
    return rewards_NG if rewards_NG.is_floating_point() else rewards_NG.float()


def grpo_advantages(rewards_NG: Tensor, *, eps: float = 1e-6) -> Tensor:
    """GRPO advantages: ``(r - mean_g) / (std_g + eps)`` within each group.

    DeepSeekMath (Shao et al. 2024), sec. 4.1.2, outcome supervision:
    ``A_i = (r_i - mean(r)) / std(r)``. ``std_g`` is unbiased (divides by
    G - 1), matching TRL's ``GRPOTrainer``; ``eps`` keeps groups with equal
    rewards at exactly zero instead of NaN.

    Args:
        rewards_NG: ``[N, G]`` rewards, N groups of G >= 2 completions.
        eps: added to the std before dividing.

    Returns:
        ``[N, G]`` advantages, same floating dtype as the rewards
        (integer rewards become float32).
    """
    rewards_NG = _check_grouped(rewards_NG, min_group_size=2)
    mean_N1 = rewards_NG.mean(dim=1, keepdim=True)
    std_N1 = rewards_NG.std(dim=1, keepdim=True, correction=1)
    return (rewards_NG - mean_N1) / (std_N1 + eps)


def drgrpo_advantages(rewards_NG: Tensor) -> Tensor:
    """Dr. GRPO advantages: ``r - mean_g``, with no std division.

    Liu et al. 2025, "Understanding R1-Zero-Like Training: A Critical
    Perspective": dividing by the group std up-weights groups whose
    rewards barely differ (too easy or too hard prompts), so Dr. GRPO drops it.

    Args:
        rewards_NG: ``[N, G]`` rewards.

    Returns:
        ``[N, G]`` advantages, floating dtype of the rewards.
    """
    rewards_NG = _check_grouped(rewards_NG)
    return rewards_NG - rewards_NG.mean(dim=1, keepdim=True)


def rloo_advantages(rewards_NG: Tensor) -> Tensor:
    """RLOO advantages: ``r_i - mean of the other G - 1 rewards in the group``.

    Ahmadian et al. 2024, "Back to Basics: Revisiting REINFORCE Style
    Optimization for Learning from Human Feedback in LLMs" (the
    leave-one-out baseline of Kool et al. 2019). Equal to
    ``G / (G - 1) * (r_i - mean_g)``.

    Args:
        rewards_NG: ``[N, G]`` rewards with G >= 2 (else ``ValueError``).

    Returns:
        ``[N, G]`` advantages, floating dtype of the rewards.
    """
    rewards_NG = _check_grouped(rewards_NG, min_group_size=2)
    group_size = rewards_NG.shape[1]
    others_mean_NG = (rewards_NG.sum(dim=1, keepdim=True) - rewards_NG) / (group_size - 1)
    return rewards_NG - others_mean_NG


def group_has_signal(rewards_NG: Tensor, *, atol: float = 1e-8, skipped_NG: Tensor | None = None) -> Tensor:
    """Which groups carry a learning signal: rewards not all equal.

    A group whose rewards span no more than ``atol`` (max - min) gets zero
    advantage from every estimator here, so training on it only adds
    padding to the batch (the "dynamic sampling" filter of DAPO, Yu et al.
    2025, sec. 3.2).

    Args:
        rewards_NG: ``[N, G]`` rewards.
        atol: largest spread still counted as "all equal".
        skipped_NG: ``[N, G]`` bool, entries no reward scored (left out of the spread); None = none.

    Returns:
        ``[N]`` bool, True where the group's scored rewards differ.
    """
    rewards_NG = _check_grouped(rewards_NG)
    if skipped_NG is None:
        return rewards_NG.amax(dim=1) - rewards_NG.amin(dim=1) > atol
    high_N = rewards_NG.masked_fill(skipped_NG, -math.inf).amax(dim=1)
    low_N = rewards_NG.masked_fill(skipped_NG, math.inf).amin(dim=1)
    return (high_N - low_N).nan_to_num(nan=0.0) > atol  # a group with nothing scored: inf - inf, no signal


AdvantageEstimator = Callable[[Tensor], Tensor]
"""Group rewards `[N, G]` -> advantages `[N, G]` (an `ADVANTAGE_ESTIMATORS` entry)."""


def masked_group_advantages(rewards_NG: Tensor, skipped_NG: Tensor, estimator: AdvantageEstimator) -> Tensor:
    """Advantages ``[N, G]`` by ``estimator`` (an ``ADVANTAGE_ESTIMATORS`` entry) over each group's scored
    completions only: complete groups in one call, a group with skipped entries on its ``k`` scored
    rewards alone (``[1, k]``; zeros when ``k < 2``, nothing to compare), skipped entries 0.

    Args:
        rewards_NG: ``[N, G]`` float rewards (any value where skipped).
        skipped_NG: ``[N, G]`` bool, True where no reward function scored the completion.
        estimator: ``[n, g] -> [n, g]`` advantages.
    """
    advantages_NG = estimator(rewards_NG.masked_fill(skipped_NG, 0.0))  # [N, G]; partial groups redone below
    for g in torch.nonzero(skipped_NG.any(dim=1)).flatten().tolist():
        keep_G = ~skipped_NG[g]  # [G] bool
        row_G = torch.zeros_like(rewards_NG[g])  # [G]
        if int(keep_G.sum()) >= 2:
            row_G[keep_G] = estimator(rewards_NG[g, keep_G].view(1, -1)).view(-1)  # [1, k] -> [k]
        advantages_NG[g] = row_G
    return advantages_NG


def critic_advantages(rewards_NG: Tensor) -> Tensor:
    """Zeros ``[N, G]``: under ``advantage: gae`` no advantage comes from the group; the trainer computes
    per-token advantages from the critic's values (``lora_rl_core.trainer.critic``)."""
    return torch.zeros_like(_check_grouped(rewards_NG))


ADVANTAGE_ESTIMATORS: dict[str, AdvantageEstimator] = {
    "grpo": grpo_advantages,
    "drgrpo": drgrpo_advantages,
    "rloo": rloo_advantages,
    "gae": critic_advantages,
}
"""Estimator name (the config's ``advantage`` choice) -> function ``[N, G] -> [N, G]``."""
