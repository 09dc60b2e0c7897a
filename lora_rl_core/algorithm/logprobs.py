"""Log-probabilities of the chosen tokens, and entropies, from logits: one pass per batch row, in float32.

``token_logprobs`` is TRL's ``selective_log_softmax`` (``trl/trainer/utils.py``: ``log p(y) = logit_y -
logsumexp(logits)``, one row at a time so bf16 logits never need a whole float32 ``[B, T, V]`` copy) with
its backward written out: ``d log p(y) / d logits = onehot(y) - softmax(logits)``, recomputed per row from
the saved logits and ``logsumexp``. Autograd through the plain formula keeps a float32 copy of every row's
logits for the backward, fills a zero ``[B, T, V]`` for the gather's gradient, adds the two gradients and
casts the sum back to the logits' dtype: four passes over the largest tensor of a train step that this
backward does not make. The entropy ``H = logsumexp - sum_v p_v x_v`` comes from the same forward pass
(``token_logprobs_and_entropy``; a metric: no gradient). The sampling temperature ``tau`` divides the logits
inside the pass, so no tempered copy is made either.

Measured on the default job's micro-batch ``[16, 48, 49152]`` (2-core AMD EPYC, AVX512-BF16): 0.247 -> 0.089 s
forward and backward, the same gradients (``benchmarks/token_logprobs.py``, ``benchmarks/results/cpu-logprobs/``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.autograd.function import FunctionCtx, once_differentiable


def token_logprobs(logits_BTV: Tensor, token_ids_BT: Tensor, *, temperature: float = 1.0) -> Tensor:
    """Log-probability of the chosen token at each position under ``softmax(logits / temperature)``: TRL's
    ``selective_log_softmax`` (``log_softmax(logits).gather(-1, y)`` without the ``[B, T, V]`` log-softmax).

    Args:
        logits_BTV: ``[B, T, V]`` logits, any floating dtype (each row is read as float32).
        token_ids_BT: ``[B, T]`` int64 ids of the tokens whose log-probability to take.
        temperature: the sampling temperature (> 0) the logits are divided by; 1.0 divides nothing.

    Returns:
        ``[B, T]`` float32 log-probs (nats, <= 0), differentiable in ``logits_BTV``.

    Raises:
        ValueError: ``logits_BTV`` not 3-D, or ``token_ids_BT`` not its first two dims.
    """
    return _apply(logits_BTV, token_ids_BT, temperature, with_entropy=False)[0]


def token_logprobs_and_entropy(
    logits_BTV: Tensor, token_ids_BT: Tensor, *, temperature: float = 1.0
) -> tuple[Tensor, Tensor]:
    """``token_logprobs`` and, from the same pass, the entropy of ``softmax(logits / temperature)`` at each
    position: ``([B, T]`` float32 log-probs, differentiable; ``[B, T]`` float32 entropies in nats, in
    ``[0, log V]``, without a gradient). The entropy assumes finite logits (a ``-inf`` logit gives NaN).

    Raises:
        ValueError: as ``token_logprobs``.
    """
    return _apply(logits_BTV, token_ids_BT, temperature, with_entropy=True)


def _apply(
    logits_BTV: Tensor, token_ids_BT: Tensor, temperature: float, *, with_entropy: bool
) -> tuple[Tensor, Tensor]:
    if logits_BTV.dim() != 3:
        raise ValueError(f"logits_BTV must be 3-D [B, T, V], got shape {tuple(logits_BTV.shape)}")
    if token_ids_BT.shape != logits_BTV.shape[:2]:
        raise ValueError(
            f"token_ids_BT has shape {tuple(token_ids_BT.shape)}, expected {tuple(logits_BTV.shape[:2])} "
            "(the first two dims of logits_BTV)"
        )
    return _TokenLogprobs.apply(logits_BTV, token_ids_BT, float(temperature), with_entropy)


def _tempered_TV(logits_TV: Tensor, temperature: float) -> tuple[Tensor, bool]:
    """One row's float32 logits over ``temperature``, and whether it is a new tensor (safe to overwrite)."""
    x_TV = logits_TV.float()
    if temperature != 1.0:
        return x_TV / temperature, True
    return x_TV, x_TV.data_ptr() != logits_TV.data_ptr()


class _TokenLogprobs(torch.autograd.Function):
    """``token_logprobs``: forward and backward row by row (module docstring)."""

    @staticmethod
    def forward(
        ctx: FunctionCtx, logits_BTV: Tensor, token_ids_BT: Tensor, temperature: float, with_entropy: bool
    ) -> tuple[Tensor, Tensor]:
        shape, device = token_ids_BT.shape, logits_BTV.device
        logprobs_BT = torch.empty(shape, dtype=torch.float32, device=device)
        lse_BT = torch.empty(shape, dtype=torch.float32, device=device)
        entropy_BT = torch.zeros(shape if with_entropy else (0,), dtype=torch.float32, device=device)
        for b in range(shape[0]):
            x_TV, _ = _tempered_TV(logits_BTV[b], temperature)
            lse_T = torch.logsumexp(x_TV, dim=-1)
            lse_BT[b] = lse_T
            logprobs_BT[b] = x_TV.gather(-1, token_ids_BT[b].unsqueeze(-1)).squeeze(-1) - lse_T
            if with_entropy:
                p_TV = torch.exp(x_TV - lse_T.unsqueeze(-1))
                entropy_BT[b] = lse_T - torch.linalg.vecdot(p_TV, x_TV)
        ctx.save_for_backward(logits_BTV, token_ids_BT, lse_BT)
        ctx.temperature = temperature  # type: ignore[attr-defined]
        ctx.mark_non_differentiable(entropy_BT)
        return logprobs_BT, entropy_BT

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_logprobs_BT: Tensor, _grad_entropy_BT: Tensor) -> tuple[Tensor | None, ...]:
        logits_BTV, token_ids_BT, lse_BT = ctx.saved_tensors
        temperature: float = ctx.temperature
        grad_BTV = torch.empty_like(logits_BTV)
        for b in range(logits_BTV.shape[0]):
            x_TV, fresh = _tempered_TV(logits_BTV[b], temperature)
            g_T1 = grad_logprobs_BT[b].unsqueeze(-1).float()
            shifted_TV = x_TV.sub_(lse_BT[b].unsqueeze(-1)) if fresh else x_TV - lse_BT[b].unsqueeze(-1)
            d_TV = shifted_TV.exp_().mul_(-g_T1)  # -g * softmax
            d_TV.scatter_add_(-1, token_ids_BT[b].unsqueeze(-1), g_T1)  # + g at the chosen token
            if temperature != 1.0:
                d_TV.div_(temperature)
            grad_BTV[b] = d_TV
        return grad_BTV, None, None, None
