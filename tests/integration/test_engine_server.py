"""The engine server (SGLang HTTP subset) and its clients, on a tiny random model.

In-process `TestClient` checks the HTTP contract (shapes, errors, auth, metrics); real sockets
(uvicorn in a thread on 127.0.0.1, a free port) check `SGLangEngine`, `ServerEngine` and
`MultiEngine` against the embedded engine they wrap.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager

import pytest
import torch
import uvicorn
from fastapi.testclient import TestClient
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
from safetensors.torch import save as st_save
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from lora_rl_core.adapters import safetensors_bytes
from lora_rl_core.engines import Completion, EmbeddedEngine, GenerationRequest, SamplingParams
from lora_rl_core.engines.multi import MultiEngine
from lora_rl_core.engines.remote import SERVER, SGLANG, HTTPEngine
from lora_rl_core.engines.serve.app import check_bind, create_app
from lora_rl_core.errors import EngineError, LoraRLError
from lora_rl_core.lora import peft_config_dict

pytestmark = pytest.mark.slow  # uvicorn in a thread (and the in-process TestClient app)

SERVED = "tiny"
GREEDY = {"max_new_tokens": 6, "temperature": 0}
GREEDY_P = SamplingParams(max_new_tokens=6, temperature=0.0)


@pytest.fixture(scope="module", autouse=True)
def prefect_harness():
    """No Prefect server is needed here: overrides the package's session-wide harness for this module."""
    yield


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def new_engine(model_dir, tokenizer) -> EmbeddedEngine:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return EmbeddedEngine(model, tokenizer, max_batch_size=16)


@pytest.fixture()
def engine(tiny_model_dir, tok) -> Iterator[EmbeddedEngine]:
    with new_engine(tiny_model_dir, tok) as e:
        yield e


@pytest.fixture()
def client(engine, tok) -> Iterator[TestClient]:
    with TestClient(create_app(engine, served_model_name=SERVED, tokenizer=tok)) as c:
        yield c


@pytest.fixture(scope="module")
def adapters(tiny_model_dir) -> list[tuple[dict, dict]]:
    """Two random LoRA adapters (non-zero A and B, large enough to change greedy tokens)."""
    out = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
        config = LoraConfig(
            r=4, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False
        )
        model = get_peft_model(base, config)
        state = {k: v * 8 for k, v in get_peft_model_state_dict(model).items()}
        out.append((state, peft_config_dict(model.peft_config["default"])))
    return out


def prompts(tok, n: int) -> list[list[int]]:
    return [tok(f"What is {i} + {2 * i}?")["input_ids"][: 3 + i % 5] for i in range(n)]


def save_folder(path, tensors: dict, config: dict):
    path.mkdir()
    save_file(tensors, path / "adapter_model.safetensors")
    (path / "adapter_config.json").write_text(json.dumps(config))
    return path


def tensor_body(name: str, tensors: dict, config: dict) -> dict:
    data = base64.b64encode(st_save(tensors)).decode()
    return {"lora_name": name, "config_dict": config, "serialized_named_tensors": [data], "load_format": "safetensors"}


@contextmanager
def live_server(app) -> Iterator[str]:
    """Serve `app` with uvicorn in a thread on a free 127.0.0.1 port; yields the URL."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 15
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


# ----------------------------------------------------------------- /generate


def test_generate_shapes_single_batch_n_and_text(client, tok):
    p = prompts(tok, 2)
    single = client.post("/generate", json={"input_ids": p[0], "sampling_params": GREEDY}).json()
    meta = single["meta_info"]
    assert meta["finish_reason"]["type"] in ("stop", "length") and meta["weight_version"] is None
    assert meta["prompt_tokens"] == len(p[0]) and meta["completion_tokens"] == len(single["output_ids"])
    assert isinstance(single["text"], str) and "output_token_logprobs" not in meta

    batch = client.post("/generate", json={"input_ids": p, "sampling_params": GREEDY, "return_logprob": True}).json()
    assert isinstance(batch, list) and len(batch) == 2 and batch[0]["output_ids"] == single["output_ids"]
    triples = batch[1]["meta_info"]["output_token_logprobs"]
    assert [t[1] for t in triples] == batch[1]["output_ids"] and all(t[0] <= 0 and t[2] is None for t in triples)

    sampled = {"max_new_tokens": 4, "temperature": 1.0, "n": 3, "sampling_seed": 7}
    many = client.post("/generate", json={"input_ids": p[0], "sampling_params": sampled}).json()
    assert isinstance(many, list) and len(many) == 3
    grid = client.post("/generate", json={"input_ids": p, "sampling_params": {**sampled, "n": 2}}).json()
    assert [o["meta_info"]["prompt_tokens"] for o in grid] == [len(p[0])] * 2 + [len(p[1])] * 2  # prompt-major

    text = client.post("/generate", json={"text": "What is 1 + 2?", "sampling_params": GREEDY}).json()
    assert text["meta_info"]["prompt_tokens"] == len(tok("What is 1 + 2?")["input_ids"])


def test_lora_path_list_mixes_adapters_and_base(client, engine, tok, adapters):
    engine.load_adapter("run-v000001", tensors=adapters[0][0], config=adapters[0][1])
    ps = prompts(tok, 3)
    body = {
        "input_ids": [ps[i // 2] for i in range(6)],
        "lora_path": ["run-v000001", None] * 3,
        "sampling_params": GREEDY,
    }
    outs = client.post("/generate", json=body).json()
    pairs = zip(body["input_ids"], body["lora_path"], strict=True)
    expected = engine.generate([GenerationRequest(ids, a, GREEDY_P) for ids, a in pairs])
    assert [o["output_ids"] for o in outs] == [c.completion_ids for c in expected]
    assert [o["meta_info"]["weight_version"] for o in outs] == [1, None] * 3
    assert any(outs[2 * i]["output_ids"] != outs[2 * i + 1]["output_ids"] for i in range(3))


def test_unknown_adapter_gets_sglang_error_not_base_output(client, tok):
    r = client.post("/generate", json={"input_ids": prompts(tok, 1)[0], "lora_path": "ghost-v000001"})
    assert r.status_code == 400
    assert set(r.json()) == {"error"} and "ghost-v000001" in r.json()["error"]["message"]


def test_stream_and_malformed_requests_get_400(client):
    cases = [
        ({"input_ids": [5, 6], "stream": True}, "stream"),
        ({"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2, "stop": ["x", ""]}}, "stop"),
        ({"input_ids": [5, 6], "sampling_params": {"stop_token_ids": [-1]}}, "stop_token_ids"),
        ({"input_ids": [5, 6], "sampling_params": {"stop_regex": "x"}}, "stop_regex"),
        ({"input_ids": [5, 6], "text": "hi"}, "exactly one"),
        ({"input_ids": [[5, 6], [7]], "lora_path": [None]}, "lora_path"),
        ({"input_ids": [5, 6], "sampling_params": {"temperature": -1}}, "temperature"),
    ]
    for body, words in cases:
        r = client.post("/generate", json=body)
        assert r.status_code == 400 and words in r.json()["error"]["message"], (body, r.text)


# ----------------------------------------------------------------- adapters


def test_load_and_unload_by_path(client, tok, adapters, tmp_path):
    folder = save_folder(tmp_path / "a1", *adapters[0])
    load = {"lora_name": "run-v000001", "lora_path": str(folder)}
    r = client.post("/load_lora_adapter", json=load)
    assert r.status_code == 200
    assert r.json() == {"success": True, "error_message": None, "loaded_adapters": {"run-v000001": str(folder)}}
    base_card, card, alias = client.get("/v1/models").json()["data"]
    assert base_card["id"] == SERVED and base_card["parent"] is None
    assert (card["id"], card["root"], card["parent"], card["version"]) == ("run-v000001", str(folder), SERVED, 1)
    assert (alias["id"], alias["alias_of"], alias["version"]) == ("run@latest", "run-v000001", 1)
    assert card["sha256"] == hashlib.sha256((folder / "adapter_model.safetensors").read_bytes()).hexdigest()

    again = client.post("/load_lora_adapter", json=load)
    assert again.status_code == 400 and again.json()["success"] is False and "already" in again.json()["error_message"]
    generate = {"input_ids": prompts(tok, 1)[0], "lora_path": "run-v000001", "sampling_params": GREEDY}
    assert client.post("/generate", json=generate).json()["meta_info"]["weight_version"] == 1
    r = client.post("/unload_lora_adapter", json={"lora_name": "run-v000001"})
    assert r.status_code == 200 and r.json()["loaded_adapters"] == {}
    assert client.post("/generate", json=generate).status_code == 400


def test_load_from_safetensors_bytes_equals_load_from_folder(client, tok, adapters, tmp_path):
    tensors, config = adapters[1]
    body = tensor_body("run-v000002", tensors, config)
    r = client.post("/load_lora_adapter_from_tensors", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["loaded_adapters"] == {"run-v000002": "__tensor__"}
    card = client.get("/v1/models").json()["data"][1]
    assert card["sha256"] == hashlib.sha256(base64.b64decode(body["serialized_named_tensors"][0])).hexdigest()
    folder = save_folder(tmp_path / "a2", tensors, config)
    assert client.post("/load_lora_adapter", json={"lora_name": "ref-v000002", "lora_path": str(folder)}).is_success
    outs = [
        client.post("/generate", json={"input_ids": prompts(tok, 3), "lora_path": n, "sampling_params": GREEDY}).json()
        for n in ("run-v000002", "ref-v000002")
    ]
    assert [o["output_ids"] for o in outs[0]] == [o["output_ids"] for o in outs[1]]


@pytest.mark.parametrize("load_format", [None, "flattened_bucket", "pickle"])
def test_pickle_payloads_are_refused(client, load_format):
    body = {"lora_name": "run-v000003", "config_dict": {"r": 4}, "serialized_named_tensors": ["gASVAQAAAAAAAABLAS4="]}
    if load_format is not None:
        body["load_format"] = load_format
    r = client.post("/load_lora_adapter_from_tensors", json=body)
    assert r.status_code == 400 and r.json()["success"] is False
    assert "pickle" in r.json()["error"]["message"]


def test_garbage_safetensors_bytes_are_refused(client):
    body = {"lora_name": "run-v000003", "config_dict": {"r": 4}, "load_format": "safetensors"}
    r = client.post(
        "/load_lora_adapter_from_tensors", json={**body, "serialized_named_tensors": ["bm90IHNhZmV0ZW5zb3Jz"]}
    )
    assert r.status_code == 400 and "safetensors" in r.json()["error"]["message"]


def test_bad_adapters_are_rejected_and_active_keeps_serving(client, tok, adapters, tmp_path):
    tensors, config = adapters[0]
    good = save_folder(tmp_path / "good", tensors, config)
    assert client.post("/load_lora_adapter", json={"lora_name": "run-v000001", "lora_path": str(good)}).is_success
    request = {"input_ids": prompts(tok, 2), "lora_path": "run-v000001", "sampling_params": GREEDY}
    before = [o["output_ids"] for o in client.post("/generate", json=request).json()]

    nan = {k: torch.full_like(v, float("nan")) for k, v in tensors.items()}
    wrong = {k: torch.zeros(v.shape[0] + 1, v.shape[1]) for k, v in tensors.items()}
    for name, bad in (("run-v000002", nan), ("run-v000003", wrong)):
        r = client.post("/load_lora_adapter_from_tensors", json=tensor_body(name, bad, config))
        assert r.status_code == 400 and r.json()["error"]["message"], r.text
    missing = {"lora_name": "run-v000004", "lora_path": str(tmp_path / "missing")}
    assert client.post("/load_lora_adapter", json=missing).status_code == 400
    evil = client.post("/load_lora_adapter", json={"lora_name": "../evil", "lora_path": str(good)})
    assert evil.status_code == 400 and "bad adapter name" in evil.json()["error"]["message"]

    assert [c["id"] for c in client.get("/v1/models").json()["data"]] == [SERVED, "run-v000001", "run@latest"]
    assert [o["output_ids"] for o in client.post("/generate", json=request).json()] == before


# ----------------------------------------------------------------- control, info, metrics


def test_pause_continue_and_bad_mode(client):
    assert client.post("/pause_generation", json={"mode": "in_place"}).json()["status"] == "ok"
    assert client.get("/health").json()["paused"] is True
    assert client.get("/paused").json() == {"paused": True}
    r = client.post("/pause_generation", json={"mode": "sideways"})
    assert r.status_code == 400 and "mode" in r.json()["error"]["message"]
    assert client.post("/continue_generation", json={}).status_code == 200
    assert client.get("/health").json()["paused"] is False
    assert client.get("/paused").json() == {"paused": False}


def test_health_generate_and_model_info(client):
    assert client.get("/health").status_code == 200
    assert client.get("/health_generate").status_code == 200
    info = client.get("/model_info").json()
    assert info["is_generation"] is True and info["model_path"] == SERVED
    assert client.get("/get_model_info").json() == info


def test_metrics_in_prometheus_format(client, engine, tok, adapters):
    engine.load_adapter("run-v000001", tensors=adapters[0][0], config=adapters[0][1])
    client.post("/generate", json={"input_ids": prompts(tok, 2), "lora_path": "run-v000001", "sampling_params": GREEDY})
    assert client.post("/load_lora_adapter_from_tensors", json=tensor_body("run-v000002", *adapters[1])).is_success
    r = client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    requests = re.search(r'^lora_rl_adapter_requests_total\{adapter="run-v000001"\} (\S+)$', r.text, re.M)
    assert requests and float(requests[1]) == 2
    assert re.search(r'^lora_rl_adapter_tokens_total\{adapter="run-v000001"\} \d', r.text, re.M)
    assert 'lora_rl_adapter_load_latency_seconds_count{source="tensors"} 1.0' in r.text
    assert re.search(r'^lora_rl_active_version\{run="run"\} 2\.0$', r.text, re.M)


def test_api_key_guards_control_endpoints_only(engine, tok, adapters, tmp_path):
    folder = save_folder(tmp_path / "a1", *adapters[0])
    load = {"lora_name": "run-v000001", "lora_path": str(folder)}
    with TestClient(create_app(engine, served_model_name=SERVED, tokenizer=tok, api_key="s3cret")) as c:
        assert c.post("/load_lora_adapter", json=load).status_code == 401
        assert c.post("/load_lora_adapter", json=load, headers={"Authorization": "Bearer nope"}).status_code == 401
        control = [
            ("/load_lora_adapter_from_tensors", tensor_body("run-v000002", *adapters[1])),
            ("/unload_lora_adapter", {"lora_name": "run-v000001"}),
            ("/pause_generation", {"mode": "in_place"}),
            ("/continue_generation", {}),
            ("/flush_cache", None),
            ("/abort_request", {"abort_all": True}),
        ]
        for path, body in control:
            r = c.post(path, json=body)
            assert r.status_code == 401 and "Bearer" in r.json()["error"]["message"], path
        assert c.post("/load_lora_adapter", json=load, headers={"Authorization": "Bearer s3cret"}).status_code == 200
        generate = {"input_ids": [5, 6], "lora_path": "run-v000001", "sampling_params": GREEDY}
        assert c.post("/generate", json=generate).status_code == 200  # the data plane stays open
        assert c.get("/v1/models").status_code == 200 and c.get("/metrics").status_code == 200


def test_serve_refuses_a_public_bind_without_a_key():
    for host in ("127.0.0.1", "localhost", "::1"):
        check_bind(host, None)
    check_bind("0.0.0.0", "k")
    for host in ("0.0.0.0", "10.1.2.3", "example.org"):
        with pytest.raises(LoraRLError, match="--api-key"):
            check_bind(host, None)


# ----------------------------------------------------------------- submit/abort plumbing


class ScriptedEngine:
    """An engine with `submit`/`abort` whose requests finish only when aborted (no model)."""

    def __init__(self) -> None:
        self.futures: dict[str, tuple[GenerationRequest, Future]] = {}
        self.submitted = threading.Event()

    def submit(self, request: GenerationRequest) -> Future:
        future: Future = Future()
        self.futures[request.request_id] = (request, future)
        self.submitted.set()
        return future

    def abort(self, request_id: str | None = None, *, reason: str = "aborted") -> int:
        ids = list(self.futures) if request_id is None else [i for i in self.futures if i == request_id]
        for i in ids:
            request, future = self.futures.pop(i)
            fields = {"request_id": i, "prompt_ids": request.prompt_ids, "completion_ids": [], "logprobs": []}
            fields.update(finish_reason="abort", adapter=request.adapter, adapter_version=None, abort_reason=reason)
            future.set_result(Completion(**fields))
        return len(ids)

    def list_adapters(self) -> dict:
        return {}

    def is_paused(self) -> bool:
        return False

    def health(self) -> dict:
        return {"ok": True, "paused": False}

    def metrics(self) -> dict:
        return {}


def test_abort_request_reaches_submitted_requests():
    engine = ScriptedEngine()
    with (
        live_server(create_app(engine, served_model_name=SERVED)) as url,
        HTTPEngine(SGLANG, url, timeout_s=30, abort="forward") as client,
    ):
        future = client.submit(GenerationRequest([5, 6, 7], None, GREEDY_P, request_id="r1"))
        assert engine.submitted.wait(10)
        assert client.abort("r1") == 1
        done = future.result(timeout=10)
        assert (done.request_id, done.finish_reason, done.abort_reason) == ("r1", "abort", "aborted")
        assert done.completion_ids == [] and engine.futures == {}


def test_generation_deadline_answers_aborted_completions():
    engine = ScriptedEngine()
    with TestClient(create_app(engine, served_model_name=SERVED, request_timeout_s=0.3)) as c:
        r = c.post("/generate", json={"input_ids": [[5, 6], [7]]})
    assert r.status_code == 200
    assert [o["meta_info"]["finish_reason"] for o in r.json()] == [{"type": "abort", "message": "timeout"}] * 2
    assert engine.futures == {}


# ----------------------------------------------------------------- HTTP clients over real sockets


def test_http_clients_match_the_embedded_engine(engine, tok, adapters, tmp_path):
    tensors, config = adapters[0]
    app = create_app(engine, served_model_name=SERVED, tokenizer=tok)
    with (
        live_server(app) as url,
        HTTPEngine(SERVER, url, timeout_s=60) as server,
        HTTPEngine(SGLANG, url, timeout_s=60) as sglang,
    ):
        server.load_adapter("run-v000001", tensors=tensors, config=config)  # same-host tensor path
        assert server.list_adapters()["run-v000001"]["sha256"] == hashlib.sha256(safetensors_bytes(tensors)).hexdigest()
        requests = [GenerationRequest(p, a, GREEDY_P) for p in prompts(tok, 4) for a in ("run-v000001", None)]
        expected = engine.generate(requests)
        for client in (server, sglang):
            got = client.generate(requests)
            assert [c.completion_ids for c in got] == [c.completion_ids for c in expected]
            assert [(c.request_id, c.adapter, c.adapter_version) for c in got] == [
                (c.request_id, c.adapter, c.adapter_version) for c in expected
            ]
            assert [c.finish_reason for c in got] == [c.finish_reason for c in expected]
            for g, e in zip(got, expected, strict=True):
                assert g.logprobs == pytest.approx(e.logprobs, abs=1e-4)
        assert server.metrics()["adapters"]["run-v000001"]["requests"] >= 8

        with pytest.raises(EngineError, match="ghost-v000001"):
            sglang.generate([GenerationRequest([5, 6], "ghost-v000001", GREEDY_P)])
        with pytest.raises(EngineError, match="pickle payloads .* are never deserialised"):
            sglang.load_adapter("run-v000002", tensors=tensors, config=config)  # SGLang pickles: our server refuses
        with pytest.raises(EngineError, match="local folder"):
            sglang.load_adapter("run-v000002", path="s3://bucket/run/adapters/v000002")
        folder = save_folder(tmp_path / "a2", *adapters[1])
        sglang.load_adapter("run-v000002", path=f"file://{folder}")  # file:// becomes a local path
        assert sglang.list_adapters()["run-v000002"]["path"] == str(folder)

        server.unload_adapter("run-v000001")
        sglang.unload_adapter("run-v000002")
        assert server.list_adapters() == {} and server.health()["ok"] is True
        sglang.pause("in_place")
        assert sglang.health()["paused"] is True and server.health()["paused"] is True
        sglang.resume()


def test_multi_engine_spreads_prompts_and_broadcasts_loads(engine, tiny_model_dir, tok, adapters):
    tensors, config = adapters[0]
    with new_engine(tiny_model_dir, tok) as other, live_server(create_app(other, served_model_name=SERVED)) as url:
        with HTTPEngine(SERVER, url, timeout_s=60) as remote:
            multi = MultiEngine([engine, remote])
            multi.load_adapter("run-v000001", tensors=tensors, config=config)
            assert "run-v000001" in engine.list_adapters() and "run-v000001" in other.list_adapters()
            requests = [GenerationRequest(p, "run-v000001", GREEDY_P) for p in prompts(tok, 6) for _ in range(2)]
            got = multi.generate(requests)
            local, remote_count = served(engine, "run-v000001"), served(other, "run-v000001")
            assert local > 0 and remote_count > 0 and local + remote_count == len(requests)
            assert local % 2 == 0  # both samples of a prompt stay on one engine
            assert [c.completion_ids for c in got] == [c.completion_ids for c in engine.generate(requests)]
            multi.unload_adapter("run-v000001")
            assert engine.list_adapters() == {} and other.list_adapters() == {}


def served(engine: EmbeddedEngine, adapter: str) -> int:
    """Completions the engine served for `adapter`."""
    return int(engine.metrics()["adapters"][adapter]["requests"])


# ----------------------------------------------------------------- CLI


def test_subscribe_cli_syncs_store_versions_over_http(engine, tok, adapters, tmp_path):
    from typer.testing import CliRunner

    from cli.main import app as cli
    from lora_rl_core.store import AdapterStore

    store = AdapterStore(f"file://{tmp_path}/store")
    refs = [
        store.publish("cli", v, tensors=t, adapter_config=c, step=v, base_model=SERVED)
        for v, (t, c) in enumerate(adapters, start=1)
    ]
    with live_server(create_app(engine, served_model_name=SERVED, tokenizer=tok)) as url:
        args = ["subscribe", "--store", store.uri, "--run", "cli", "--engine", url, "--max-seconds", "1"]
        result = CliRunner().invoke(cli, [*args, "--poll-interval", "0.2", "--keep", "2"])
        assert result.exit_code == 0, result.output
        assert "synced cli-v000002" in result.output and "active: cli-v000002" in result.output
        with HTTPEngine(SERVER, url) as server:  # the store path, checked against the server's sha256
            listed = server.list_adapters()
    assert {name: info["sha256"] for name, info in listed.items()} == {ref.name: ref.sha256 for ref in refs}


def test_serve_cli_refuses_a_public_bind_without_a_key():
    from typer.testing import CliRunner

    from cli.main import app as cli

    result = CliRunner().invoke(cli, ["serve", "model.name_or_path=nowhere", "--host", "0.0.0.0"])
    assert isinstance(result.exception, LoraRLError)  # `lora-rl` prints it as one `lora-rl: error:` line, exit 2
    assert "refusing to bind '0.0.0.0' without --api-key" in str(result.exception)
