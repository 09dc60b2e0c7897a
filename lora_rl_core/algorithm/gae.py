"""PPO's per-token advantages from a learned critic: token rewards, GAE, batch whitening, the clipped value loss
and the critic's explained variance (`algorithm.advantage: gae`).

Every tensor is `[B, T]`: B completions, T tokens, right-padded; `mask_BT` is 1 on a row's real completion
tokens (positions 0..L-1 of the row) and 0 on its padding. Pure functions: the trainer
(`lora_rl_core.trainer.critic`) passes tensors in and gets tensors back.

Sources: Schulman et al. 2016, "High-Dimensional Continuous Control Using Generalized Advantage Estimation"
(arXiv 1506.02438), eq. 16; verl `verl/trainer/ppo/core_algos.py` (`compute_gae_advantage_return`,
`compute_value_loss`, `apply_kl_penalty` in `ray_trainer.py`) and `verl/utils/torch_functional.py`
(`masked_whiten`); OpenRLHF `openrlhf/models/loss.py` (`ValueLoss`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from lora_rl_core.algorithm.losses import aggregate


def _check_shapes(mask_BT: Tensor, **tensors_BT: Tensor) -> None:
    for name, tensor in tensors_BT.items():
        if tensor.shape != mask_BT.shape:
            raise ValueError(f"{name} has shape {tuple(tensor.shape)}, expected {tuple(mask_BT.shape)} like mask_BT")


def token_rewards(scores_B: Tensor, mask_BT: Tensor, kl_BT: Tensor | None = None, kl_coef: float = 0.0) -> Tensor:
    """Per-token rewards: each completion's task score at its last real token, minus `kl_coef * kl_BT` on every
    real token (verl `apply_kl_penalty`, `use_kl_in_reward`: `token_level_rewards = scores - beta * kld`).

    Args:
        scores_B: `[B]` the task's reward of each completion.
        mask_BT: `[B, T]` 1 on real tokens (each row's first `L` positions).
        kl_BT: `[B, T]` per-token KL estimate to the reference (e.g. `log pi - log pi_ref`), or None.
        kl_coef: its weight, >= 0.

    Returns:
        `[B, T]` float32 rewards, 0 on padding; a row without real tokens gets none.

    Raises:
        ValueError: mismatched shapes, or `kl_coef < 0`.
    """
    if scores_B.shape != mask_BT.shape[:1]:
        raise ValueError(f"scores_B has shape {tuple(scores_B.shape)}, expected {tuple(mask_BT.shape[:1])}")
    if kl_coef < 0:
        raise ValueError(f"kl_coef must be >= 0, got {kl_coef}")
    mask = mask_BT.float()
    lengths_B = mask.sum(dim=1).long()
    rewards_BT = torch.zeros_like(mask)
    rows = torch.nonzero(lengths_B > 0).squeeze(-1)
    rewards_BT[rows, lengths_B[rows] - 1] = scores_B.float().to(mask.device)[rows]
    if kl_BT is not None:
        _check_shapes(mask_BT, kl_BT=kl_BT)
        rewards_BT = rewards_BT - kl_coef * kl_BT.float() * mask
    return rewards_BT


@torch.no_grad()
def gae_advantages(
    rewards_BT: Tensor, values_BT: Tensor, mask_BT: Tensor, *, gamma: float, lam: float
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016, eq. 16) over each completion's tokens:
    `delta_t = r_t + gamma * V_{t+1} - V_t`, `A_t = delta_t + gamma * lam * A_{t+1}`, `returns = A + V`.

    After a row's last real token V and A are 0: no bootstrap. A completion that ended is terminal, and one cut
    at the token limit is treated the same (`algorithm.truncation` decides whether it is trained on at all).
    Padding is skipped by verl's masked recursion, so it never leaks into a real token. No gradient.

    Args:
        rewards_BT: `[B, T]` per-token rewards (`token_rewards`).
        values_BT: `[B, T]` the critic's values, the state before each token.
        mask_BT: `[B, T]` 1 on real tokens.
        gamma / lam: in [0, 1] (`algorithm.gamma`, `algorithm.lam`).

    Returns:
        `(advantages_BT, returns_BT)`, float32, 0 on padding.

    Raises:
        ValueError: mismatched shapes, or gamma / lam outside [0, 1].
    """
    _check_shapes(mask_BT, rewards_BT=rewards_BT, values_BT=values_BT)
    for name, value in (("gamma", gamma), ("lam", lam)):
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"{name} must be in [0, 1], got {value}")
    mask = mask_BT.float()
    rewards, values = rewards_BT.float() * mask, values_BT.detach().float() * mask
    batch, length = mask.shape
    next_value = torch.zeros(batch, dtype=torch.float32, device=mask.device)
    last_gae = torch.zeros_like(next_value)
    advantages = torch.zeros_like(mask)
    for t in reversed(range(length)):
        m = mask[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        gae = delta + gamma * lam * last_gae
        next_value = values[:, t] * m + (1 - m) * next_value  # padding carries the later real token's value
        last_gae = gae * m + (1 - m) * last_gae
        advantages[:, t] = gae * m
    return advantages, (advantages + values) * mask


def masked_whiten(values_BT: Tensor, mask_BT: Tensor, *, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    """`(x - mean) / sqrt(var + eps)` over the real tokens (verl `masked_whiten`: the unbiased variance, Bessel's
    correction), 0 on padding; `shift_mean=False` adds the mean back. Fewer than 2 real tokens: the input
    centred (no variance to divide by), never NaN.

    Args:
        values_BT / mask_BT: `[B, T]`; the mask is 1 on real tokens.

    Returns:
        `[B, T]` float32.

    Raises:
        ValueError: mismatched shapes.
    """
    _check_shapes(mask_BT, values_BT=values_BT)
    mask = mask_BT.float()
    x = values_BT.float()
    n = mask.sum()
    mean = (x * mask).sum() / n.clamp(min=1)
    if n < 2:
        out = x - mean if shift_mean else x
        return out * mask
    var = (((x - mean) ** 2) * mask).sum() / (n - 1)
    out = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return out * mask


def value_loss(
    values_BT: Tensor,
    old_values_BT: Tensor,
    returns_BT: Tensor,
    mask_BT: Tensor,
    *,
    value_clip: float | None,
    aggregation: str,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO's clipped value loss (verl `compute_value_loss`, OpenRLHF `ValueLoss`):
    `v_clip = old + clamp(v - old, -value_clip, value_clip)`, per token
    `0.5 * max((v - R)^2, (v_clip - R)^2)`; without a clip `0.5 * (v - R)^2`.

    Args:
        values_BT: `[B, T]` the critic's values now; the only input with gradient.
        old_values_BT: `[B, T]` its values before this step's update. returns_BT: `[B, T]` GAE's returns.
        mask_BT: `[B, T]` 1 on real tokens.
        value_clip: > 0 (`critic.value_clip`), or None.
        aggregation: a mode of `losses.aggregate` (the policy loss's `algorithm.loss_aggregation`).

    Returns:
        `(loss, metrics)`: the scalar float32 loss, and detached 0-dim tensors: `value_loss`,
        `value_clip_fraction` (real tokens where the clipped error is the larger, so the clip acts; 0 unclipped),
        `value_mean` (mean of `values_BT` over real tokens).

    Raises:
        ValueError: mismatched shapes, or `value_clip <= 0`.
    """
    _check_shapes(mask_BT, values_BT=values_BT, old_values_BT=old_values_BT, returns_BT=returns_BT)
    if value_clip is not None and value_clip <= 0:
        raise ValueError(f"value_clip must be > 0 (or None), got {value_clip}")
    mask = mask_BT.float()
    values, old, returns = values_BT.float(), old_values_BT.detach().float(), returns_BT.detach().float()
    unclipped_BT = (values - returns) ** 2
    if value_clip is None:
        loss_BT, clipped_BT = 0.5 * unclipped_BT, torch.zeros_like(mask, dtype=torch.bool)
    else:
        clipped = old + (values - old).clamp(-value_clip, value_clip)
        clipped_error_BT = (clipped - returns) ** 2
        loss_BT = 0.5 * torch.maximum(unclipped_BT, clipped_error_BT)
        clipped_BT = clipped_error_BT > unclipped_BT
    loss = aggregate(loss_BT, mask, aggregation)
    with torch.no_grad():
        metrics = {
            "value_loss": loss.detach(),
            "value_clip_fraction": aggregate(clipped_BT.float(), mask, "token-mean"),
            "value_mean": aggregate(values.detach(), mask, "token-mean"),
        }
    return loss, metrics


@torch.no_grad()
def explained_variance(values_BT: Tensor, returns_BT: Tensor, mask_BT: Tensor) -> Tensor:
    """`1 - Var[R - V] / Var[R]` over the real tokens (verl `compute_data_metrics` `critic/vf_explained_var`,
    Stable-Baselines3 `explained_variance`): 1 = the values predict the returns, 0 = no better than their
    mean, < 0 worse. 0.0 where the returns do not vary (nothing to explain; never NaN).

    Returns:
        0-dim float32.

    Raises:
        ValueError: mismatched shapes.
    """
    _check_shapes(mask_BT, values_BT=values_BT, returns_BT=returns_BT)
    mask = mask_BT.float()
    n = mask.sum().clamp(min=1)

    def var(x: Tensor) -> Tensor:
        mean = (x * mask).sum() / n
        return (((x - mean) ** 2) * mask).sum() / n

    returns = returns_BT.float()
    var_returns = var(returns)
    if float(var_returns) <= 1e-12:
        return var_returns.new_zeros(())
    return 1.0 - var(returns - values_BT.float()) / var_returns
