"""The embedded engine's CPU decode attention (`engines/embedded/attention.py`) against transformers' SDPA."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from lora_rl_core.engines import SamplingParams
from lora_rl_core.engines.embedded.attention import DECODE_ATTENTION, decode_attention, use_decode_attention
from lora_rl_core.engines.embedded.generation import generate_batch

PAD, EOS = 0, 2
PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14], [5, 6, 7, 8, 9]]  # lengths differ: left padding


class _Grouped(torch.nn.Module):
    num_key_value_groups = 3  # 9 query heads over 3 key/value heads, as SmolLM2-135M
    is_causal = True


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mask", ["none", "bool", "additive"])
def test_one_query_position_equals_sdpa(dtype: torch.dtype, mask: str) -> None:
    gen = torch.Generator().manual_seed(0)
    query = torch.randn(4, 9, 1, 16, generator=gen).to(dtype)
    key, value = (torch.randn(4, 3, 7, 16, generator=gen).to(dtype) for _ in range(2))
    keep = torch.ones(4, 1, 1, 7, dtype=torch.bool)
    keep[1, ..., :3] = False  # a left-padded row
    attention_mask = {"none": None, "bool": keep, "additive": torch.zeros(4, 1, 1, 7).masked_fill(~keep, -1e9)}[mask]
    ours, _ = decode_attention(_Grouped(), query, key, value, attention_mask, scaling=0.25)
    ref, _ = sdpa_attention_forward(_Grouped(), query, key, value, attention_mask, scaling=0.25)
    assert ours.shape == ref.shape == (4, 1, 9, 16) and ours.dtype == dtype and ours.is_contiguous()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(ours, ref, atol=tol, rtol=tol)


def test_several_query_positions_go_to_sdpa_unchanged() -> None:
    gen = torch.Generator().manual_seed(1)
    query = torch.randn(2, 9, 5, 16, generator=gen)
    key, value = (torch.randn(2, 3, 5, 16, generator=gen) for _ in range(2))
    ours, _ = decode_attention(_Grouped(), query, key, value, None, scaling=0.25)
    ref, _ = sdpa_attention_forward(_Grouped(), query, key, value, None, scaling=0.25)
    assert torch.equal(ours, ref)  # the prefill (causal) is SDPA's own


def test_greedy_generation_matches_sdpa_on_a_left_padded_batch(tiny_model_dir) -> None:
    sdpa = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    ours = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    assert use_decode_attention(ours) and ours.config._attn_implementation == DECODE_ATTENTION
    assert sdpa.config._attn_implementation == "sdpa"  # the other model keeps its own
    greedy = SamplingParams(max_new_tokens=8, temperature=0.0)
    ref_tokens, ref_logprobs = generate_batch(sdpa, PROMPTS, None, greedy, pad_id=PAD, eos_ids=[EOS])
    tokens, logprobs = generate_batch(ours, PROMPTS, None, greedy, pad_id=PAD, eos_ids=[EOS])
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(logprobs, ref_logprobs, atol=1e-5, rtol=1e-5)


def test_a_model_not_on_sdpa_keeps_its_attention(tiny_model_dir) -> None:
    eager = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, attn_implementation="eager")
    assert not use_decode_attention(eager)
    assert eager.config._attn_implementation == "eager"
