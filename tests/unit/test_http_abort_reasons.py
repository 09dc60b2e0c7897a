"""Abort reasons through the HTTP clients: the server's reason wins over the one the client kept.

A fake transport answers `/generate` after running a callback inside the call (while the request is in flight
on the client), so the order "the server ended it for one reason, then the client aborted it for another"
is exact. Regression: `ServerEngine` used to report its own reason, so a request that a pause had already
ended came back `aborted` (and one aborted before a client pause came back `paused`), which the hot-swap
stress run counted as unaccounted aborts.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable

import httpx
import pytest

from lora_rl_core.engines.base import GenerationRequest, SamplingParams
from lora_rl_core.engines.remote import SERVER, SGLANG, Dialect, HTTPEngine

SGLANG_PROSE = "Aborted by AbortReq."


def _client(dialect: Dialect, message: str, during: Callable[[HTTPEngine], None]) -> HTTPEngine:
    """A client whose server answers every `/generate` prompt as aborted with `message`, after `during`."""
    engine = HTTPEngine(dialect, "http://fake")

    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/abort_request":
            return httpx.Response(200, json={"aborted": 0})  # the server had already ended it
        if request.url.path in ("/pause_generation", "/continue_generation"):
            return httpx.Response(200, json={})
        during(engine)
        rids = json.loads(request.content)["rid"]
        finish = {"type": "abort", "message": message}
        meta = {"finish_reason": finish, "output_token_logprobs": [], "weight_version": "1"}
        return httpx.Response(200, json=[{"text": "", "meta_info": {**meta, "id": rid}} for rid in rids])

    engine._http = engine._generation_http = httpx.Client(base_url="http://fake", transport=httpx.MockTransport(handle))
    return engine


def _one(engine: HTTPEngine) -> str | None:
    request = GenerationRequest([1, 2, 3], "run-v000001", SamplingParams(max_new_tokens=2), request_id="r0")
    return engine.generate([request])[0].abort_reason


@pytest.mark.parametrize(("server_reason", "client_call"), [("paused", "abort"), ("aborted", "pause")])
def test_our_server_reason_wins(server_reason: str, client_call: str) -> None:
    def during(engine: HTTPEngine) -> None:
        if client_call == "abort":
            engine.abort("r0")
        else:
            engine.pause("abort")

    with _client(SERVER, server_reason, during) as engine:
        assert _one(engine) == server_reason


def test_sglang_prose_takes_the_first_reason_the_client_gave() -> None:
    def during(engine: HTTPEngine) -> None:
        engine.abort("r0", reason="timeout")
        engine.pause("abort")  # the request has ended already: it keeps `timeout`

    with _client(SGLANG, SGLANG_PROSE, during) as engine:
        assert _one(engine) == "timeout"
        # detach: the caller got its answer at the abort; the HTTP call itself ends (and forgets) just after
        deadline = time.monotonic() + 10
        while len(engine._requests) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(engine._requests) == 0 and engine._requests.kept_reasons() == {}  # forgotten once it ended


def test_sglang_prose_without_a_client_reason_is_aborted() -> None:
    with _client(SGLANG, SGLANG_PROSE, lambda engine: None) as engine:
        assert _one(engine) == "aborted"
