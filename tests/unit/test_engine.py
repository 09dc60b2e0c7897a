"""Embedded engine: mixed-adapter batches, versioned names, retirement, bad adapters."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from lora_rl_core.engines import EmbeddedEngine, GenerationRequest, SamplingParams, adapter_version
from lora_rl_core.errors import EngineError
from lora_rl_core.lora import peft_config_dict

GREEDY = SamplingParams(max_new_tokens=12, temperature=0.0)


def random_adapter(model_dir, seed: int, targets=("q_proj", "v_proj", "down_proj")) -> tuple[dict, dict]:
    """A LoRA adapter with random (non-zero) A and B, so it changes the model's outputs."""
    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    peft_model = get_peft_model(
        base, LoraConfig(r=4, lora_alpha=16, target_modules=list(targets), init_lora_weights=False)
    )
    state = {k: v * 8 for k, v in get_peft_model_state_dict(peft_model).items()}  # big enough to change greedy tokens
    return state, peft_config_dict(peft_model.peft_config["default"])


@pytest.fixture()
def engine(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    return EmbeddedEngine(model, AutoTokenizer.from_pretrained(tiny_model_dir), max_batch_size=64, keep_versions=2)


def prompts(tiny_model_dir, n: int) -> list[list[int]]:
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    return [tok(f"What is {i} + {2 * i}?")["input_ids"][: 3 + i % 5] for i in range(n)]


def test_mixed_adapter_batch_equals_each_request_alone(engine, tiny_model_dir):
    names = [f"r-v{v:06d}" for v in range(1, 9)]
    for v, name in enumerate(names):
        tensors, config = random_adapter(tiny_model_dir, seed=v)
        engine.load_adapter(name, tensors=tensors, config=config)
    adapters = [None, *names]  # 8 adapters plus the base model in one batch
    requests = [
        GenerationRequest(p, adapters[i % len(adapters)], GREEDY) for i, p in enumerate(prompts(tiny_model_dir, 18))
    ]
    mixed = engine.generate(requests)
    alone = [engine.generate([GenerationRequest(r.prompt_ids, r.adapter, GREEDY)])[0] for r in requests]
    assert [c.completion_ids for c in mixed] == [c.completion_ids for c in alone]
    assert [c.adapter for c in mixed] == [r.adapter for r in requests]
    assert [c.adapter_version for c in mixed] == [adapter_version(r.adapter) for r in requests]
    # the adapters really differ from each other and from the base model
    assert len({tuple(c.completion_ids) for c in mixed[: len(adapters)]}) > len(adapters) // 2


def test_completion_records_logprobs_and_finish_reason(engine, tiny_model_dir):
    tensors, config = random_adapter(tiny_model_dir, seed=1)
    engine.load_adapter("run-v000001", tensors=tensors, config=config)
    params = SamplingParams(max_new_tokens=6, temperature=1.0, seed=3)
    out = engine.generate([GenerationRequest(p, "run-v000001", params) for p in prompts(tiny_model_dir, 4)])
    for c in out:
        assert len(c.logprobs) == len(c.completion_ids) >= 1
        assert all(lp <= 0.0 for lp in c.logprobs)
        assert c.finish_reason in ("stop", "length")
        assert c.finish_reason == "length" or c.completion_ids[-1] == 2  # <|im_end|>
        assert c.adapter_version == 1
    again = engine.generate([GenerationRequest(p, "run-v000001", params) for p in prompts(tiny_model_dir, 4)])
    assert [c.completion_ids for c in again] == [c.completion_ids for c in out]  # seeded sampling


def test_unknown_adapter_is_an_error_not_the_base_model(engine, tiny_model_dir):
    with pytest.raises(EngineError, match="not loaded"):
        engine.generate([GenerationRequest(prompts(tiny_model_dir, 1)[0], "run-v000009", GREEDY)])


def test_versioned_names_are_never_reused_and_stale_versions_retire(engine, tiny_model_dir):
    tensors, config = random_adapter(tiny_model_dir, seed=0)
    for v in range(4):
        engine.load_adapter(f"run-v{v:06d}", tensors=tensors, config=config)
    with pytest.raises(EngineError, match="already loaded"):
        engine.load_adapter("run-v000003", tensors=tensors, config=config)
    assert engine.retire_stale("run", active="run-v000003") == ["run-v000000", "run-v000001"]
    assert sorted(engine.list_adapters()) == ["run-v000002", "run-v000003"]


@pytest.mark.parametrize("name", ["../evil", "a/b", "bad name", ""])
def test_bad_adapter_names_are_rejected(engine, tiny_model_dir, name):
    tensors, config = random_adapter(tiny_model_dir, seed=0)
    with pytest.raises(EngineError, match="bad adapter name"):
        engine.load_adapter(name, tensors=tensors, config=config)


def test_bad_adapters_are_rejected_and_active_version_keeps_serving(engine, tiny_model_dir, tmp_path):
    tensors, config = random_adapter(tiny_model_dir, seed=0)
    engine.load_adapter("run-v000001", tensors=tensors, config=config)
    before = engine.generate([GenerationRequest(prompts(tiny_model_dir, 1)[0], "run-v000001", GREEDY)])[0]
    nan = {k: torch.full_like(v, float("nan")) for k, v in tensors.items()}
    with pytest.raises(EngineError, match="NaN"):
        engine.load_adapter("run-v000002", tensors=nan, config=config)
    wrong = {k: torch.zeros(v.shape[0] + 1, v.shape[1]) for k, v in tensors.items()}
    with pytest.raises(EngineError, match="rejected"):
        engine.load_adapter("run-v000003", tensors=wrong, config=config)
    (tmp_path / "adapter_model.bin").write_bytes(b"pickle")
    with pytest.raises(EngineError, match="pickle"):
        engine.load_adapter("run-v000004", path=str(tmp_path))
    save_file(tensors, tmp_path / "adapter_model.safetensors")
    with pytest.raises(EngineError, match="adapter_config.json"):
        engine.load_adapter("run-v000005", path=str(tmp_path))
    assert sorted(engine.list_adapters()) == ["run-v000001"]
    after = engine.generate([GenerationRequest(prompts(tiny_model_dir, 1)[0], "run-v000001", GREEDY)])[0]
    assert after.completion_ids == before.completion_ids


def test_unload_last_adapter_returns_to_base(engine, tiny_model_dir):
    p = prompts(tiny_model_dir, 1)[0]
    base = engine.generate([GenerationRequest(p, None, GREEDY)])[0]
    tensors, config = random_adapter(tiny_model_dir, seed=0)
    engine.load_adapter("run-v000001", tensors=tensors, config=config)
    engine.unload_adapter("run-v000001")
    assert engine.list_adapters() == {}
    assert engine.generate([GenerationRequest(p, None, GREEDY)])[0].completion_ids == base.completion_ids
