"""The embedded engine's batch of one adapter on merged weights (`engines/embedded/merged.py`): the same tokens
and logprobs as PEFT's unmerged path, base weights untouched, and the cases that stay unmerged."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
from transformers import AutoModelForCausalLM

from lora_rl_core.engines import GenerationRequest, SamplingParams
from lora_rl_core.engines.embedded.merged import MIN_NEW_TOKENS, MergedAdapter
from lora_rl_core.lora import peft_config_dict
from tests.support.embedded_engine import A1, A2, load, prompts

LONG = SamplingParams(max_new_tokens=MIN_NEW_TOKENS + 4, temperature=0.0)
SAMPLED = SamplingParams(max_new_tokens=MIN_NEW_TOKENS + 4, temperature=1.0, seed=5)


def _base_weights(engine) -> dict[str, torch.Tensor]:
    model = engine._model._model
    return {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" not in n}


@pytest.mark.parametrize("params", [LONG, SAMPLED], ids=["greedy", "sampled"])
def test_merged_batch_equals_the_unmerged_one(make_engine, tiny_model_dir, params):
    merged, plain = make_engine(merge_single_adapter=True), make_engine()
    for engine in (merged, plain):
        load(engine, A1, tiny_model_dir, seed=1)
    requests = [GenerationRequest(p, A1, params) for p in prompts(tiny_model_dir, 6)]
    before = _base_weights(merged)
    out, ref = merged.generate(requests), plain.generate(requests)
    assert merged._model._merged.name == A1  # it ran merged, and keeps the weights for the next batch
    assert [c.completion_ids for c in out] == [c.completion_ids for c in ref]
    assert sum(len(c.completion_ids) for c in out) > len(out)  # more than one token a row
    for a, b in zip(out, ref, strict=True):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)  # float32 model: rounding only
    after = _base_weights(merged)
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)


def test_merged_weights_follow_the_adapter_and_go_with_it(make_engine, tiny_model_dir):
    engine, plain = make_engine(merge_single_adapter=True), make_engine()
    for e in (engine, plain):
        load(e, A1, tiny_model_dir, seed=1)
        load(e, A2, tiny_model_dir, seed=2)
    p = prompts(tiny_model_dir, 3)
    for name in (A1, A2, A1):  # each switch merges the other adapter
        out = engine.generate([GenerationRequest(q, name, LONG) for q in p])
        assert engine._model._merged.name == name
        ref = plain.generate([GenerationRequest(q, name, LONG) for q in p])
        assert [c.completion_ids for c in out] == [c.completion_ids for c in ref]
    engine.unload_adapter(A1)
    engine.generate([GenerationRequest(q, A2, LONG) for q in p])  # the worker reaps A1 before this batch
    assert engine._model._merged.name == A2
    engine.unload_adapter(A2)
    engine.generate([GenerationRequest(q, None, LONG) for q in p])
    assert engine._model._merged.name is None  # the unloaded adapter's merged copy is gone


def test_mixed_short_and_base_batches_run_unmerged(make_engine, tiny_model_dir):
    engine = make_engine(merge_single_adapter=True)
    load(engine, A1, tiny_model_dir, seed=1)
    load(engine, A2, tiny_model_dir, seed=2)
    p = prompts(tiny_model_dir, 4)
    short = SamplingParams(max_new_tokens=MIN_NEW_TOKENS - 1, temperature=0.0)
    engine.generate([GenerationRequest(q, A1, short) for q in p])
    engine.generate([GenerationRequest(q, a, LONG) for q, a in zip(p, [A1, A2, None, A1], strict=True)])
    engine.generate([GenerationRequest(q, None, LONG) for q in p])
    assert engine._model._merged.name is None


def test_a_dora_adapter_is_not_merged(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj"], use_dora=True), adapter_name="d")
    base = {n: p.detach().clone() for n, p in peft_model.named_parameters() if "lora_" not in n}
    merged = MergedAdapter()
    with merged.applied(peft_model, "d") as applied:
        assert applied is False
    assert merged.name is None
    assert all(torch.equal(p, base[n]) for n, p in peft_model.named_parameters() if "lora_" not in n)
    assert peft_config_dict(peft_model.peft_config["d"])["use_dora"] is True
    assert get_peft_model_state_dict(peft_model, adapter_name="d")  # the adapter is still there, unmerged


def test_base_weights_come_back_after_an_error_in_the_block(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "down_proj"]), adapter_name="pol")
    for n, p in peft_model.named_parameters():
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.5)
    q_proj = peft_model.base_model.model.model.layers[0].self_attn.q_proj
    base = q_proj.get_base_layer().weight.detach().clone()
    merged = MergedAdapter()
    with pytest.raises(RuntimeError, match="in the batch"), merged.applied(peft_model, "pol") as applied:
        assert applied is True
        expected = base + q_proj.get_delta_weight("pol")
        torch.testing.assert_close(q_proj.get_base_layer().weight, expected)
        raise RuntimeError("in the batch")
    assert torch.equal(q_proj.get_base_layer().weight, base)
    assert merged.name == "pol"  # kept for the next batch of it
