"""Stop sequences through the HTTP client, against the SGLang look-alike (`lora_rl_testing.sglang_fake`) and our
engine server (`lora-rl serve`), both over an embedded engine on the tiny model.

What SGLang does (docs/SGLANG.md, "Stop sequences"): generation halts at the token that completes a stop string
or is a stop token id, `output_token_logprobs` keeps it, `finish_reason` is `{"type": "stop", "matched": ...}`
(the string, or the token id for a stop token id and for EOS alike) and `text` drops the match unless
`no_stop_trim`. The client must get the embedded engine's own completions back, `stop` and `eos` told apart; the
OpenAI endpoints must halt generation at a stop string too (fewer tokens generated, not cut afterwards).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest
import torch
from fastapi.testclient import TestClient
from transformers import AutoModelForCausalLM, AutoTokenizer

from lora_rl_core.engines import EmbeddedEngine, GenerationRequest, SamplingParams
from lora_rl_core.engines.remote import SERVER, SGLANG, HTTPEngine
from lora_rl_core.engines.serve.app import EngineServer
from lora_rl_testing.servers import serve_app_in_thread
from lora_rl_testing.sglang_fake import SGLangFakeServer

pytestmark = pytest.mark.slow  # uvicorn in a thread, the in-process app

SAMPLED = SamplingParams(max_new_tokens=24, temperature=1.0, seed=11)
QUESTION = "What is 3 + 4?"


@pytest.fixture(scope="module", autouse=True)
def prefect_harness():
    """No Prefect server is needed here: overrides the package's session-wide harness for this module."""
    yield


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def new_backend(model_dir, tok, eos: list[int] | None = None) -> EmbeddedEngine:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if eos is not None:
        model.generation_config.eos_token_id = eos
    return EmbeddedEngine(model, tok, max_batch_size=8)


@pytest.fixture()
def backend(tiny_model_dir, tok) -> Iterator[EmbeddedEngine]:
    with new_backend(tiny_model_dir, tok) as engine:
        yield engine


def ended_by(backend: EmbeddedEngine, tok, prompt: list[int]) -> tuple[SamplingParams, SamplingParams, list[int]]:
    """Params that end the seeded completion of `prompt` by a stop string and by a stop token id (each at the
    first token that did not occur before, from the third on), and that completion without them."""
    (full,) = backend.generate([GenerationRequest(prompt, None, SAMPLED)])
    ids = full.completion_ids
    k = next(i for i in range(2, len(ids)) if ids[i] > 3 and ids[i] not in ids[:i])
    by_string = dataclasses.replace(SAMPLED, stop=("zz", tok.decode([ids[k]])))
    by_id = dataclasses.replace(SAMPLED, stop_token_ids=(ids[k],))
    return by_string, by_id, ids[: k + 1]


@pytest.mark.parametrize("dialect", [SGLANG, SERVER])
def test_client_gets_the_engines_stops_and_tells_eos_from_stop(backend, tiny_model_dir, tok, dialect) -> None:
    prompt = tok(QUESTION)["input_ids"]
    by_string, by_id, stopped = ended_by(backend, tok, prompt)
    server = SGLangFakeServer if dialect is SGLANG else EngineServer
    app = server(backend, served_model_name="tiny", tokenizer=tok).app()
    with serve_app_in_thread(app) as url, HTTPEngine(dialect, url, timeout_s=30, control_timeout_s=30) as client:
        for params in (by_string, by_id):
            (direct,) = backend.generate([GenerationRequest(prompt, None, params)])
            (remote,) = client.generate([GenerationRequest(prompt, None, params)])
            assert (remote.finish_reason, remote.completion_ids) == ("stop", stopped) == (direct.finish_reason, stopped)
            assert remote.logprobs == pytest.approx(direct.logprobs, abs=1e-5)
        (short,) = client.generate([GenerationRequest(prompt, None, dataclasses.replace(SAMPLED, max_new_tokens=2))])
        assert (short.finish_reason, short.completion_ids) == ("length", stopped[:2])
    # EOS: an engine whose model ends with that token (an EOS id, no stop token id): `eos`
    with new_backend(tiny_model_dir, tok, eos=[2, stopped[-1]]) as eos_backend:
        app = server(eos_backend, served_model_name="tiny", tokenizer=tok).app()
        with serve_app_in_thread(app) as url, HTTPEngine(dialect, url, timeout_s=30, control_timeout_s=30) as client:
            (remote,) = client.generate([GenerationRequest(prompt, None, SAMPLED)])
    assert (remote.finish_reason, remote.completion_ids) == ("eos", stopped)


@pytest.mark.parametrize("server", [SGLangFakeServer, EngineServer])
def test_generate_answers_finish_reason_and_text_as_sglang(backend, tok, server) -> None:
    prompt = tok(QUESTION)["input_ids"]
    by_string, by_id, stopped = ended_by(backend, tok, prompt)
    client = TestClient(server(backend, served_model_name="tiny", tokenizer=tok).app())
    seeded = {"max_new_tokens": 24, "temperature": 1.0, "sampling_seed": 11}
    text = tok.decode(stopped)
    stop = by_string.stop[1]
    for extra, matched in (({"stop": list(by_string.stop)}, stop), ({"stop_token_ids": [stopped[-1]]}, stopped[-1])):
        body = {"input_ids": prompt, "sampling_params": {**seeded, **extra}, "return_logprob": True}
        out = client.post("/generate", json=body).json()
        assert out["output_ids"] == stopped and len(out["meta_info"]["output_token_logprobs"]) == len(stopped)
        assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": matched}
        trimmed = text[: text.index(stop)] if isinstance(matched, str) else tok.decode(stopped[:-1])
        assert out["text"] == trimmed
        kept = client.post("/generate", json={**body, "sampling_params": {**seeded, **extra, "no_stop_trim": True}})
        assert kept.json()["text"] == text
    # the stop as the last token allowed: SGLang checks the limit first (`length`), our server the stop
    limit = {**seeded, "stop_token_ids": [stopped[-1]], "max_new_tokens": len(stopped)}
    out = client.post("/generate", json={"input_ids": prompt, "sampling_params": limit}).json()
    assert out["output_ids"] == stopped
    ours = {"type": "stop", "matched": stopped[-1]}
    assert out["meta_info"]["finish_reason"] == (
        {"type": "length", "length": len(stopped)} if server is SGLangFakeServer else ours
    )


def test_openai_stop_halts_generation(backend, tok) -> None:
    prompt = tok(QUESTION)["input_ids"]
    by_string, _, stopped = ended_by(backend, tok, prompt)
    client = TestClient(EngineServer(backend, served_model_name="tiny", tokenizer=tok).app())
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 24, "temperature": 1.0, "seed": 11}
    generated = backend.metrics()["base"]["tokens"]
    full = client.post("/v1/completions", json=body).json()
    assert backend.metrics()["base"]["tokens"] - generated == full["usage"]["completion_tokens"] == 24
    generated = backend.metrics()["base"]["tokens"]
    cut = client.post("/v1/completions", json={**body, "stop": [by_string.stop[1]]}).json()
    (choice,) = cut["choices"]
    assert choice["finish_reason"] == "stop" and choice["text"] == full["choices"][0]["text"][: len(choice["text"])]
    assert by_string.stop[1] not in choice["text"]  # OpenAI's text ends before the stop string
    assert backend.metrics()["base"]["tokens"] - generated == cut["usage"]["completion_tokens"] == len(stopped) < 24
