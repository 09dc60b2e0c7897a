"""What a train step combines over micro-batches and ranks: the step's metrics (`accumulate` on the device,
then `all_reduce_metrics` once per minibatch) and M2PO's mask over the whole batch (`m2po_batch_keep`)."""

from __future__ import annotations

import torch

from lora_rl_core import distributed
from lora_rl_core.algorithm import m2po_keep_mask
from lora_rl_core.records import TrainBatch

LOSS_KEYS = frozenset({"loss", "pg_loss", "value_loss"})
"""Metrics that combine over micro-batches as the backward pass does (by the micro-batch's loss weight)."""
MAX_KEYS = frozenset({"ratio_max", "is_weight_max"})
"""Metrics combined over micro-batches and ranks by max."""


def accumulate(metrics: dict[str, torch.Tensor], m: dict[str, torch.Tensor], weight: float, token_share: float) -> None:
    """Add one micro-batch's metrics (0-dim tensors, on the device: no sync): losses combine like the backward
    pass; per-token metrics are token-weighted; maxima take the max."""
    for k, v in m.items():
        if k in MAX_KEYS:
            metrics[k] = torch.maximum(metrics[k], v) if k in metrics else v
        else:
            share = v * (weight if k in LOSS_KEYS else token_share)
            metrics[k] = metrics[k] + share if k in metrics else share


def all_reduce_metrics(sums: dict[str, torch.Tensor]) -> dict[str, float]:
    """Global metrics from each rank's share, read from the device at once: shares were weighted by global
    counts, so they sum; maxima max."""
    values = torch.stack([v.detach().float().reshape(()) for v in sums.values()]).tolist() if sums else []
    metrics = dict(zip(sums, values, strict=True))
    maxed = {k: v for k, v in metrics.items() if k in MAX_KEYS}
    summed = {k: v for k, v in metrics.items() if k not in MAX_KEYS}
    return {**distributed.all_reduce_sum(summed), **distributed.all_reduce_max(maxed)}


def m2po_batch_keep(
    batch: TrainBatch, old: dict[int, torch.Tensor], threshold: float
) -> tuple[dict[int, torch.Tensor], dict[str, float]]:
    """M2PO's mask over the whole step's batch (`algorithm.losses.m2po_keep_mask`, threshold tau): the log
    ratios of this rank's rows (`old`: row -> `[tokens]` float32 log-probs of the policy before the update,
    minus the engine's `batch.inference_logprobs`) gathered from every rank, the mask made on each rank alike.

    Returns:
        this rank's part per row (`[tokens]` bool, True = trained on), and the step's global `m2` (mean squared
        log ratio before masking) and `m2_masked_fraction`. A row the policy's loss leaves out (the critic's
        `value_only`) keeps no token and does not count in M2.
    """
    rows = [i for i in sorted(old) if batch.trains_policy(i)]
    log_r = [old[i] - torch.tensor(batch.inference_logprobs[i], dtype=torch.float32) for i in rows]
    mine = torch.cat(log_r) if log_r else torch.zeros(0)
    everyone, start = distributed.all_gather_cat(mine)
    keep_N, m2 = m2po_keep_mask(everyone, threshold)
    own = keep_N[start : start + mine.numel()].cpu()
    masked = float((~keep_N).sum()) / max(1, keep_N.numel())
    keep = dict(zip(rows, own.split([len(r) for r in log_r]), strict=True))
    keep.update({i: torch.zeros(len(old[i]), dtype=torch.bool) for i in old if i not in keep})
    return keep, {"m2": float(m2), "m2_masked_fraction": masked}
