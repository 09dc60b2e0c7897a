"""The embedded engine's attention on a CPU: a decode step's one query position over grouped key/value heads as
two batched matmuls, registered with transformers' attention interface (`AttentionInterface`, with SDPA's
mask, `AttentionMaskInterface`: https://huggingface.co/docs/transformers/en/attention_interface).

Why: in a decode step without padding transformers calls SDPA with `enable_gqa=True`, and torch's CPU
flash-attention kernel took 1.6-2.3 ms a layer for the default job's 40-64 rows of one query over 40-100
cached positions (SmolLM2-135M: 9 query heads over 3 key/value heads), about a fifth of a rollout. The query's
heads of one key/value head are the rows of one matmul here (`[b, kv, groups, d] @ [b, kv, d, L]`, as
transformers' own `pack_gqa` shapes them), so nothing is repeated: 0.28 ms against 3.5 ms for 64 rows over 100
positions (2-core AMD EPYC, AVX512-BF16, bfloat16). Everything else (prefill, training, a position bias, a
soft cap, dropout, a per-head mask) goes to transformers' SDPA function as before.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

DECODE_ATTENTION = "lora_rl_decode"
"""The name it is registered under (`model.config._attn_implementation`)."""


def decode_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention as transformers calls it: `query [b, heads, q, d]`, `key`/`value [b, kv_heads, L, d]`, a
    boolean or additive `attention_mask [b, 1, q, L]` (True / 0 = attend) or None (attend to all). Returns
    `([b, q, heads, d], None)`, as `sdpa_attention_forward` does. One query position: softmax in float32 over
    `[b, kv_heads, heads / kv_heads, L]` scores; anything else: `sdpa_attention_forward`."""
    batch, heads, positions, dim = query.shape
    kv_heads = key.shape[1]
    special = dropout or kwargs.get("position_bias") is not None or kwargs.get("softcap") is not None
    if positions != 1 or special or heads % kv_heads or (attention_mask is not None and attention_mask.shape[1] != 1):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    query_bkgd = query.reshape(batch, kv_heads, heads // kv_heads, dim)
    scores_bkgL = torch.matmul(query_bkgd, key.transpose(-1, -2)).float() * (dim**-0.5 if scaling is None else scaling)
    if attention_mask is not None:  # [b, 1, 1, L]: the same for every head
        if attention_mask.dtype == torch.bool:
            scores_bkgL = scores_bkgL.masked_fill(~attention_mask, float("-inf"))
        else:
            scores_bkgL = scores_bkgL + attention_mask
    probs_bkgL = torch.softmax(scores_bkgL, dim=-1).to(value.dtype)
    out_bkgd = torch.matmul(probs_bkgL, value)
    return out_bkgd.reshape(batch, heads, 1, dim).transpose(1, 2).contiguous(), None


AttentionInterface.register(DECODE_ATTENTION, decode_attention)
AttentionMaskInterface.register(DECODE_ATTENTION, sdpa_mask)  # the mask SDPA gets, for the prefill too


def use_decode_attention(model: PreTrainedModel) -> bool:
    """Give `model` `decode_attention` where it runs SDPA; returns whether it now does. A model that does not
    dispatch through `AttentionInterface`, or runs another implementation (eager, flash attention), keeps its
    own."""
    if model.config._attn_implementation != "sdpa":
        return False
    model.set_attn_implementation(DECODE_ATTENTION)
    return bool(model.config._attn_implementation == DECODE_ATTENTION)
