"""Retiring adapter versions from an SGLang server, which reloads an unloaded adapter when a request names it.

SGLang 0.5.17 answers a `/generate` naming an unloaded adapter by loading it again from the path it
remembers, with HTTP 200 (docs/SGLANG.md, "Hazards"); the fake server (`lora_rl_testing.sglang_fake`) does
the same. These tests show the hazard on the fake, then that `SGLangEngine` never brings a retired version
back (it refuses requests for it as for an unknown adapter), and that a version another client revives is
noticed (`revived_adapters`) and retired again by `subscriber.retire_stale`.
"""

from __future__ import annotations

import json
import time

import httpx
import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from lora_rl_core.engines import EmbeddedEngine, GenerationRequest, SamplingParams
from lora_rl_core.engines.remote import SGLANG, HTTPEngine
from lora_rl_core.errors import EngineError
from lora_rl_core.subscriber import retire_stale
from lora_rl_testing.adapters import random_lora_factory
from lora_rl_testing.servers import serve_app_in_thread
from lora_rl_testing.sglang_fake import SGLangFakeServer

pytestmark = pytest.mark.slow  # uvicorn in a thread

RUN = "ret"
V1, V2, V3 = (f"{RUN}-v{v:06d}" for v in (1, 2, 3))
GREEDY = SamplingParams(max_new_tokens=3, temperature=0.0)


@pytest.fixture(scope="module", autouse=True)
def prefect_harness():
    """No Prefect server is needed here: overrides the package's session-wide harness for this module."""
    yield


@pytest.fixture
def served(tiny_model_dir, tmp_path):
    """(fake SGLang server, its URL, {adapter name: PEFT folder}) over an embedded engine on the tiny model."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    make = random_lora_factory(model, scale=1.0)
    folders = {}
    for version, name in enumerate((V1, V2, V3), start=1):
        tensors, config = make(version)
        folder = tmp_path / name
        folder.mkdir()
        save_file(tensors, folder / "adapter_model.safetensors")
        (folder / "adapter_config.json").write_text(json.dumps(config))
        folders[name] = str(folder)
    with EmbeddedEngine(model, AutoTokenizer.from_pretrained(tiny_model_dir), max_batch_size=8) as backend:
        fake = SGLangFakeServer(backend, served_model_name="tiny")
        with serve_app_in_thread(fake.app()) as url:
            yield fake, url, folders


def _generate(url: str, adapter: str) -> httpx.Response:
    body = {"input_ids": [[5, 6, 7]], "sampling_params": {"max_new_tokens": 2}, "lora_path": [adapter]}
    return httpx.post(f"{url}/generate", json=body, timeout=30)


def test_the_fake_reloads_an_unloaded_adapter_as_sglang_does(served):
    fake, url, folders = served
    httpx.post(f"{url}/load_lora_adapter", json={"lora_name": V1, "lora_path": folders[V1]}, timeout=30)
    httpx.post(f"{url}/unload_lora_adapter", json={"lora_name": V1}, timeout=30)
    assert _generate(url, V1).status_code == 200  # no error: the version came back
    assert fake.reloaded == [V1]
    assert _generate(url, "never-loaded-v000001").status_code == 400  # a name never loaded is still an error


def test_sglang_engine_never_sends_a_retired_version(served):
    fake, url, folders = served
    with HTTPEngine(SGLANG, url, timeout_s=30, control_timeout_s=30) as engine:
        engine.load_adapter(V1, path=folders[V1])
        engine.load_adapter(V2, path=folders[V2])
        engine.unload_adapter(V1)
        with pytest.raises(EngineError, match=f"LoRA adapter '{V1}' has never been loaded or was unloaded"):
            engine.generate([GenerationRequest([5, 6], V2, GREEDY), GenerationRequest([5, 6, 7], V1, GREEDY)])
        with pytest.raises(EngineError, match="this client retired it"):
            engine.submit(GenerationRequest([5], V1, GREEDY)).result(timeout=30)
        [fresh] = engine.generate([GenerationRequest([5, 6], V2, GREEDY)])
        assert fresh.finish_reason in ("eos", "length") and fresh.adapter == V2
        assert fake.reloaded == [] and V1 not in engine.list_adapters()


def test_a_revived_version_is_noticed_and_retired_again(served):
    fake, url, folders = served
    with HTTPEngine(SGLANG, url, timeout_s=30, control_timeout_s=30) as engine:
        for name in (V1, V2, V3):
            engine.load_adapter(name, path=folders[name])
        assert retire_stale(engine, RUN, keep=2, protect={V3}) == [V1]
        assert _generate(url, V1).status_code == 200  # another client names the retired version
        assert fake.reloaded == [V1]
        assert V1 in engine.list_adapters() and engine.metrics()["revived_adapters"] == 1
        assert retire_stale(engine, RUN, keep=2, protect={V3}) == [V1]  # the next sync retires it again
        assert V1 not in engine.list_adapters()


def test_a_version_this_client_holds_is_not_retired(served):
    """SGLang lists no in-flight counts; the client's own requests in flight stand in, so `retire_stale`
    keeps a version while one of them still runs (SGLang's unload would wait for it)."""
    _, url, folders = served
    with HTTPEngine(SGLANG, url, timeout_s=60, control_timeout_s=30) as engine:
        for name in (V1, V2):
            engine.load_adapter(name, path=folders[name])
        httpx.post(f"{url}/pause_generation", json={"mode": "in_place"}, timeout=30)  # another client pauses
        running = engine.submit(GenerationRequest([5, 6, 7], V1, GREEDY))
        deadline = time.monotonic() + 30
        while engine.list_adapters()[V1]["in_flight"] != 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert engine.list_adapters()[V1]["in_flight"] == 1 and engine.list_adapters()[V2]["in_flight"] == 0
        assert retire_stale(engine, RUN, keep=1, protect={V2}) == []  # V1 is held
        httpx.post(f"{url}/continue_generation", json={}, timeout=30)
        assert running.result(timeout=60).finish_reason in ("eos", "length")
        assert engine.list_adapters()[V1]["in_flight"] == 0
        assert retire_stale(engine, RUN, keep=1, protect={V2}) == [V1]


def test_retire_keep_leaves_the_weights_but_never_serves_the_version_again(served):
    """`retire="keep"` (engine.sglang_retire): no `/unload_lora_adapter` (SGLang 0.5.17's can hang under
    traffic); the version is retired in the client alone and is not listed to the protocol any more."""
    fake, url, folders = served
    with HTTPEngine(SGLANG, url, timeout_s=30, control_timeout_s=30, retire="keep") as engine:
        for name in (V1, V2, V3):
            engine.load_adapter(name, path=folders[name])
        assert retire_stale(engine, RUN, keep=2, protect={V3}) == [V1]
        assert retire_stale(engine, RUN, keep=2, protect={V3}) == []  # once only
        assert sorted(engine.list_adapters()) == [V2, V3] and engine.metrics()["retired_resident"] == 1
        with pytest.raises(EngineError, match="this client retired it"):
            engine.generate([GenerationRequest([5, 6], V1, GREEDY)])
        with pytest.raises(EngineError, match="is not loaded"):
            engine.unload_adapter("ret-v000009")
        assert engine.metrics()["revived_adapters"] == 0
    cards = httpx.get(f"{url}/v1/models", timeout=30).json()["data"]
    assert V1 in {c["id"] for c in cards}  # still resident on the server
    assert fake.reloaded == []


def test_health_while_paused_does_not_wait_for_sglangs_health_generation(served):
    """SGLang's `/health` runs a 1-token generation: while paused it answers 503 only after its 20 s health
    timeout (0.5.17 on the GPU host; the fake waits `health_check_timeout_s`). `SGLangEngine.health()`, which
    `retire_stale` asks before retiring, must not wait for it, or a sync holds up the resume for 20 s."""
    fake, url, folders = served
    with HTTPEngine(SGLANG, url, timeout_s=30, control_timeout_s=30) as engine:
        engine.load_adapter(V1, path=folders[V1])
        engine.load_adapter(V2, path=folders[V2])
        engine.load_adapter(V3, path=folders[V3])
        engine.pause("in_place")
        with pytest.raises(httpx.ReadTimeout):  # the hazard, mirrored by the fake
            httpx.get(f"{url}/health", timeout=1.0)
        start = time.monotonic()
        health = engine.health()
        assert health["ok"] and health["paused"] and time.monotonic() - start < 1.0
        assert retire_stale(engine, RUN, keep=1) == []  # paused: nothing retired, and no 20 s wait
        assert time.monotonic() - start < 2.0
        engine.resume()
        assert engine.health() == {"ok": True, "paused": False, "url": url}
        assert retire_stale(engine, RUN, keep=1) == [V1, V2]
