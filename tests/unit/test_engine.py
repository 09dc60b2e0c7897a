"""Embedded engine: mixed-adapter batches, adapters (names, versions, bad adapters), pool limits (usage, deadlines,
pause/abort and concurrency: `test_engine_lifecycle.py`)."""

from __future__ import annotations

import json

import pytest
import torch
from peft import get_peft_model, set_peft_model_state_dict
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from lora_rl_core.adapters import adapter_version
from lora_rl_core.engines import EmbeddedEngine, GenerationRequest, SamplingParams
from lora_rl_core.engines.embedded.peft_model import _lora_config
from lora_rl_core.errors import EngineError
from lora_rl_core.subscriber import retire_stale
from tests.support.embedded_engine import (
    A1,
    A2,
    A3,
    GREEDY,
    load,
    prompts,
    random_adapter,
    tiny_tokenizer,
)

# ------------------------------------------------------------------ batching


@pytest.mark.parametrize(("max_loras_per_batch", "mixed_batches"), [(9, 1), (8, 2)])
def test_mixed_adapter_batch_equals_each_request_alone(make_engine, tiny_model_dir, max_loras_per_batch, mixed_batches):
    engine = make_engine(max_loras_per_batch=max_loras_per_batch)
    names = [f"r-v{v:06d}" for v in range(1, 9)]
    for v, name in enumerate(names):
        load(engine, name, tiny_model_dir, seed=v)
    adapters = [None, *names]  # 8 adapters plus the base model: one batch, or two when the base takes a slot
    requests = [
        GenerationRequest(p, adapters[i % len(adapters)], GREEDY) for i, p in enumerate(prompts(tiny_model_dir, 12))
    ]
    mixed = engine.generate(requests)
    assert engine.metrics()["batches"] == mixed_batches
    alone = [engine.generate([GenerationRequest(r.prompt_ids, r.adapter, GREEDY)])[0] for r in requests]
    assert [c.completion_ids for c in mixed] == [c.completion_ids for c in alone]
    assert [c.adapter for c in mixed] == [r.adapter for r in requests]
    assert [c.adapter_version for c in mixed] == [adapter_version(r.adapter) for r in requests]
    # the adapters really differ from each other and from the base model
    assert len({tuple(c.completion_ids) for c in mixed[: len(adapters)]}) > len(adapters) // 2


def test_completion_records_logprobs_and_finish_reason(engine, tiny_model_dir):
    load(engine, A1, tiny_model_dir, seed=1)
    params = SamplingParams(max_new_tokens=6, temperature=1.0, seed=3)
    out = engine.generate([GenerationRequest(p, A1, params) for p in prompts(tiny_model_dir, 4)])
    for c in out:
        assert len(c.logprobs) == len(c.completion_ids) >= 1
        assert all(lp <= 0.0 for lp in c.logprobs)
        assert c.finish_reason in ("eos", "length") and c.abort_reason is None
        assert c.finish_reason == "length" or c.completion_ids[-1] == 2  # <|im_end|>
        assert c.adapter_version == 1
    again = engine.generate([GenerationRequest(p, A1, params) for p in prompts(tiny_model_dir, 4)])
    assert [c.completion_ids for c in again] == [c.completion_ids for c in out]  # seeded sampling


def test_metrics_are_plain_per_adapter_counters(engine, tiny_model_dir):
    load(engine, A1, tiny_model_dir, seed=1)
    p = prompts(tiny_model_dir, 1)[0]
    out = engine.generate([GenerationRequest(p, A1, GREEDY), GenerationRequest(p, None, GREEDY)])
    m = engine.metrics()
    assert set(m["adapters"][A1]) == {
        "version", "pinned", "resident", "in_flight", "requests", "tokens",
        "loads", "evictions", "load_seconds_last", "load_seconds_total",
    }  # fmt: skip
    assert m["adapters"][A1]["requests"] == 1 and m["adapters"][A1]["tokens"] == len(out[0].completion_ids)
    assert m["adapters"][A1]["load_seconds_total"] > 0 and m["adapters"][A1]["version"] == 1
    assert m["base"] == {"requests": 1, "tokens": len(out[1].completion_ids)}
    assert m["active_versions"] == {"run": 1} and m["queue_depth"] == 0 and m["paused"] is False
    assert engine.health()["ok"] is True


# ------------------------------------------------------------------ adapters


def test_unknown_adapter_is_an_sglang_error_not_the_base_model(engine, tiny_model_dir):
    load(engine, A1, tiny_model_dir, seed=1)
    p = prompts(tiny_model_dir, 1)[0]
    sglang = r"Got LoRA adapter that has never been loaded: run-v000009\nAll loaded adapters: \['run-v000001'\]"
    with pytest.raises(EngineError, match=sglang):
        engine.generate([GenerationRequest(p, None, GREEDY), GenerationRequest(p, "run-v000009", GREEDY)])
    with pytest.raises(EngineError, match="has never been loaded"):
        engine.submit(GenerationRequest(p, "run-v000009", GREEDY))
    assert engine.metrics()["base"]["requests"] == 0 and engine.health()["queue_depth"] == 0  # nothing ran


def test_versioned_names_are_never_reused_and_stale_versions_retire(engine, tiny_model_dir):
    for v in range(4):
        load(engine, f"run-v{v:06d}", tiny_model_dir, seed=0)
    with pytest.raises(EngineError, match="already loaded"):
        load(engine, A3, tiny_model_dir, seed=0)
    engine.pause("retract")
    assert retire_stale(engine, "run", keep=2, protect={A3}) == []  # never unload while paused
    engine.resume()
    assert retire_stale(engine, "run", keep=2, protect={A3}) == ["run-v000000", A1]
    assert sorted(engine.list_adapters()) == [A2, A3]
    assert engine.metrics()["active_versions"] == {"run": 3}
    load(engine, "run-v1000000", tiny_model_dir, seed=0)  # versions grow past 6 digits
    assert engine.list_adapters()["run-v1000000"]["version"] == 1000000
    assert engine.metrics()["active_versions"] == {"run": 1000000}


def test_load_from_a_folder_equals_load_from_tensors(engine, tiny_model_dir, tmp_path):
    tensors, config = random_adapter(tiny_model_dir, seed=4)
    save_file(tensors, tmp_path / "adapter_model.safetensors")
    (tmp_path / "adapter_config.json").write_text(json.dumps(config))
    engine.load_adapter(A1, path=str(tmp_path))
    engine.load_adapter(A2, tensors=tensors, config=config)
    p = prompts(tiny_model_dir, 1)[0]
    out = engine.generate([GenerationRequest(p, A1, GREEDY), GenerationRequest(p, A2, GREEDY)])
    assert out[0].completion_ids == out[1].completion_ids
    assert engine.list_adapters()[A1]["source"] == str(tmp_path)


def test_store_uri_loads_the_version_on_first_use(make_engine, tiny_model_dir, tmp_path):
    from lora_rl_core.store import AdapterStore

    store = AdapterStore(f"file://{tmp_path / 'store'}")
    tensors, config = random_adapter(tiny_model_dir, seed=5)
    ref = store.publish("run", 7, tensors=tensors, adapter_config=config, step=7, base_model="tiny")
    engine = make_engine(store=store)
    engine.load_adapter("ref-v000001", tensors=tensors, config=config)
    engine.load_adapter("copy-v000007", path=ref.uri)  # a store version folder (AdapterRef.uri), verified
    p = prompts(tiny_model_dir, 1)[0]
    out = engine.generate(
        [GenerationRequest(p, a, GREEDY) for a in ("store://run@latest", "ref-v000001", "copy-v000007")]
    )
    assert (out[0].adapter, out[0].adapter_version) == ("run-v000007", 7)
    assert out[0].completion_ids == out[1].completion_ids == out[2].completion_ids
    assert engine.list_adapters()["run-v000007"]["source"] == "store://run@7"
    engine.generate([GenerationRequest(p, "store://run@7", GREEDY)])
    assert engine.metrics()["adapters"]["run-v000007"]["loads"] == 1  # loaded once
    with pytest.raises(EngineError, match="store://run@8"):
        engine.submit(GenerationRequest(p, "store://run@8", GREEDY))


@pytest.mark.parametrize("name", ["../evil", "a/b", "a..b", "bad name", "", "store://run@1"])
def test_bad_adapter_names_are_rejected(engine, tiny_model_dir, name):
    with pytest.raises(EngineError, match="bad adapter name"):
        load(engine, name, tiny_model_dir, seed=0)


def test_bad_adapters_are_rejected_and_active_version_keeps_serving(make_engine, tiny_model_dir, tmp_path):
    engine = make_engine(max_lora_rank=4)
    tensors, config = random_adapter(tiny_model_dir, seed=0)
    engine.load_adapter(A1, tensors=tensors, config=config)
    p = prompts(tiny_model_dir, 1)[0]
    before = engine.generate([GenerationRequest(p, A1, GREEDY)])[0]
    bad = {
        "NaN": ({k: torch.full_like(v, float("nan")) for k, v in tensors.items()}, config),
        "rejected: .*size mismatch": (  # fits the config's rank, not the model's layer sizes: PEFT refuses it
            {k: torch.zeros(v.shape[0], v.shape[1] + 1) if "lora_A" in k else v for k, v in tensors.items()},
            config,
        ),
        r"has shape \[5, \d+\], but rank r = 4 needs dim 0 = 4": (
            {k: torch.zeros(v.shape[0] + 1, v.shape[1]) for k, v in tensors.items()},
            config,
        ),
        r"r = 8 exceeds the engine's maximum LoRA rank 4; .*max_lora_rank \(SGLang: --max-lora-rank\)": random_adapter(
            tiny_model_dir, seed=0, rank=8
        ),
        r"target_modules \['nonexistent_proj'\] not found among the base model's adaptable modules \(.*q_proj": (
            tensors,
            {**config, "target_modules": ["nonexistent_proj"]},
        ),
    }
    for v, (match, (t, c)) in enumerate(bad.items(), start=2):
        with pytest.raises(EngineError, match=match):
            engine.load_adapter(f"run-v{v:06d}", tensors=t, config=c)
    (tmp_path / "adapter_model.bin").write_bytes(b"pickle")
    with pytest.raises(EngineError, match="pickle"):
        engine.load_adapter("run-v000010", path=str(tmp_path))
    save_file(tensors, tmp_path / "adapter_model.safetensors")
    with pytest.raises(EngineError, match="missing .*adapter_config.json"):
        engine.load_adapter("run-v000011", path=str(tmp_path))
    with pytest.raises(EngineError, match="missing"):
        engine.load_adapter("run-v000012", path=str(tmp_path / "nowhere"))
    for name in ("../run-v000013", "run/v000013", "run..v000013"):
        with pytest.raises(EngineError, match="bad adapter name"):
            engine.load_adapter(name, tensors=tensors, config=config)
    assert sorted(engine.list_adapters()) == [A1]
    assert engine.generate([GenerationRequest(p, A1, GREEDY)])[0].completion_ids == before.completion_ids


def test_unload_last_adapter_returns_to_base(engine, tiny_model_dir):
    p = prompts(tiny_model_dir, 1)[0]
    base = engine.generate([GenerationRequest(p, None, GREEDY)])[0]
    load(engine, A1, tiny_model_dir, seed=0)
    engine.unload_adapter(A1)
    assert engine.list_adapters() == {}
    assert engine.generate([GenerationRequest(p, None, GREEDY)])[0].completion_ids == base.completion_ids
    with pytest.raises(EngineError, match="not loaded"):
        engine.unload_adapter(A1)


# ---------------------------------------------------------------------- pool


@pytest.mark.parametrize(("policy", "victim"), [("lru", A2), ("fifo", A1)])
def test_eviction_follows_the_policy_and_reinjects_identically(make_engine, tiny_model_dir, policy, victim):
    engine = make_engine(max_loaded_loras=2, max_loras_per_batch=2, eviction_policy=policy)
    p = prompts(tiny_model_dir, 1)[0]
    load(engine, A1, tiny_model_dir, seed=1)
    load(engine, A2, tiny_model_dir, seed=2)
    first = {n: engine.generate([GenerationRequest(p, n, GREEDY)])[0].completion_ids for n in (A2, A1)}  # A1 last
    load(engine, A3, tiny_model_dir, seed=3)
    assert {n for n, i in engine.list_adapters().items() if i["resident"]} == {A1, A2, A3} - {victim}
    assert engine.generate([GenerationRequest(p, victim, GREEDY)])[0].completion_ids == first[victim]
    stats = engine.metrics()["adapters"][victim]
    assert (stats["evictions"], stats["loads"]) == (1, 2)
    assert engine.metrics()["resident"] == 2


def test_pinned_adapter_survives_pressure_and_the_pin_cap_holds(make_engine, tiny_model_dir):
    engine = make_engine(max_loaded_loras=2, max_loras_per_batch=2)
    p = prompts(tiny_model_dir, 1)[0]
    load(engine, "pin-v000001", tiny_model_dir, seed=9, pinned=True)
    with pytest.raises(EngineError, match="cannot pin"):
        load(engine, "pin-v000002", tiny_model_dir, seed=9, pinned=True)
    for v, name in enumerate((A1, A2, A3)):
        load(engine, name, tiny_model_dir, seed=v)
        engine.generate([GenerationRequest(p, n, GREEDY) for n in (name, "pin-v000001", None)])
    stats = engine.metrics()["adapters"]
    assert stats["pin-v000001"]["resident"] and stats["pin-v000001"]["evictions"] == 0
    assert stats["pin-v000001"]["pinned"] and stats["pin-v000001"]["requests"] == 3


def test_a_tokenizer_without_a_pad_token_pads_with_eos(tiny_model_dir):
    """A tokenizer with no pad token (SmolLM2's own files) must not break batches of unequal prompts; the
    padding is masked, so the outputs equal the same engine's with a pad token."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    bare = AutoTokenizer.from_pretrained(tiny_model_dir)  # its own copy: the shared one keeps its pad token
    bare.pad_token = None
    assert bare.pad_token_id is None
    greedy = SamplingParams(max_new_tokens=4, temperature=0.0)
    rows = prompts(tiny_model_dir, 3)
    with EmbeddedEngine(model, bare) as no_pad, EmbeddedEngine(model, tiny_tokenizer(tiny_model_dir)) as padded:
        got = [c.completion_ids for c in no_pad.generate([GenerationRequest(p, None, greedy) for p in rows])]
        want = [c.completion_ids for c in padded.generate([GenerationRequest(p, None, greedy) for p in rows])]
    assert got == want and all(got)


def test_an_adapter_is_held_in_the_base_weights_dtype(tiny_model_dir):
    """Over a bfloat16 model the engine holds the adapter in bfloat16 (as SGLang does), not PEFT's float32 copy,
    and its completions are those of PEFT's own model with the same bfloat16 adapter."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16)
    engine = EmbeddedEngine(model, tiny_tokenizer(tiny_model_dir), max_batch_size=8)
    try:
        load(engine, A1, tiny_model_dir, seed=1)
        lora = {p.dtype for n, p in engine._model._model.named_parameters() if "lora_" in n}
        assert lora == {torch.bfloat16}
        out = engine.generate([GenerationRequest(p, A1, GREEDY) for p in prompts(tiny_model_dir, 3)])
    finally:
        engine.close()
    tensors, config = random_adapter(tiny_model_dir, 1)
    lora_config = _lora_config(A1, config)  # the engine's own reading of an adapter_config
    reference = get_peft_model(
        AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16),
        lora_config,
        autocast_adapter_dtype=False,
    ).eval()
    set_peft_model_state_dict(reference, tensors)
    for completion, prompt in zip(out, prompts(tiny_model_dir, 3), strict=True):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            want = reference.generate(ids, max_new_tokens=GREEDY.max_new_tokens, do_sample=False, pad_token_id=0)
        n = len(completion.completion_ids)
        assert completion.completion_ids == want[0, len(prompt) : len(prompt) + n].tolist()
