"""`SGLangEngine` and `engine.launch` against a real SGLang server (GPU host only; skipped elsewhere).

Needs: a CUDA GPU; `LORA_RL_SGLANG_MODEL` (a model folder SGLang can load, e.g. SmolLM2-135M shapes);
`LORA_RL_SGLANG_PYTHONPATH` (where `sglang` imports from for the server process, if not this one's);
optionally `LORA_RL_SGLANG_REPORT` (a JSON file that receives what was observed, for the closing note).
The server is started once for the module by `launch_sglang`, with the flags `engine.launch` renders.

What is checked: per-row adapters and the versions completions record; an unknown adapter is an error;
loading from a store version's folder and from tensors (CUDA IPC and inline, equal outputs); SGLang's
silent reload of an unloaded adapter (the hazard), that our client never sends a retired name, and that a
revived version is noticed and retired again; that a tensor-loaded version cannot be revived; abort, pause.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path

import httpx
import pytest
import torch

from lora_rl_core.config import config_from_dict, sglang_section
from lora_rl_core.engines import GenerationRequest, SamplingParams
from lora_rl_core.engines.launch.process import launch_sglang
from lora_rl_core.engines.remote import SGLANG, HTTPEngine
from lora_rl_core.errors import EngineError
from lora_rl_core.store import AdapterStore
from lora_rl_core.subscriber import retire_stale
from lora_rl_testing.adapters import random_lora_factory

MODEL = os.environ.get("LORA_RL_SGLANG_MODEL")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (MODEL and torch.cuda.is_available()), reason="needs a GPU and LORA_RL_SGLANG_MODEL"),
]
RUN = "real"
GREEDY = SamplingParams(max_new_tokens=8, temperature=0.0)
OBSERVED: dict[str, object] = {}


@pytest.fixture(scope="module", autouse=True)
def report():
    yield OBSERVED
    path = os.environ.get("LORA_RL_SGLANG_REPORT")
    if path:
        Path(path).write_text(json.dumps(OBSERVED, indent=1, default=str))


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> AdapterStore:
    """A local store with versions 1..3 of run `real`: random rank-8 LoRA on q_proj/v_proj of the model."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32)
    make = random_lora_factory(model, rank=8, scale=0.05)
    store = AdapterStore(f"file://{tmp_path_factory.mktemp('store')}")
    for version in (1, 2, 3):
        tensors, config = make(version)
        store.publish(RUN, version, tensors=tensors, adapter_config=config, step=version, base_model=MODEL)
    return store


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    launch = {"enabled": True, "port": 30000, "cuda_graph_max_bs": None, "startup_timeout_s": 540}
    launch["mem_fraction_static"] = 0.15  # leaves the GPU to a run beside it; a 135M model needs little KV cache
    if os.environ.get("LORA_RL_SGLANG_PYTHONPATH"):
        launch["env"] = {"PYTHONPATH": os.environ["LORA_RL_SGLANG_PYTHONPATH"]}
    cfg = config_from_dict(
        {
            "model": {"name_or_path": MODEL, "dtype": "bfloat16"},
            "lora": {"rank": 8, "target_modules": ["q_proj", "v_proj"]},
            "engine": {"type": "sglang", "sync": "store", "max_loras_per_batch": 4, "launch": launch},
        }
    )
    log = tmp_path_factory.mktemp("sglang") / "server.log"
    start = time.monotonic()
    server = launch_sglang(sglang_section(cfg.engine, "this test"), cfg.model, cfg.lora, log)
    OBSERVED["launch_seconds"] = round(time.monotonic() - start, 1)
    OBSERVED["argv"] = server.argv
    try:
        yield server.url
    finally:
        server.stop()
        OBSERVED["server_log_tail"] = server.log_tail(60)


def _name(version: int) -> str:
    return f"{RUN}-v{version:06d}"


def test_rows_name_their_adapters_and_completions_record_versions(url, store):
    with HTTPEngine(SGLANG, url, timeout_s=120) as engine:
        engine.load_adapter(_name(1), path=store.ref(RUN, 1).uri)
        engine.load_adapter(_name(2), path=store.ref(RUN, 2).uri)
        rows = [(p, a) for p in ([1, 2, 3, 4], [5, 6, 7]) for a in (None, _name(1), _name(2))]
        out = engine.generate([GenerationRequest(p, a, GREEDY) for p, a in rows])
        assert [(c.adapter, c.adapter_version) for c in out] == [
            (a, None if a is None else int(a[-6:])) for _, a in rows
        ]
        assert all(len(c.logprobs) == len(c.completion_ids) > 0 for c in out)
        OBSERVED["listed"] = engine.list_adapters()
        OBSERVED["mixed_batch_outputs_differ"] = len({tuple(c.completion_ids) for c in out[:3]}) > 1
        with pytest.raises(EngineError) as unknown:
            engine.generate([GenerationRequest([1, 2], "ghost-v000001", GREEDY)])
        OBSERVED["unknown_adapter_error"] = str(unknown.value)


@pytest.mark.parametrize("transport", ["ipc", "inline", "file"])
def test_tensor_loads_generate_what_the_folder_generates(url, store, transport):
    """Version 2 sent as tensors (CUDA IPC handles, the data inline, or a folder written for the load and removed
    after it) equals version 2 read from its folder; a tensor-loaded version that was unloaded cannot be
    reloaded by a request naming it (`file`: its folder is gone)."""
    tensors, config = store.load_tensors(RUN, 2)
    name = f"{transport}-v000002"
    prompts = [[1, 2, 3, 4], [5, 6, 7], [9, 9, 2, 4, 1]]
    with HTTPEngine(SGLANG, url, timeout_s=120, tensor_transport=transport) as engine:
        start = time.perf_counter()
        engine.load_adapter(name, tensors=tensors, config=config)
        seconds = time.perf_counter() - start
        listed = engine.list_adapters()
        out = engine.generate([GenerationRequest(p, a, GREEDY) for p in prompts for a in (name, _name(2))])
        assert engine.metrics()["adapter_loads"] == {transport: 1}
        engine.unload_adapter(name)
    pairs = [(out[i].completion_ids, out[i + 1].completion_ids) for i in range(0, len(out), 2)]
    body = {"input_ids": [[1, 2, 3]], "sampling_params": {"max_new_tokens": 4}, "lora_path": [name]}
    raw = httpx.post(f"{url}/generate", json=body, timeout=120)  # another client names the unloaded version
    OBSERVED[f"tensor_{transport}"] = {
        "load_seconds": round(seconds, 3),
        "root": listed[name].get("path"),
        "equal_to_folder": [a == b for a, b in pairs],
        "raw_generate_after_unload": {"status": raw.status_code, "body": raw.text[:400]},
    }
    root = listed[name]["path"]
    assert all(a == b for a, b in pairs)
    assert (
        root == "__tensor__"
        if transport != "file"
        else (root.startswith(tempfile.gettempdir()) and not os.path.exists(root))
    )
    assert raw.status_code == 400 and f"Failed to implicitly load LoRA adapter {name}" in raw.text


def test_an_unloaded_adapter_is_reloaded_by_sglang_but_never_by_our_client(url, store):
    with HTTPEngine(SGLANG, url, timeout_s=120) as engine:
        engine.load_adapter(_name(3), path=store.ref(RUN, 3).uri)
        engine.unload_adapter(_name(1))
        with pytest.raises(EngineError, match="this client retired it"):
            engine.generate([GenerationRequest([1, 2, 3], _name(1), GREEDY)])
        assert _name(1) not in engine.list_adapters()
        body = {"input_ids": [[1, 2, 3]], "sampling_params": {"max_new_tokens": 4}, "lora_path": [_name(1)]}
        raw = httpx.post(f"{url}/generate", json=body, timeout=120)  # another client names the retired version
        OBSERVED["raw_generate_of_unloaded_adapter"] = {"status": raw.status_code, "body": raw.text[:400]}
        listed = engine.list_adapters()
        OBSERVED["listed_after_raw_generate"] = sorted(listed)
        assert raw.status_code == 200 and _name(1) in listed  # SGLang 0.5.17 brought it back
        assert engine.metrics()["revived_adapters"] == 1  # noticed, and retired again by the next sync
        assert retire_stale(engine, RUN, keep=2, protect={_name(3)}) == [_name(1)]
        assert _name(1) not in engine.list_adapters()


def test_abort_and_pause(url, store):
    with HTTPEngine(SGLANG, url, timeout_s=120) as engine:
        long = SamplingParams(max_new_tokens=2000, temperature=1.0, seed=1)
        future = engine.submit(GenerationRequest([1, 2, 3], _name(2), long))
        time.sleep(0.5)
        engine.abort(None, reason="aborted")
        done = future.result(timeout=120)
        OBSERVED["abort_all"] = {"finish_reason": done.finish_reason, "abort_reason": done.abort_reason}
        assert done.finish_reason in ("abort", "length", "stop")
        engine.pause("in_place")
        engine.resume()
        [after] = engine.generate([GenerationRequest([1, 2, 3], _name(2), GREEDY)])
        assert after.finish_reason in ("stop", "length")


def test_connect_asks_a_real_sglang_its_version_and_refuses_one_it_does_not_know(url):
    """`connect` reads `version` from the real server's `/server_info`: the carried SGLang is in the client's
    range, and a dialect that knows another range refuses it in one line naming it."""
    import dataclasses

    from lora_rl_core.engines.records import EngineInputs
    from lora_rl_core.engines.remote.connect import connect

    cfg = config_from_dict({"engine": {"type": "sglang", "urls": [url]}})
    with connect(SGLANG, EngineInputs(cfg.engine)) as built:
        version = built.engine.server_version()
    OBSERVED["server_version"] = version
    assert version is not None
    SGLANG.check_version(version, url)
    with pytest.raises(EngineError, match=rf"^SGLang {version} at {url} is not a version this client knows \(>=9"):
        connect(dataclasses.replace(SGLANG, versions=">=9"), EngineInputs(cfg.engine))
