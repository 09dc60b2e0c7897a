"""Adapter tensors into an SGLang server (`/load_lora_adapter_from_tensors`), against the fake.

SGLang 0.5.17 takes base64 torch pickles there (docs/SGLANG.md, "Tensor path"). On CPU the fake can open
only pickles with the data in them (`inline`); CUDA IPC payloads run in `tests/gpu/test_real_sglang.py`.
These tests check that an adapter sent as tensors generates exactly what the same adapter loaded from its
folder generates, how `auto` picks a transport, that a refused tensor load falls back to the published
folder, and that a version loaded from tensors cannot come back after it was unloaded.
"""

from __future__ import annotations

import base64
import json
import pickle
import tempfile

import httpx
import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from lora_rl_core.engines import EmbeddedEngine, GenerationRequest, SamplingParams
from lora_rl_core.engines.remote import SGLANG, HTTPEngine
from lora_rl_core.errors import EngineError
from lora_rl_testing.adapters import random_lora_factory
from lora_rl_testing.servers import serve_app_in_thread
from lora_rl_testing.sglang_fake import SGLangFakeServer

pytestmark = pytest.mark.slow  # uvicorn in a thread

PROMPTS = [[5, 6, 7], [9, 4], [3, 3, 8, 1]]
GREEDY = SamplingParams(max_new_tokens=6, temperature=0.0)


@pytest.fixture(scope="module", autouse=True)
def prefect_harness():
    """No Prefect server is needed here: overrides the package's session-wide harness for this module."""
    yield


@pytest.fixture
def served(tiny_model_dir, tmp_path):
    """(fake SGLang URL, adapter tensors, config, the same adapter's PEFT folder) on the tiny model."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    tensors, config = random_lora_factory(model, scale=1.0)(1)
    folder = tmp_path / "a-v000001"
    folder.mkdir()
    save_file(tensors, folder / "adapter_model.safetensors")
    (folder / "adapter_config.json").write_text(json.dumps(config))
    with EmbeddedEngine(model, AutoTokenizer.from_pretrained(tiny_model_dir), max_batch_size=8) as backend:
        fake = SGLangFakeServer(backend, served_model_name="tiny")
        with serve_app_in_thread(fake.app()) as url:
            yield url, tensors, config, str(folder)


def _tokens(engine: HTTPEngine, adapter: str | None) -> list[list[int]]:
    return [c.completion_ids for c in engine.generate([GenerationRequest(p, adapter, GREEDY) for p in PROMPTS])]


def test_inline_tensors_generate_what_the_folder_generates(served):
    url, tensors, config, folder = served
    with HTTPEngine(SGLANG, url, timeout_s=30, control_timeout_s=30, tensor_transport="inline") as engine:
        engine.load_adapter("a-v000001", path=folder)
        engine.load_adapter("t-v000001", tensors=tensors, config=config, path=folder)
        from_folder, from_tensors, base = (
            _tokens(engine, "a-v000001"),
            _tokens(engine, "t-v000001"),
            _tokens(engine, None),
        )
        listed = engine.list_adapters()
        loads = engine.metrics()["adapter_loads"]
    assert from_tensors == from_folder and from_tensors != base  # the adapter changes the output
    assert listed["t-v000001"]["path"] == "__tensor__" and listed["a-v000001"]["path"] == folder
    assert loads == {"disk": 1, "inline": 1}


def test_file_transport_loads_a_folder_written_for_the_load_and_removes_it(served, tmp_path, monkeypatch):
    """`file` (SGLang on another GPU of this host): no wait for the store, nothing left on disk."""
    url, tensors, config, folder = served
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    with HTTPEngine(SGLANG, url, timeout_s=30, control_timeout_s=30, tensor_transport="file") as engine:
        engine.load_adapter("a-v000001", path=folder)
        engine.load_adapter("f-v000001", tensors=tensors, config=config)  # no published folder needed
        same = _tokens(engine, "f-v000001") == _tokens(engine, "a-v000001")
        loads = engine.metrics()["adapter_loads"]
    assert same and loads == {"disk": 1, "file": 1}
    assert list(scratch.iterdir()) == []  # removed once the server had read it
    remote = HTTPEngine(SGLANG, "http://10.0.0.9:30000", timeout_s=5, tensor_transport="file")
    with remote, pytest.raises(EngineError, match="not on this host.*'inline' or 'disk'"):
        remote.load_adapter("f-v000002", tensors=tensors, config=config, path=folder)  # a setting: no fallback
    assert list(scratch.iterdir()) == []


def test_auto_on_cpu_loads_the_published_folder_or_else_inline(served):
    url, tensors, config, folder = served
    with HTTPEngine(SGLANG, url, timeout_s=30, control_timeout_s=30) as engine:  # auto, no CUDA in this process
        engine.load_adapter("a-v000001", tensors=tensors, config=config, path=folder)
        engine.load_adapter("a-v000002", tensors=tensors, config=config)
        listed = engine.list_adapters()
        assert engine.metrics()["adapter_loads"] == {"disk": 1, "inline": 1}
    assert listed["a-v000001"]["path"] == folder and listed["a-v000002"]["path"] == "__tensor__"


def test_a_refused_tensor_load_falls_back_to_the_folder_for_good(served):
    url, tensors, config, folder = served
    bad = {k: v[:, :1] if "lora_A" in k else v for k, v in tensors.items()}  # rank 1 A against rank-r B
    with HTTPEngine(SGLANG, url, timeout_s=30, control_timeout_s=30, tensor_transport="inline") as engine:
        engine.load_adapter("a-v000001", tensors=bad, config=config, path=folder)
        why = engine.metrics()["tensor_fallback"]
        engine.load_adapter("a-v000002", tensors=tensors, config=config, path=folder)  # straight to the folder
        assert engine.metrics()["adapter_loads"] == {"disk": 2}
        assert _tokens(engine, "a-v000001") == _tokens(engine, "a-v000002")
        with pytest.raises(EngineError, match="no published folder"):
            engine.load_adapter("a-v000003", tensors=tensors, config=config)
    assert why.startswith("inline: ") and "a-v000001" not in why.split(":", 1)[0]


def test_tensors_without_a_config_or_cuda_are_refused_with_the_fix(served):
    url, tensors, config, folder = served
    with HTTPEngine(SGLANG, url, timeout_s=30, control_timeout_s=30, tensor_transport="ipc") as engine:
        with pytest.raises(EngineError, match="needs config="):
            engine.load_adapter("a-v000001", tensors=tensors)
        if not torch.cuda.is_available():
            with pytest.raises(EngineError, match="'ipc' needs CUDA in this process; use 'inline' or 'disk'"):
                engine.load_adapter("a-v000001", tensors=tensors, config=config)
            assert "a-v000001" not in engine.list_adapters()


def test_an_unloaded_tensor_version_cannot_come_back(served):
    url, tensors, config, _ = served
    payload = base64.b64encode(pickle.dumps({k: v.clone() for k, v in tensors.items()})).decode()
    body = {"lora_name": "t-v000001", "config_dict": config, "serialized_named_tensors": [payload]}
    assert httpx.post(f"{url}/load_lora_adapter_from_tensors", json=body, timeout=30).json()["success"] is True
    httpx.post(f"{url}/unload_lora_adapter", json={"lora_name": "t-v000001"}, timeout=30)
    gen = {"input_ids": [[5, 6]], "sampling_params": {"max_new_tokens": 2}, "lora_path": ["t-v000001"]}
    answer = httpx.post(f"{url}/generate", json=gen, timeout=30)
    assert answer.status_code == 400 and "Failed to implicitly load LoRA adapter t-v000001" in answer.text


def test_the_fake_refuses_pickles_outside_the_allow_list(served):
    url, _, config, _ = served
    payload = base64.b64encode(pickle.dumps({"x": print})).decode()  # builtins.print is allowed, not a tensor
    evil = base64.b64encode(b"cos\nsystem\n(S'true'\ntR.").decode()  # os.system: blocked
    for p in (payload, evil):
        body = {"lora_name": "e-v000001", "config_dict": config, "serialized_named_tensors": [p]}
        answer = httpx.post(f"{url}/load_lora_adapter_from_tensors", json=body, timeout=30)
        assert answer.status_code == 400 and answer.json()["success"] is False
