"""`lora-rl serve` following a run: `RUN@latest` / `RUN@N` / `RUN@TAG` in `/generate` and the OpenAI endpoints
(`/v1/completions`, `/v1/chat/completions`, `/v1/models`), on a tiny random model with a file:// store.

The subscriber talks to the server over HTTP (`open_subscriber`), as `lora-rl subscribe` does, so the
`/v1/models` alias cards also go through our client. The OpenAI client test needs the `openai` package
(a dev dependency); the schema tests use the in-process `TestClient`.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from fastapi.testclient import TestClient
from transformers import AutoModelForCausalLM, AutoTokenizer

from lora_rl_core.engines import EmbeddedEngine, GenerationRequest, SamplingParams
from lora_rl_core.engines.serve.app import create_app
from lora_rl_core.store import AdapterStore
from lora_rl_core.subscriber import open_subscriber
from lora_rl_testing.adapters import random_lora_factory
from lora_rl_testing.servers import serve_app_in_thread

pytestmark = pytest.mark.slow  # uvicorn in a thread, the in-process app

RUN = "ref"
SERVED = "tiny"
GREEDY = {"max_new_tokens": 6, "temperature": 0}
QUESTION = "What is 1 + 2?"


@pytest.fixture(scope="module", autouse=True)
def prefect_harness():
    """No Prefect server is needed here: overrides the package's session-wide harness for this module."""
    yield


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture()
def store(tmp_path) -> AdapterStore:
    return AdapterStore(f"file://{tmp_path}/store")


@pytest.fixture()
def engine(tiny_model_dir, tok, store) -> Iterator[EmbeddedEngine]:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with EmbeddedEngine(model, tok, max_batch_size=16, store=store) as e:
        yield e


@pytest.fixture()
def app(engine, tok, store):
    return create_app(engine, served_model_name=SERVED, tokenizer=tok, store=store)


@pytest.fixture()
def client(app) -> Iterator[TestClient]:
    with TestClient(app) as c:
        yield c


@pytest.fixture(scope="module")
def make_adapter(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    return random_lora_factory(model, scale=1.0)


def publish(store: AdapterStore, make_adapter, version: int) -> None:
    tensors, config = make_adapter(version)
    store.publish(RUN, version, tensors=tensors, adapter_config=config, step=version, base_model=SERVED)


def name(version: int) -> str:
    return f"{RUN}-v{version:06d}"


def generate(url_or_client, lora_path: str, **extra) -> dict:
    body = {"text": QUESTION, "lora_path": lora_path, "sampling_params": GREEDY, **extra}
    if isinstance(url_or_client, str):
        return httpx.post(f"{url_or_client}/generate", json=body, timeout=60).json()
    return url_or_client.post("/generate", json=body).json()


def served(answer: dict) -> tuple[str, int]:
    return answer["meta_info"]["lora_path"], answer["meta_info"]["weight_version"]


def wait_until(condition, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


# ----------------------------------------------------------------- RUN@latest follows the subscriber


def test_latest_follows_each_newly_published_version(app, store, make_adapter):
    with serve_app_in_thread(app) as url, open_subscriber(store.uri, RUN, [url], keep=2) as subscriber:
        publish(store, make_adapter, 1)
        assert [r.ok for r in subscriber.poll_once()] == [True]
        first = generate(url, f"{RUN}@latest")
        assert served(first) == (name(1), 1)
        assert first["output_ids"] == generate(url, name(1))["output_ids"]

        publish(store, make_adapter, 2)
        assert [r.ok for r in subscriber.poll_once()] == [True]
        assert served(generate(url, f"{RUN}@latest")) == (name(2), 2)
        cards = {c["id"]: c for c in httpx.get(f"{url}/v1/models", timeout=10).json()["data"]}
        assert cards[f"{RUN}@latest"]["alias_of"] == name(2) and {name(1), name(2)} <= set(cards)
        assert sorted(subscriber.engines[0].list_adapters()) == [name(1), name(2)]  # the alias is no adapter


def test_a_call_admitted_on_version_k_finishes_on_k_while_k_plus_1_arrives(engine, app, store, make_adapter, tok):
    """`ref@latest` resolves to v1 and is queued (held in flight); v2 is synced and becomes `ref@latest`; the
    call finishes on v1; v3 then retires v1 before it loads (keep=2: never more than two versions loaded)."""
    with (
        serve_app_in_thread(app) as url,
        open_subscriber(store.uri, RUN, [url], keep=2) as subscriber,
        ThreadPoolExecutor(1) as pool,
    ):
        publish(store, make_adapter, 1)
        subscriber.poll_once()
        engine.pause("in_place")  # nothing is admitted: the worker runs `long` first, then the call on v1
        long = engine.submit(GenerationRequest(tok(QUESTION)["input_ids"], None, SamplingParams(200, 0.0)))
        call = pool.submit(generate, url, f"{RUN}@latest", sampling_params={"max_new_tokens": 8, "seed": 3})
        wait_until(lambda: engine.list_adapters()[name(1)]["in_flight"] == 1)

        publish(store, make_adapter, 2)
        assert [(r.name, r.ok, r.retired) for r in subscriber.poll_once()] == [(name(2), True, [])]
        engine.resume()
        wait_until(lambda: engine.health()["running"] == 1)
        assert not call.done()
        assert subscriber.poll_once() == [] and name(1) in engine.list_adapters()  # within keep: stays
        aliases = {c["id"]: c.get("alias_of") for c in httpx.get(f"{url}/v1/models", timeout=10).json()["data"]}
        assert aliases[f"{RUN}@latest"] == name(2)

        answer = call.result(timeout=60)
        assert served(answer) == (name(1), 1) and answer["meta_info"]["finish_reason"]["type"] != "abort"
        long.result(timeout=60)
        publish(store, make_adapter, 3)
        assert [(r.name, r.ok, r.retired) for r in subscriber.poll_once()] == [(name(3), True, [name(1)])]
        assert sorted(engine.list_adapters()) == [name(2), name(3)]
        assert served(generate(url, f"{RUN}@latest")) == (name(3), 3)


# ----------------------------------------------------------------- RUN@N and RUN@TAG


def test_versions_and_tags_resolve_in_the_store_and_load_on_demand(client, engine, store, make_adapter):
    for version in (1, 2, 3):
        publish(store, make_adapter, version)
    store.tag(RUN, 1, "best")
    engine.load_adapter(name(3), path=store.ref(RUN, 3).uri)

    assert served(generate(client, f"{RUN}@latest")) == (name(3), 3)
    assert served(generate(client, f"{RUN}@3")) == (name(3), 3)
    assert served(generate(client, f"{RUN}@best")) == (name(1), 1)  # loaded from the store on first use
    assert sorted(engine.list_adapters()) == [name(1), name(3)]
    assert served(generate(client, f"{RUN}@latest")) == (name(3), 3)  # the newest loaded, not the last used
    store.tag(RUN, 2, "best")  # a moved tag is read again at the next call
    assert served(generate(client, f"{RUN}@best")) == (name(2), 2)
    mixed = client.post("/generate", json={"text": [QUESTION] * 2, "lora_path": [f"{RUN}@1", None]}).json()
    assert [served(o) for o in mixed] == [(name(1), 1), (None, None)]

    for ref, status, words in [
        (f"{RUN}@9", 404, [f"{RUN}@9", "ref-v000009 is not loaded", "available versions of 'ref': [1, 2, 3]"]),
        (f"{RUN}@nope", 404, [f"{RUN}@nope", "no tag 'nope'", "best"]),
        ("ghost@latest", 404, ["ghost@latest", "no version of run 'ghost'", f"loaded runs: ['{RUN}']"]),
        (f"{RUN}@bad/tag", 400, ["invalid adapter spec"]),
    ]:
        r = client.post("/generate", json={"text": QUESTION, "lora_path": ref})
        assert r.status_code == status and set(r.json()) == {"error"}, (ref, r.text)
        assert all(w in r.json()["error"]["message"] for w in words), r.text


# ----------------------------------------------------------------- OpenAI endpoints (schema, httpx)


def chat_ids(tok, messages: list[dict]) -> list[int]:
    encoded = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
    return list(encoded["input_ids"])


def test_openai_completions_follow_the_schema_and_match_generate(client, engine, store, make_adapter, tok):
    publish(store, make_adapter, 4)
    engine.load_adapter(name(4), path=store.ref(RUN, 4).uri)
    body = {"model": f"{RUN}@latest", "prompt": QUESTION, "max_tokens": 6, "temperature": 0, "logprobs": 0}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert set(out) >= {"id", "object", "created", "model", "choices", "usage"} and out["id"].startswith("cmpl-")
    assert (out["object"], out["model"]) == ("text_completion", f"{RUN}@latest")
    assert (out["adapter"], out["adapter_version"]) == (name(4), 4)
    native = generate(client, name(4), return_logprob=True)
    (choice,) = out["choices"]
    assert choice["index"] == 0 and choice["text"] == native["text"] and choice["finish_reason"] in ("stop", "length")
    expected = [t[0] for t in native["meta_info"]["output_token_logprobs"]]
    assert choice["logprobs"]["token_logprobs"] == pytest.approx(expected)
    prompt_tokens = len(tok(QUESTION)["input_ids"])
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": len(native["output_ids"])}
    assert out["usage"] == {**usage, "total_tokens": sum(usage.values())}

    batch = {"model": SERVED, "prompt": [[5, 6, 7], [8, 9]], "n": 2, "max_tokens": 3, "seed": 1}
    out = client.post("/v1/completions", json=batch).json()
    assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3] and out["adapter"] is None
    assert out["usage"]["prompt_tokens"] == 5 and out["usage"]["completion_tokens"] <= 12

    full = client.post("/v1/completions", json={**body, "max_tokens": 12, "logprobs": None}).json()["choices"][0]
    assert full["text"].strip()
    stop = next(ch for ch in full["text"][len(full["text"]) // 2 :] if not ch.isspace())
    cut = client.post("/v1/completions", json={**body, "max_tokens": 12, "stop": [stop]}).json()
    assert cut["choices"][0]["text"] == full["text"][: full["text"].index(stop)]
    assert cut["choices"][0]["finish_reason"] == "stop" and cut["usage"]["completion_tokens"] <= 12


def test_openai_chat_renders_the_template_and_follows_the_schema(client, engine, tok):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTION}]
    body = {"model": SERVED, "messages": messages, "max_completion_tokens": 6, "temperature": 0, "logprobs": True}
    out = client.post("/v1/chat/completions", json=body).json()
    assert out["object"] == "chat.completion" and out["id"].startswith("chatcmpl-") and out["model"] == SERVED
    (choice,) = out["choices"]
    expected = engine.generate([GenerationRequest(chat_ids(tok, messages), None, SamplingParams(6, 0.0))])[0]
    assert choice["message"] == {
        "role": "assistant",
        "content": tok.decode(expected.completion_ids, skip_special_tokens=True),
        "refusal": None,
    }
    assert [t["logprob"] for t in choice["logprobs"]["content"]] == pytest.approx(expected.logprobs)
    assert out["usage"]["prompt_tokens"] == len(chat_ids(tok, messages))

    parts = [{"role": "user", "content": [{"type": "text", "text": "What is "}, {"type": "text", "text": "1 + 2?"}]}]
    sampled = {"model": SERVED, "messages": parts, "max_tokens": 4, "n": 3, "seed": 5, "stop": "\n"}
    out = client.post("/v1/chat/completions", json=sampled).json()
    assert [c["index"] for c in out["choices"]] == [0, 1, 2]
    assert all(c["finish_reason"] in ("stop", "length") and "\n" not in c["message"]["content"] for c in out["choices"])
    assert out["usage"]["prompt_tokens"] == len(chat_ids(tok, [{"role": "user", "content": QUESTION}]))


@pytest.mark.parametrize(
    ("path", "body", "status", "param", "code", "words"),
    [
        ("/v1/completions", {"model": "ghost@latest", "prompt": "x"}, 404, "model", "model_not_found", "ghost"),
        ("/v1/completions", {"model": "nope", "prompt": "x"}, 404, "model", "model_not_found", "never been loaded"),
        ("/v1/completions", {"model": f"{RUN}@", "prompt": "x"}, 400, "model", "invalid_model", "adapter spec"),
        ("/v1/completions", {"model": SERVED, "prompt": "x", "stream": True}, 400, "stream", None, "stream"),
        ("/v1/completions", {"model": SERVED, "prompt": "x", "bogus": 1}, 400, "bogus", None, "Extra inputs"),
        ("/v1/completions", {"model": SERVED, "prompt": "x", "logprobs": 2}, 400, "logprobs", None, "top logprobs"),
        ("/v1/completions", {"model": SERVED, "prompt": []}, 400, "prompt", None, "at least one token"),
        ("/v1/completions", {"model": SERVED, "prompt": "x", "n": 0}, 400, "n", None, "n"),
        ("/v1/completions", {"model": SERVED, "prompt": "x", "stop": ["a"] * 5}, 400, "stop", None, "at most 4"),
        ("/v1/completions", {"prompt": "x"}, 400, "model", None, "Field required"),
        ("/v1/chat/completions", {"model": SERVED, "messages": []}, 400, "messages", None, "at least 1"),
        (
            "/v1/chat/completions",
            {"model": SERVED, "messages": [{"role": "robot", "content": "x"}]},
            400,
            "messages.0.role",
            None,
            "role",
        ),
        (
            "/v1/chat/completions",
            {"model": SERVED, "messages": [{"role": "user", "content": "x"}], "presence_penalty": 1},
            400,
            "presence_penalty",
            None,
            "not supported",
        ),
    ],
)
def test_openai_errors_name_the_field(client, path, body, status, param, code, words):
    r = client.post(path, json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert (error["param"], error["code"]) == (param, code) and words in error["message"]


def test_openai_timeout_is_a_504(engine, tok):
    app = create_app(engine, served_model_name=SERVED, tokenizer=tok, request_timeout_s=0.0)
    with TestClient(app) as c:
        r = c.post("/v1/completions", json={"model": SERVED, "prompt": QUESTION, "max_tokens": 50})
    assert r.status_code == 504 and r.json()["error"]["code"] == "timeout"


# ----------------------------------------------------------------- the real OpenAI client


def test_the_openai_client_talks_to_the_server(app, engine, store, make_adapter, tok):
    openai = pytest.importorskip("openai")
    publish(store, make_adapter, 1)
    engine.load_adapter(name(1), path=store.ref(RUN, 1).uri)
    with serve_app_in_thread(app) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        assert [m.id for m in client.models.list()] == [SERVED, name(1), f"{RUN}@latest"]

        done = client.completions.create(model=f"{RUN}@latest", prompt=QUESTION, max_tokens=6, temperature=0)
        assert done.choices[0].text == generate(url, name(1))["text"] and done.usage.prompt_tokens > 0
        assert (done.model_extra or {})["adapter"] == name(1) and done.model_extra["adapter_version"] == 1

        chat = client.chat.completions.create(
            model=f"{RUN}@1", messages=[{"role": "user", "content": QUESTION}], max_tokens=4, n=2, seed=3
        )
        assert len(chat.choices) == 2 and all(c.message.role == "assistant" for c in chat.choices)
        assert chat.choices[0].finish_reason in ("stop", "length") and chat.model_extra["adapter"] == name(1)

        with pytest.raises(openai.NotFoundError) as missing:
            client.completions.create(model="ghost@latest", prompt=QUESTION, max_tokens=2)
        assert missing.value.code == "model_not_found" and missing.value.param == "model"
        with pytest.raises(openai.BadRequestError) as refused:
            client.completions.create(model=SERVED, prompt=QUESTION, max_tokens=2, frequency_penalty=0.5)
        assert refused.value.param == "frequency_penalty"
