"""PPO's per-token advantages from a learned critic: token rewards, GAE, whitening, the clipped value loss and
the critic's explained variance (``algorithm.advantage: gae``).

Every ``[B, T]`` tensor is over completion tokens: B completions, T the padded completion length. Completions
are right-padded: the real tokens of a row are its positions ``0..L-1``, then padding. ``mask_BT`` (float or
bool) is 1 on real tokens and 0 on padding. ``values_BT`` are the critic's estimates of the return from the
state before each token, in reward units; rewards are the task's score units.

Sources: Schulman et al. 2016, "High-Dimensional Continuous Control Using Generalized Advantage Estimation"
(arXiv 1506.02438), eq. 16; verl ``verl/trainer/ppo/core_algos.py`` (``compute_gae_advantage_return``,
``compute_value_loss``), ``verl/trainer/ppo/ray_trainer.py`` (``apply_kl_penalty``, ``compute_data_metrics``)
and ``verl/utils/torch_functional.py`` (``masked_whiten``, ``masked_var``); OpenRLHF ``openrlhf/models/utils.py``
(``compute_reward``) and ``openrlhf/models/loss.py`` (``ValueLoss``); Stable-Baselines3
``stable_baselines3/common/utils.py`` (``explained_variance``).

Choices made here:

* No bootstrap: after a row's last real token the value and the advantage are 0. A completion that ended
  (end-of-sequence, stop sequence) is terminal; one cut at the token limit is treated the same, as verl,
  OpenRLHF and SkyRL do (``algorithm.truncation`` decides whether a cut completion is trained on at all).
* Padding never leaks: inputs are replaced by 0 on padding with ``torch.where`` (not multiplied by the mask),
  so inf / NaN there reach neither the results nor the gradient, and GAE's recursion skips padding (verl's
  masked form), so a padded row gives the numbers of the same row alone.
* The GAE recursion, the whitening and the losses run in float32 whatever the input dtype; the explained
  variance in float64 (a metric, and a difference of variances).
* Whitening is over every real token of the batch (one mean, one variance), as verl, OpenRLHF and SkyRL whiten
  GAE's advantages; the trainer passes the whole batch.
* Gradients flow only through ``values_BT`` of ``value_loss``; every other function runs under
  ``torch.no_grad``.
* ``gamma``, ``lam``, ``kl_coef`` and ``value_clip`` are range-checked per call (``ValueError``), unlike the
  policy loss's coefficients: the checks are a few Python comparisons per step.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lora_rl_core.algorithm.losses import _check_same_shape as _check_shapes  # one shape rule for [B, T]
from lora_rl_core.algorithm.losses import aggregate

_EXPLAINED_VARIANCE_RTOL = 1e-12
"""Returns whose variance is at most this share of their mean square are constant: nothing to explain."""
_EXPLAINED_VARIANCE_ATOL = 1e-8
"""Returns whose variance is at most 1e-8 (a spread of 1e-4 reward units) do not vary: a batch of zero rewards
gives returns of `A + V` that differ only by rounding (about 1e-18), and a ratio over that was -2.7e15 in a
GPU run (benchmarks/results/ppo-vs-grpo)."""


def _real_float32(tensor_BT: Tensor, real_BT: Tensor) -> Tensor:
    """``tensor_BT`` as float32 on the mask's device, 0 on padding (``torch.where``: inf / NaN there vanish)."""
    return torch.where(real_BT, tensor_BT.to(device=real_BT.device, dtype=torch.float32), 0.0)


def token_rewards(scores_B: Tensor, mask_BT: Tensor, kl_BT: Tensor | None = None, kl_coef: float = 0.0) -> Tensor:
    """Per-token rewards of a batch of completions: each one's task score at its last real token, minus the
    KL penalty on every real token.

    ``r_t = score * [t == L - 1] - kl_coef * kl_t`` on real tokens, 0 on padding: verl ``apply_kl_penalty``
    (``algorithm.use_kl_in_reward``: ``token_level_rewards = token_level_scores - beta * kld``) and OpenRLHF
    ``compute_reward`` (the score at the last real token, ``-kl_coef * kl`` on every token). The last real token
    is the row's last position with a nonzero mask, position ``L - 1`` of a right-padded row.

    Args:
        scores_B: ``[B]`` the task's reward of each completion (any real dtype, any device).
        mask_BT: ``[B, T]`` 1 on real completion tokens, 0 on padding (float or bool).
        kl_BT: ``[B, T]`` per-token estimate of KL(policy || reference), nats, e.g. the k1 estimate
            ``log pi_old - log pi_ref`` as verl's ``kl_penalty: kl``; None: no penalty. Ignored on padding.
        kl_coef: beta, the penalty's weight per nat (``algorithm.kl_coef``), >= 0.

    Returns:
        ``[B, T]`` float32 rewards on the mask's device, 0 on padding; a row with no real token gets none,
        so it is all 0.

    Raises:
        ValueError: ``scores_B`` is not ``[B]``, ``mask_BT`` not 2-D, ``kl_BT`` not the mask's shape, or
            ``kl_coef < 0``.
    """
    _check_shapes(mask_BT)
    if scores_B.shape != mask_BT.shape[:1]:
        raise ValueError(
            f"scores_B has shape {tuple(scores_B.shape)}, expected {tuple(mask_BT.shape[:1])} (one per row, [B])"
        )
    if kl_BT is not None:
        _check_shapes(mask_BT, kl_BT=kl_BT)
    if not kl_coef >= 0:  # NaN too
        raise ValueError(f"kl_coef must be >= 0, got {kl_coef}")
    with torch.no_grad():
        real_BT = mask_BT > 0
        batch, length = real_BT.shape
        if length == 0:
            return torch.zeros(batch, 0, dtype=torch.float32, device=mask_BT.device)
        positions_T = torch.arange(length, device=real_BT.device)
        last_B = torch.where(real_BT, positions_T, -1).amax(dim=1)  # -1: no real token, matches no position
        scores_B1 = scores_B.to(device=real_BT.device, dtype=torch.float32).unsqueeze(-1)
        rewards_BT = torch.where(positions_T == last_B.unsqueeze(-1), scores_B1, 0.0)
        if kl_BT is not None and kl_coef > 0:
            rewards_BT = rewards_BT - kl_coef * _real_float32(kl_BT, real_BT)
        return rewards_BT


def gae_advantages(
    rewards_BT: Tensor, values_BT: Tensor, mask_BT: Tensor, *, gamma: float, lam: float
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation over each completion's tokens, and the critic's return targets.

    Schulman et al. 2016, eq. 16, per token: ``delta_t = r_t + gamma * V_{t+1} - V_t`` and
    ``A_t = delta_t + gamma * lam * A_{t+1}``; ``returns_t = A_t + V_t`` (the lambda-return, the value loss's
    target). After a row's last real token ``V`` and ``A`` are 0: no bootstrap, the completion ended, or was cut
    at the token limit and is treated as ended. Padding is skipped by verl's masked recursion
    (``compute_gae_advantage_return``)::

        nextvalues = V_t * m_t + (1 - m_t) * nextvalues
        lastgaelam = A_t * m_t + (1 - m_t) * lastgaelam

    a loop over T in reverse, vectorised over B, in float32. No gradient: it runs under ``torch.no_grad``, so
    ``values_BT`` may still require grad.

    gamma = lam = 1 with a reward only at the end gives ``A_t = score - V_t`` and ``returns_t = score``;
    lam = 0 gives the one-step TD errors ``delta_t``.

    Args:
        rewards_BT: ``[B, T]`` per-token rewards (``token_rewards``), score units.
        values_BT: ``[B, T]`` the critic's values of the state before each token, score units.
        mask_BT: ``[B, T]`` 1 on real completion tokens, 0 on padding (float or bool).
        gamma: the discount per token, in [0, 1] (``algorithm.gamma``).
        lam: GAE's lambda, in [0, 1] (``algorithm.lam``).

    Returns:
        ``(advantages_BT, returns_BT)``: ``[B, T]`` float32 on the mask's device, detached, 0 on padding. The
        advantages are not whitened (``masked_whiten``).

    Raises:
        ValueError: mismatched shapes, or ``gamma`` / ``lam`` outside [0, 1].
    """
    _check_shapes(mask_BT, rewards_BT=rewards_BT, values_BT=values_BT)
    for name, value in (("gamma", gamma), ("lam", lam)):
        if not 0.0 <= value <= 1.0:  # NaN too
            raise ValueError(f"{name} must be in [0, 1], got {value}")
    with torch.no_grad():
        real_BT = mask_BT > 0
        m_BT = real_BT.float()
        rewards_BT = _real_float32(rewards_BT, real_BT)
        values_BT = _real_float32(values_BT, real_BT)
        batch, length = m_BT.shape
        next_value_B = torch.zeros(batch, dtype=torch.float32, device=m_BT.device)
        last_gae_B = torch.zeros_like(next_value_B)
        advantages_BT = torch.zeros_like(m_BT)
        for t in reversed(range(length)):
            m_B = m_BT[:, t]
            delta_B = rewards_BT[:, t] + gamma * next_value_B - values_BT[:, t]
            gae_B = delta_B + gamma * lam * last_gae_B
            # a padded position carries the next real token's value and advantage over itself (verl's masked form)
            next_value_B = values_BT[:, t] * m_B + (1.0 - m_B) * next_value_B
            last_gae_B = gae_B * m_B + (1.0 - m_B) * last_gae_B
            advantages_BT[:, t] = gae_B * m_B
        returns_BT = torch.where(real_BT, advantages_BT + values_BT, 0.0)
        return advantages_BT, returns_BT


def masked_whiten(
    values_BT: Tensor,
    mask_BT: Tensor,
    *,
    shift_mean: bool = True,
    eps: float = 1e-8,
    scale_mask_BT: Tensor | None = None,
) -> Tensor:
    """Whiten over the real tokens of the whole batch: ``(x - mean) * rsqrt(var + eps)``.

    verl ``masked_whiten`` (``verl/utils/torch_functional.py``): one mean and one variance over every real token,
    the variance unbiased (``masked_var``, Bessel's correction ``n / (n - 1)``); ``shift_mean=False`` adds the
    mean back (a new spread, the old location). With fewer than 2 real tokens there is no variance: the result
    is the input centred, not scaled (so 0 on a single real token; ``x`` itself with ``shift_mean=False``),
    never NaN (verl raises instead); so is a batch with no variance at all when ``eps`` is 0.

    ``scale_mask_BT`` splits the two statistics: the mean is still every real token's, the variance is the
    spread of the ``scale_mask_BT`` tokens about that mean, ``sum (x - mean)^2 / (n_s - 1)``, so those tokens
    come out with unit mean square (their own mean need not be 0). The critic uses it to whiten every row
    it trains on about one mean while scaling by the rows the policy's loss covers (``Critic.targets``
    says why); with ``scale_mask_BT`` equal to ``mask_BT`` this is verl's whitening exactly.

    Args:
        values_BT: ``[B, T]`` values to whiten (e.g. GAE's advantages), any floating dtype; ignored on padding.
        mask_BT: ``[B, T]`` 1 on real tokens, 0 on padding (float or bool).
        shift_mean: False: add the mean back after scaling.
        eps: added to the variance under the square root, >= 0.
        scale_mask_BT: ``[B, T]`` 1 on the tokens whose spread sets the scale (real tokens only count), or None:
            every real token. Fewer than 2 such tokens: centred, not scaled.

    Returns:
        ``[B, T]`` float32 on the mask's device, detached, 0 on padding; over the real tokens its mean is 0
        (``shift_mean``) and its unbiased variance ``var / (var + eps)``, 1 up to ``eps`` (with
        ``scale_mask_BT``: ``sum (x - mean)^2 / (n_s - 1)`` over its tokens is that, about the real tokens' mean).

    Raises:
        ValueError: mismatched shapes, or ``eps < 0``.
    """
    _check_shapes(mask_BT, values_BT=values_BT)
    if scale_mask_BT is not None:
        _check_shapes(mask_BT, scale_mask_BT=scale_mask_BT)
    if not eps >= 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    with torch.no_grad():
        real_BT = mask_BT > 0
        x_BT = _real_float32(values_BT, real_BT)
        mean = x_BT.sum() / real_BT.sum().float().clamp(min=1.0)
        centred_BT = torch.where(real_BT, x_BT - mean, 0.0)
        spread_BT = real_BT if scale_mask_BT is None else real_BT & (scale_mask_BT.to(real_BT.device) > 0)
        n = spread_BT.sum().float()
        var = torch.where(spread_BT, centred_BT, 0.0).pow(2).sum() / (n - 1.0).clamp(min=1.0)
        # no device sync; fewer than 2 tokens (or eps = 0 on a constant batch): centred only
        scale = torch.where((n >= 2) & (var + eps > 0), torch.rsqrt(var + eps), 1.0)
        whitened_BT = centred_BT * scale
        if not shift_mean:
            whitened_BT = whitened_BT + mean
        return torch.where(real_BT, whitened_BT, 0.0)


def value_loss(
    values_BT: Tensor,
    old_values_BT: Tensor,
    returns_BT: Tensor,
    mask_BT: Tensor,
    *,
    value_clip: float | None,
    aggregation: str,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO's clipped value loss per token, reduced over real tokens.

    verl ``compute_value_loss``, OpenRLHF ``ValueLoss`` (PPO's value clipping, the OpenAI baselines
    ``ppo2`` form)::

        v_clipped = old_values + clamp(values - old_values, -value_clip, value_clip)
        loss_t    = 0.5 * max((values - returns)^2, (v_clipped - returns)^2)
        loss      = aggregate(loss_t, mask, aggregation)

    and ``loss_t = 0.5 * (values - returns)^2`` when ``value_clip`` is None. The max keeps the larger error, so
    a value moved more than ``value_clip`` from ``old_values`` towards the return gets no gradient.

    Args:
        values_BT: ``[B, T]`` the critic's values now, score units; the only input with gradient.
        old_values_BT: ``[B, T]`` its values before this step's update (detached here).
        returns_BT: ``[B, T]`` the targets, GAE's returns (detached here).
        mask_BT: ``[B, T]`` 1 on real completion tokens, 0 on padding (float or bool).
        value_clip: the largest move of a value from ``old_values`` (score units), > 0 (``critic.value_clip``);
            None: unclipped.
        aggregation: a mode of ``losses.aggregate`` (``LOSS_AGGREGATIONS``; the policy loss's
            ``algorithm.loss_aggregation``).

    Returns:
        ``(loss, metrics)``: the scalar float32 loss, differentiable in ``values_BT`` (no gradient reaches its
        padding), and detached 0-dim float32 tensors on the inputs' device (no device sync): ``value_loss`` (the
        loss), ``value_clip_fraction`` (share of real tokens where the clipped error is strictly larger, so the
        clip is active; 0 unclipped), ``value_mean`` (mean of ``values_BT`` over real tokens).

    Raises:
        ValueError: mismatched shapes, ``value_clip <= 0``, or an unknown aggregation.
    """
    _check_shapes(mask_BT, values_BT=values_BT, old_values_BT=old_values_BT, returns_BT=returns_BT)
    if value_clip is not None and not value_clip > 0:  # NaN too
        raise ValueError(f"value_clip must be > 0 (or None: unclipped), got {value_clip}")
    real_BT = mask_BT > 0
    values = torch.where(real_BT, values_BT.float(), 0.0)  # padding: 0, so its gradient is 0 (not 0 * NaN)
    old = _real_float32(old_values_BT.detach(), real_BT)
    returns = _real_float32(returns_BT.detach(), real_BT)
    error_BT = (values - returns) ** 2
    if value_clip is None:
        loss_BT = 0.5 * error_BT
        clipped_BT = torch.zeros_like(real_BT)
    else:
        clipped_error_BT = (old + (values - old).clamp(-value_clip, value_clip) - returns) ** 2
        loss_BT = 0.5 * torch.maximum(error_BT, clipped_error_BT)
        clipped_BT = clipped_error_BT.detach() > error_BT.detach()
    loss = aggregate(loss_BT, real_BT, aggregation)
    with torch.no_grad():
        metrics = {
            "value_loss": loss.detach(),
            "value_clip_fraction": aggregate(clipped_BT.float(), real_BT, "token-mean"),
            "value_mean": aggregate(values.detach(), real_BT, "token-mean"),
        }
    return loss, {k: v.detach().float() for k, v in metrics.items()}


def explained_variance(values_BT: Tensor, returns_BT: Tensor, mask_BT: Tensor) -> Tensor:
    """How much of the returns' variance the critic's values explain: ``1 - Var[R - V] / Var[R]`` over the real
    tokens.

    verl ``compute_data_metrics`` (``critic/vf_explained_var``), Stable-Baselines3 ``explained_variance``. 1: the
    values predict the returns; 0: no better than a constant; < 0: worse than the returns' mean. Both variances
    divide by the same count, so Bessel's correction cancels. Where the returns do not vary (their variance at
    most 1e-12 of their mean square plus 1e-8, all equal up to rounding, or no real token) there is nothing to explain
    and the result is 0.0, not NaN (SB3) nor a ratio over ``Var[R] + 1e-5`` (verl). Computed in float64 under
    ``torch.no_grad``, with no device sync.

    Args:
        values_BT: ``[B, T]`` the critic's values, score units.
        returns_BT: ``[B, T]`` their targets (GAE's returns).
        mask_BT: ``[B, T]`` 1 on real completion tokens, 0 on padding (float or bool).

    Returns:
        0-dim float32 on the mask's device, at most 1.

    Raises:
        ValueError: mismatched shapes.
    """
    _check_shapes(mask_BT, values_BT=values_BT, returns_BT=returns_BT)
    with torch.no_grad():
        real_BT = mask_BT > 0
        n = real_BT.sum().double().clamp(min=1.0)
        returns = torch.where(real_BT, returns_BT.to(device=real_BT.device, dtype=torch.float64), 0.0)
        residual = torch.where(real_BT, returns - values_BT.to(device=real_BT.device, dtype=torch.float64), 0.0)

        def variance(x_BT: Tensor) -> Tensor:
            return (torch.where(real_BT, x_BT - x_BT.sum() / n, 0.0) ** 2).sum() / n

        var_returns = variance(returns)
        varies = var_returns > _EXPLAINED_VARIANCE_RTOL * (returns**2).sum() / n + _EXPLAINED_VARIANCE_ATOL
        ratio = variance(residual) / torch.where(varies, var_returns, 1.0)
        return torch.where(varies, 1.0 - ratio, 0.0).float()
