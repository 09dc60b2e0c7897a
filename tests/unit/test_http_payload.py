"""What the HTTP client sends in `/generate`: `lora_path` only when an adapter is named (a server started
without `--enable-lora` refuses any `lora_path`, even `[null]`), and per-request seeds for SGLang."""

from __future__ import annotations

import json

import httpx

from lora_rl_core.engines.base import GenerationRequest, SamplingParams
from lora_rl_core.engines.remote import SGLANG, HTTPEngine


def _capture(bodies: list[dict]) -> HTTPEngine:
    """A client whose fake server records each `/generate` body and answers one token per request."""
    engine = HTTPEngine(SGLANG, "http://fake")

    def handle(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        bodies.append(body)
        meta = {"finish_reason": {"type": "length"}, "output_token_logprobs": [[-0.5, 7, None]]}
        return httpx.Response(200, json=[{"meta_info": {**meta, "id": rid}, "output_ids": [7]} for rid in body["rid"]])

    engine._http = engine._generation_http = httpx.Client(base_url="http://fake", transport=httpx.MockTransport(handle))
    return engine


def test_base_model_requests_send_no_lora_path() -> None:
    bodies: list[dict] = []
    params = SamplingParams(max_new_tokens=1, seed=10)
    with _capture(bodies) as engine:
        done = engine.generate([GenerationRequest([1, 2], None, params) for _ in range(3)])
    assert [c.completion_ids for c in done] == [[7]] * 3
    assert len(bodies) == 1 and "lora_path" not in bodies[0]
    assert [p["sampling_seed"] for p in bodies[0]["sampling_params"]] == [10, 11, 12]  # a group's samples differ


def test_mixed_requests_name_each_adapter_and_null_for_the_base_model() -> None:
    bodies: list[dict] = []
    params = SamplingParams(max_new_tokens=1)
    with _capture(bodies) as engine:
        engine.generate([GenerationRequest([1], name, params) for name in ("run-v000001", None)])
    assert [b.get("lora_path") for b in bodies] == [["run-v000001", None]]
