"""Token-level policy losses: PPO-clip, k3 KL, aggregation (log-probs from logits: ``algorithm.logprobs``).

Every ``[B, T]`` tensor is over completion tokens: B completions, T the
padded completion length. ``mask_BT`` is 1.0 on real completion tokens and
0.0 on padding; log-probs are float32 nats.

Choices made here:

* Padding never leaks: values on padding are replaced by 0 with
  ``torch.where`` (not multiplied by the mask), and the log-ratio is zeroed
  there before ``exp``, so inf / NaN in padded positions reach neither the
  loss nor the gradient.
* "Sequences" in the ``seq-mean-*`` aggregations are rows with at least one
  real token; all-padding rows are padding.
* The k3 log-ratio is clamped to [-20, 20] so ``exp`` cannot overflow.
* Gradients flow only through ``logprobs_BT``: old / reference log-probs,
  advantages and importance weights are detached.
* A new aggregation is a new function plus a registry entry, not a branch.
* The clip ranges have no defaults here, and no coefficient is range-checked
  per call: ``AlgorithmConfig`` is their one source, and the trainer passes
  its validated values.

M2PO's mask (``m2po_keep_mask``) is a statistic of the whole batch: the trainer gathers the log ratios of
every micro-batch and rank before the update and passes the mask in as importance weights.

Left out: value-function loss, entropy bonus, dual-clip PPO (Ye et al.
2020), sequence-level ratios (GSPO), the gradient-bias question of the
k3 estimator used as a loss term (Tang & Munos 2025), and Dr. GRPO's
constant-length normaliser ``sum / (num_sequences * max_new_tokens)``
(``seq-mean-token-sum`` over a constant the learning rate absorbs).
Aggregation is per call: token-mean over micro-batches is not the
token-mean of the whole batch unless the caller rescales.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

LOSS_AGGREGATIONS: tuple[str, ...] = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")
"""The modes of ``aggregate`` (``algorithm.loss_aggregation``)."""

_KL_LOG_RATIO_CLAMP = 20.0


def _check_same_shape(mask_BT: Tensor, **tensors_BT: Tensor) -> None:
    """Raise ``ValueError`` unless ``mask_BT`` is 2-D and every tensor has its shape."""
    if mask_BT.dim() != 2:
        raise ValueError(f"mask_BT must be 2-D [B, T], got shape {tuple(mask_BT.shape)}")
    for name, tensor in tensors_BT.items():
        if tensor.shape != mask_BT.shape:
            raise ValueError(
                f"{name} has shape {tuple(tensor.shape)}, expected {tuple(mask_BT.shape)} "
                "(the shape of mask_BT, [B, T])"
            )


def _mean_over_sequences(per_seq_B: Tensor, mask_BT: Tensor) -> Tensor:
    """Mean of ``per_seq_B`` over rows with at least one real token (0 if none)."""
    has_tokens_B = (mask_BT.sum(dim=-1) > 0).to(per_seq_B.dtype)
    return (per_seq_B * has_tokens_B).sum() / has_tokens_B.sum().clamp(min=1.0)


def _token_mean(values_BT: Tensor, mask_BT: Tensor) -> Tensor:
    """DAPO (Yu et al. 2025, sec. 3.3): every token in the batch weighs the same."""
    return values_BT.sum() / mask_BT.sum().clamp(min=1.0)


def _seq_mean_token_sum(values_BT: Tensor, mask_BT: Tensor) -> Tensor:
    """Dr. GRPO (Liu et al. 2025): sum over tokens, mean over sequences; no length normalisation."""
    return _mean_over_sequences(values_BT.sum(dim=-1), mask_BT)


def _seq_mean_token_mean(values_BT: Tensor, mask_BT: Tensor) -> Tensor:
    """Original GRPO (Shao et al. 2024, eq. 3): per-sequence token mean, then mean over sequences."""
    per_seq_B = values_BT.sum(dim=-1) / mask_BT.sum(dim=-1).clamp(min=1.0)
    return _mean_over_sequences(per_seq_B, mask_BT)


_AGGREGATORS: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "token-mean": _token_mean,
    "seq-mean-token-sum": _seq_mean_token_sum,
    "seq-mean-token-mean": _seq_mean_token_mean,
}


def aggregate(values_BT: Tensor, mask_BT: Tensor, mode: str) -> Tensor:
    """Reduce per-token values over real tokens to a scalar.

    Modes (a "sequence" is a row with at least one real token):

    * ``"token-mean"``: ``sum(v * m) / sum(m)`` over the batch (DAPO, Yu et al. 2025, sec. 3.3).
    * ``"seq-mean-token-sum"``: mean over sequences of the token sum (Dr. GRPO, Liu et al. 2025).
    * ``"seq-mean-token-mean"``: mean over sequences of the token mean (GRPO, Shao et al. 2024, eq. 3).

    Args:
        values_BT: ``[B, T]`` per-token values; whatever sits on padding is ignored.
        mask_BT: ``[B, T]`` 1.0 on real tokens, 0.0 on padding (bool or int also work).
        mode: one of the modes above (``LOSS_AGGREGATIONS``).

    Returns:
        Scalar tensor in the dtype of ``values_BT``; 0 when the mask is empty.
    """
    aggregator = _AGGREGATORS.get(mode)
    if aggregator is None:
        raise ValueError(f"unknown loss aggregation {mode!r}; valid modes: {', '.join(_AGGREGATORS)}")
    _check_same_shape(mask_BT, values_BT=values_BT)
    mask_BT = mask_BT.to(values_BT.dtype)
    masked_values_BT = torch.where(mask_BT > 0, values_BT, 0.0)
    return aggregator(masked_values_BT, mask_BT)


def kl_k3(logprobs_BT: Tensor, ref_logprobs_BT: Tensor) -> Tensor:
    """Per-token k3 estimate of KL(policy || reference).

    Schulman 2020, "Approximating KL Divergence": with ``r = p_ref / p`` and
    tokens sampled from the policy, ``k3 = (r - 1) - log r``, unbiased and
    ``>= 0``. Here ``log r = ref_logprobs - logprobs``, clamped to [-20, 20]
    so ``exp`` stays finite.

    Args:
        logprobs_BT: ``[B, T]`` policy log-probs of the sampled tokens.
        ref_logprobs_BT: ``[B, T]`` reference-model log-probs of the same tokens.

    Returns:
        ``[B, T]`` float32 per-token estimates (nats), differentiable in both inputs.
    """
    _check_same_shape(logprobs_BT, ref_logprobs_BT=ref_logprobs_BT)
    log_ratio_BT = (ref_logprobs_BT.float() - logprobs_BT.float()).clamp(-_KL_LOG_RATIO_CLAMP, _KL_LOG_RATIO_CLAMP)
    return torch.exp(log_ratio_BT) - log_ratio_BT - 1.0


OFF_POLICY_MODES: tuple[str, ...] = (
    "token-truncate",
    "token-mask",
    "sequence-truncate",
    "sequence-mask",
    "geometric-mask",
)
"""Modes of ``off_policy_weights`` (``algorithm.off_policy_correction`` adds ``none`` and ``auto``)."""


def off_policy_weights(
    old_logprobs_BT: Tensor,
    inference_logprobs_BT: Tensor,
    mask_BT: Tensor,
    *,
    mode: str,
    cap: float | None = None,
    floor: float | None = None,
    geo_low: float | None = None,
    geo_high: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Importance weights for completions sampled by another policy than the trainer's, and diagnostics.

    With ``log r_t = old_logprobs_t - inference_logprobs_t`` (trainer over sampler; the sampler is an older
    adapter version in asynchronous training, and the engine's numerics always):

    * ``token-truncate``: ``w_t = min(r_t, cap)``; TIS (Yao et al. 2025, "Your Efficient RL Framework Secretly
      Brings You Off-Policy RL Training"), TRL ``token_truncate``.
    * ``token-mask``: ``w_t = r_t``, 0 where ``r_t`` is outside ``[floor, cap]``; IcePop (Ling Team 2025,
      "Every Step Evolves"), TRL ``token_mask``.
    * ``sequence-truncate``: ``w = min(prod_t r_t, cap)`` for every token of the sequence; TRL
      ``sequence_truncate``.
    * ``sequence-mask``: ``w = prod_t r_t``, 0 for the whole sequence when outside ``[floor, cap]``; TRL
      ``sequence_mask`` (its default mode, cap 3).
    * ``geometric-mask``: ``w = 1``, 0 for the whole sequence when the geometric mean
      ``exp(mean_t log r_t)`` is outside ``[geo_low, geo_high]``: rejection without reweighting; SkyRL
      ``off_policy_correction.sequence_mask_metric: geometric`` (its fully-async examples: 0.99 / 1.01),
      verl's geometric rejection sampling (Liu, Li et al. 2025, "When Speed Kills Stability").

    Sequence products are taken in log space and clamped to [-20, 20] before ``exp``.

    Args:
        old_logprobs_BT: ``[B, T]`` trainer log-probs of the sampled tokens (the policy being updated, before
            the update), float32 nats.
        inference_logprobs_BT: ``[B, T]`` log-probs the engine reported when sampling them.
        mask_BT: ``[B, T]`` 1.0 on real completion tokens, 0.0 on padding.
        mode: one of ``OFF_POLICY_MODES``.
        cap / floor: the truncation (``cap``, the ``-truncate`` modes) or kept range (``floor`` and ``cap``, the
            ``token-mask`` / ``sequence-mask`` modes).
        geo_low / geo_high: the kept range of the geometric mean (``geometric-mask``).
        The bounds have no defaults and are not checked again here (once per micro-batch): the correction's
        config section (``algorithm.off_policy_correction``, its ``weight_args``) is the one source of both.

    Returns:
        ``(weights_BT, metrics)``: ``[B, T]`` float32 detached weights, 0 on padding; 0-dim float32 tensors on
        the inputs' device (no device sync: the caller reads them once per step) ``is_weight_mean`` /
        ``is_weight_max`` (over real tokens, after truncation and masking) and ``is_masked_fraction`` (real
        tokens whose weight a mask set to 0).

    Raises:
        ValueError: an unknown mode, a bound the mode needs not given, or mismatched shapes.
    """
    if mode not in OFF_POLICY_MODES:
        raise ValueError(f"unknown off-policy correction {mode!r}; valid: {', '.join(OFF_POLICY_MODES)}")
    # the bounds the mode reads, as (low, high): none below a truncation, the kept range of a mask
    low, high = (geo_low, geo_high) if mode == "geometric-mask" else (0.0 if mode.endswith("-truncate") else floor, cap)
    if low is None or high is None:
        needed = "geo_low and geo_high" if mode == "geometric-mask" else "cap" if low is not None else "cap and floor"
        raise ValueError(f"off-policy correction {mode} needs {needed}")
    _check_same_shape(mask_BT, old_logprobs_BT=old_logprobs_BT, inference_logprobs_BT=inference_logprobs_BT)
    with torch.no_grad():
        real_BT = mask_BT > 0
        log_r_BT = torch.where(real_BT, old_logprobs_BT.float() - inference_logprobs_BT.float(), 0.0)
        keep_BT = real_BT
        if mode.startswith("token-"):
            ratio_BT = torch.exp(log_r_BT)
        else:
            log_seq_B1 = log_r_BT.sum(dim=-1, keepdim=True)
            if mode == "geometric-mask":
                log_seq_B1 = log_seq_B1 / real_BT.sum(dim=-1, keepdim=True).clamp(min=1)
            ratio_BT = torch.exp(log_seq_B1.clamp(-_KL_LOG_RATIO_CLAMP, _KL_LOG_RATIO_CLAMP)).expand_as(log_r_BT)
        if mode.endswith("-truncate"):
            weights_BT = ratio_BT.clamp(max=high)
        else:
            keep_BT = real_BT & (ratio_BT >= low) & (ratio_BT <= high)
            weights_BT = torch.ones_like(ratio_BT) if mode == "geometric-mask" else ratio_BT
        weights_BT = torch.where(keep_BT, weights_BT, 0.0)
    return weights_BT, _weight_stats(weights_BT, real_BT, keep_BT)


def _weight_stats(weights_BT: Tensor, real_BT: Tensor, keep_BT: Tensor) -> dict[str, Tensor]:
    """``is_weight_mean`` / ``is_weight_max`` over real tokens and ``is_masked_fraction`` (real tokens set to 0),
    0-dim tensors on the weights' device."""
    n = real_BT.sum().clamp(min=1)
    return {
        "is_weight_mean": weights_BT.sum() / n,
        "is_weight_max": weights_BT.amax() if weights_BT.numel() else weights_BT.new_zeros(()),
        "is_masked_fraction": (real_BT & ~keep_BT).sum() / n,
    }


def m2po_keep_mask(log_ratio_N: Tensor, threshold: float) -> tuple[Tensor, Tensor]:
    """Which tokens M2PO trains on: the second-moment trust region of Zheng et al. 2025 ("Prosperity before
    Collapse: How Far Can Off-Policy RL Reach with Stale Data on LLMs?", arXiv 2510.01161), as AReaL masks it
    (`areal/trainer/ppo/actor.py`, `_apply_m2po_masking`, `actor.m2_threshold`).

    With ``m2_t = log_ratio_t ** 2`` over the whole batch, the tokens are ranked by ``m2_t`` (largest first, ties
    in index order) and the fewest largest are masked such that the mean of the rest is below ``threshold``;
    where no such set exists, only the token with the smallest ``m2_t`` is kept. Pure and deterministic: ranks
    that gather the same batch compute the same mask.

    Args:
        log_ratio_N: ``[N]`` float32 log ratios of every real token of the batch (the trainer's log-prob minus
            the sampling engine's), in any fixed order.
        threshold: tau, the largest mean squared log ratio kept (``m2_threshold``; the config checks it is > 0).

    Returns:
        ``(keep_N, m2)``: ``[N]`` bool, True where the token is trained on; and M2, the mean of ``m2_t`` over all
        ``N`` tokens before masking (a 0-dim float32 tensor, 0 when ``N`` is 0).
    """
    with torch.no_grad():
        m2_N = log_ratio_N.float() ** 2
        n = m2_N.numel()
        if n == 0:
            return torch.ones_like(m2_N, dtype=torch.bool), m2_N.new_zeros(())
        sorted_N, order_N = torch.sort(m2_N, descending=True, stable=True)
        # mean of the tokens from rank i on, for every i: masking the i largest leaves that mean
        suffix_mean_N = sorted_N.flip(0).cumsum(0).flip(0) / torch.arange(n, 0, -1, device=m2_N.device)
        below = torch.nonzero(suffix_mean_N < threshold)
        masked = int(below[0, 0]) if below.numel() else n - 1
        keep_sorted_N = torch.arange(n, device=m2_N.device) >= masked
        keep_N = torch.empty_like(keep_sorted_N)
        keep_N[order_N] = keep_sorted_N
        return keep_N, m2_N.mean()


def m2po_weights(
    old_logprobs_BT: Tensor, inference_logprobs_BT: Tensor, keep_BT: Tensor, mask_BT: Tensor
) -> tuple[Tensor, dict[str, Tensor]]:
    """M2PO's importance weights on the policy-gradient term: ``r_t = exp(old_t - inference_t)`` (trainer over
    sampler) on the tokens ``m2po_keep_mask`` keeps, 0 elsewhere (Zheng et al. 2025, eq. for the M2PO objective:
    the masked, unclipped importance-weighted surrogate). The log ratio is clamped to [-20, 20] before ``exp``.

    Args:
        old_logprobs_BT / inference_logprobs_BT / mask_BT: as ``off_policy_weights``.
        keep_BT: ``[B, T]`` 1.0 where the batch's M2PO mask keeps the token, 0.0 elsewhere and on padding.

    Returns:
        ``(weights_BT, metrics)``: detached float32 weights; ``is_weight_mean`` / ``is_weight_max`` over real tokens
        and ``is_masked_fraction`` (real tokens the mask set to 0), as ``off_policy_weights`` names them.
    """
    _check_same_shape(mask_BT, old_logprobs_BT=old_logprobs_BT, inference_logprobs_BT=inference_logprobs_BT)
    _check_same_shape(mask_BT, keep_BT=keep_BT)
    with torch.no_grad():
        real_BT = mask_BT > 0
        keep_BT = real_BT & (keep_BT > 0)
        log_r_BT = (old_logprobs_BT.float() - inference_logprobs_BT.float()).clamp(
            -_KL_LOG_RATIO_CLAMP, _KL_LOG_RATIO_CLAMP
        )
        weights_BT = torch.where(keep_BT, torch.exp(log_r_BT), 0.0)
    return weights_BT, _weight_stats(weights_BT, real_BT, keep_BT)


def _check_ppo_shapes(mask_BT: Tensor, advantages_B: Tensor, **tensors_BT: Tensor | None) -> None:
    """Raise ``ValueError`` on mismatched shapes."""
    _check_same_shape(mask_BT, **{k: v for k, v in tensors_BT.items() if v is not None})
    if advantages_B.shape not in (mask_BT.shape[:1], mask_BT.shape):
        raise ValueError(
            f"advantages_B has shape {tuple(advantages_B.shape)}, expected {tuple(mask_BT.shape[:1])} "
            f"(one advantage per completion, [B]) or {tuple(mask_BT.shape)} (one per token, [B, T]: GAE)"
        )


def ppo_clip_loss(
    logprobs_BT: Tensor,
    old_logprobs_BT: Tensor,
    advantages_B: Tensor,
    mask_BT: Tensor,
    *,
    clip_eps_low: float | None,
    clip_eps_high: float | None,
    aggregation: str,
    kl_coef: float,
    importance_weights_BT: Tensor | None = None,
    ref_logprobs_BT: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate loss per token, optionally importance-weighted and KL-penalised.

    Schulman et al. 2017, "Proximal Policy Optimization Algorithms", eq. 7,
    negated to a loss, with the asymmetric "clip-higher" range of DAPO
    (Yu et al. 2025, sec. 3.1)::

        ratio = exp(logprobs - old_logprobs)
        pg    = -min(ratio * A, clip(ratio, 1 - clip_eps_low, 1 + clip_eps_high) * A)
        loss_tok = pg * importance_weights + kl_coef * k3(logprobs, ref_logprobs)
        loss  = aggregate(loss_tok, mask, aggregation)

    The KL term is added only when ``ref_logprobs_BT`` is given and
    ``kl_coef > 0`` (GRPO, Shao et al. 2024, eq. 3-4); it is not importance-weighted.

    The coefficients and the aggregation have no defaults here and are not checked again (once per micro-batch):
    ``AlgorithmConfig`` validates them, the one source of their defaults and ranges (``0 < clip_eps_low < 1``,
    ``clip_eps_high > 0``, ``kl_coef >= 0``, ``loss_aggregation``).

    Args:
        logprobs_BT: ``[B, T]`` current-policy log-probs of the completion tokens; the only input with gradient.
        old_logprobs_BT: ``[B, T]`` log-probs under the policy that sampled the rollouts.
        advantages_B: ``[B]`` one advantage per completion, broadcast over its tokens, or ``[B, T]`` one per
            token (PPO's GAE, ``lora_rl_core.algorithm.gae``).
        mask_BT: ``[B, T]`` 1.0 on real completion tokens, 0.0 on padding.
        clip_eps_low: ratio floor is ``1 - clip_eps_low`` (``algorithm.clip_eps_low``); None with
            ``clip_eps_high`` None: no clip (``pg = -ratio * A``, as M2PO trains, Zheng et al. 2025).
        clip_eps_high: ratio ceiling is ``1 + clip_eps_high`` (``algorithm.clip_eps_high``).
        aggregation: a mode of ``aggregate`` (see ``LOSS_AGGREGATIONS``; ``algorithm.loss_aggregation``).
        importance_weights_BT: optional ``[B, T]`` weights on the policy-gradient term,
            e.g. the first value of ``off_policy_weights``.
        ref_logprobs_BT: optional ``[B, T]`` reference-model log-probs.
        kl_coef: weight of the k3 KL penalty (``algorithm.kl_coef``).

    Returns:
        ``(loss, metrics)``: scalar float32 loss, and detached 0-dim float32 tensors (no device sync: a
        trainer reads them once per step, not once per micro-batch), each a
        mean over real tokens unless said: ``clip_fraction`` (tokens where
        the clipped term is the active one, so their gradient is zero),
        ``ratio_mean``, ``ratio_max`` (max over real tokens; 0.0 if none),
        ``kl`` (k3; 0.0 without ``ref_logprobs_BT``), ``pg_loss`` (the
        aggregated loss without the KL term).
    """
    _check_ppo_shapes(
        mask_BT,
        advantages_B,
        logprobs_BT=logprobs_BT,
        old_logprobs_BT=old_logprobs_BT,
        importance_weights_BT=importance_weights_BT,
        ref_logprobs_BT=ref_logprobs_BT,
    )
    mask_BT = mask_BT.float()
    log_ratio_BT = torch.where(mask_BT > 0, logprobs_BT.float() - old_logprobs_BT.detach().float(), 0.0)
    ratio_BT = torch.exp(log_ratio_BT)
    advantages_B1 = advantages_B.detach().float()  # [B, 1] broadcasts over T; [B, T] is per token
    advantages_B1 = advantages_B1.unsqueeze(-1) if advantages_B1.dim() == 1 else advantages_B1
    if clip_eps_low is None or clip_eps_high is None:  # unclipped (M2PO): its mask bounds the ratios instead
        pg_BT = -ratio_BT * advantages_B1
        clipped_BT = torch.zeros_like(mask_BT, dtype=torch.bool)
    else:
        clipped_ratio_BT = ratio_BT.clamp(1.0 - clip_eps_low, 1.0 + clip_eps_high)
        pg_BT = -torch.minimum(ratio_BT * advantages_B1, clipped_ratio_BT * advantages_B1)
        clipped_BT = ((ratio_BT < 1.0 - clip_eps_low) & (advantages_B1 < 0)) | (
            (ratio_BT > 1.0 + clip_eps_high) & (advantages_B1 > 0)
        )
    if importance_weights_BT is not None:
        pg_BT = pg_BT * importance_weights_BT.detach().float()
    kl_BT = None if ref_logprobs_BT is None else kl_k3(logprobs_BT, ref_logprobs_BT.detach())
    loss_BT = pg_BT + kl_coef * kl_BT if kl_BT is not None and kl_coef > 0 else pg_BT
    loss = aggregate(loss_BT, mask_BT, aggregation)
    pg_loss = aggregate(pg_BT.detach(), mask_BT, aggregation)
    return loss, _ppo_metrics(mask_BT, ratio_BT, clipped_BT, kl_BT, pg_loss)


def _ppo_metrics(
    mask_BT: Tensor, ratio_BT: Tensor, clipped_BT: Tensor, kl_BT: Tensor | None, pg_loss: Tensor
) -> dict[str, Tensor]:
    """Token-mean diagnostics of one PPO loss call as detached 0-dim float32 tensors (no device sync)."""
    with torch.no_grad():
        zero = ratio_BT.new_zeros(())
        values = {
            "clip_fraction": aggregate(clipped_BT.float(), mask_BT, "token-mean"),
            "ratio_mean": aggregate(ratio_BT, mask_BT, "token-mean"),
            # ratio > 0 on real tokens, so 0 on padding leaves the max unchanged (and gives 0 when empty)
            "ratio_max": torch.where(mask_BT > 0, ratio_BT, 0.0).amax() if mask_BT.numel() else zero,
            "kl": zero if kl_BT is None else aggregate(kl_BT, mask_BT, "token-mean"),
            "pg_loss": pg_loss,
        }
        return {k: v.detach().float() for k, v in values.items()}
