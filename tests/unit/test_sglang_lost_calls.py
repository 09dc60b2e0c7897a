"""`HTTPEngine` when SGLang fails a whole `/generate` batch with HTTP 499, and `is_paused` without HTTP.

SGLang 0.5.17 answers `{"error": {"message": "Request RID was aborted"}}` with HTTP 499 for the whole call when
one of its requests was aborted (by id, or by a pause in `abort` mode) before the batch reached its scheduler
(`TokenizerManager._raise_if_logical_rid_aborted`); none of the call's requests ran. A mock transport plays
that server here, so the order "call in flight, client aborts, server answers 499" is exact: the rows this
client aborted come back aborted with the reason it kept, the others are sent again under fresh rids and come
back with their tokens, and an abort given after the resend reaches the resent row's rid.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from lora_rl_core.engines.base import GenerationRequest, SamplingParams
from lora_rl_core.engines.remote import SGLANG, HTTPEngine
from lora_rl_core.engines.remote.tracking import MAX_UNEXPLAINED_LOSSES
from lora_rl_core.errors import EngineError, EngineUnavailable
from lora_rl_core.subscriber import is_paused, retire_stale

ADAPTER = "run-v000001"
LOST = {"error": {"message": "Request r1 was aborted"}}


class Server:
    """A mock SGLang: `/generate` call k (from 0) runs `during[k]` (the client acting while the call is in
    flight), then answers 499 when `lose[k]`, else one completion `[7, 8]` per rid. Records every call."""

    def __init__(self, lose: list[bool], during: dict[int, Callable[[HTTPEngine], None]] | None = None) -> None:
        self.lose, self.during = lose, during or {}
        self.calls: list[tuple[str, Any]] = []
        self.generates: list[list[str]] = []  # the rids of each /generate
        self.engine = HTTPEngine(SGLANG, "http://fake", timeout_s=30, abort="forward")
        mock = httpx.Client(base_url="http://fake", transport=httpx.MockTransport(self.handle))
        self.engine._http = self.engine._generation_http = mock

    def handle(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else None
        self.calls.append((request.url.path, body))
        if request.url.path == "/generate":
            k = len(self.generates)
            self.generates.append(list(body["rid"]))
            if k in self.during:
                self.during[k](self.engine)
            if k < len(self.lose) and self.lose[k]:
                return httpx.Response(499, json=LOST)
            return httpx.Response(200, json=[_output(rid) for rid in body["rid"]])
        if request.url.path == "/v1/models":
            cards = [{"id": "base", "root": "base", "parent": None}]
            return httpx.Response(200, json={"data": cards + [{"id": ADAPTER, "root": "/x", "parent": "base"}]})
        return httpx.Response(200)  # /abort_request, /pause_generation, /continue_generation: an empty 200


def _output(rid: str) -> dict[str, Any]:
    meta = {"id": rid, "finish_reason": {"type": "length", "length": 2}, "weight_version": "default"}
    return {"text": "", "meta_info": {**meta, "output_token_logprobs": [[-0.5, 7, None], [-0.25, 8, None]]}}


def _requests(n: int = 3) -> list[GenerationRequest]:
    params = SamplingParams(max_new_tokens=2)
    return [GenerationRequest([1, 2, 3], ADAPTER, params, request_id=f"r{i}") for i in range(n)]


def _summary(done) -> list[tuple[str, str, str | None, list[int]]]:
    return [(c.request_id, c.finish_reason, c.abort_reason, c.completion_ids) for c in done]


def test_a_row_aborted_by_id_ends_aborted_and_the_others_are_sent_again():
    server = Server(lose=[True], during={0: lambda engine: engine.abort("r1")})
    with server.engine as engine:
        done = engine.generate(_requests())
        assert engine._requests.kept_reasons() == {} and engine.metrics()["in_flight"] == 0
        assert (engine.metrics()["lost_calls"], engine.metrics()["resent_requests"]) == (1, 2)
    assert _summary(done) == [
        ("r0", "length", None, [7, 8]),
        ("r1", "abort", "aborted", []),
        ("r2", "length", None, [7, 8]),
    ]
    assert done[1].logprobs == [] and done[1].adapter == ADAPTER and done[1].adapter_version == 1
    assert server.generates == [["r0", "r1", "r2"], ["r0~1", "r2~1"]]  # fresh rids, the aborted row left out
    assert ("/abort_request", {"rid": "r1", "abort_all": False}) in server.calls


def test_an_abort_after_the_resend_reaches_the_resent_rid():
    def abort_r2(engine: HTTPEngine) -> None:
        assert engine.abort("r2", reason="timeout") == 1

    server = Server(lose=[True, True], during={0: lambda engine: engine.abort("r1"), 1: abort_r2})
    with server.engine as engine:
        done = engine.generate(_requests())
    assert _summary(done) == [
        ("r0", "length", None, [7, 8]),
        ("r1", "abort", "aborted", []),
        ("r2", "abort", "timeout", []),
    ]
    assert server.generates == [["r0", "r1", "r2"], ["r0~1", "r2~1"], ["r0~2"]]
    assert ("/abort_request", {"rid": "r2~1", "abort_all": False}) in server.calls


def test_a_pause_in_abort_mode_ends_every_row_paused():
    server = Server(lose=[True], during={0: lambda engine: engine.pause("abort")})
    with server.engine as engine:
        done = engine.generate(_requests())
    assert _summary(done) == [(f"r{i}", "abort", "paused", []) for i in range(3)]
    assert len(server.generates) == 1  # nothing sent again


def test_a_single_submitted_request_aborted_by_id():
    server = Server(lose=[True], during={0: lambda engine: engine.abort("r0")})
    with server.engine as engine:
        done = engine.submit(_requests(1)[0]).result(timeout=10)
    assert _summary([done]) == [("r0", "abort", "aborted", [])]


def test_losses_no_abort_of_this_client_explains_are_bounded():
    server = Server(lose=[True] * 10)
    with server.engine as engine, pytest.raises(EngineError, match="HTTP 499 3 times"):
        engine.generate(_requests())
    assert len(server.generates) == MAX_UNEXPLAINED_LOSSES == 3
    assert server.generates[-1] == ["r0~2", "r1~2", "r2~2"]


def test_an_unexplained_loss_is_sent_again():
    server = Server(lose=[True])  # e.g. another client's abort_all: this client aborted nothing
    with server.engine as engine:
        done = engine.generate(_requests(2))
    assert _summary(done) == [("r0", "length", None, [7, 8]), ("r1", "length", None, [7, 8])]


def test_rows_lost_after_the_deadline_end_as_timeout():
    def abort_late(engine: HTTPEngine) -> None:
        engine.abort("r1")
        time.sleep(0.3)  # the call's deadline passes while it is out (the mock transport has no timeout)

    server = Server(lose=[True], during={0: abort_late})
    with server.engine as engine:
        done = engine.generate(_requests(), timeout_s=0.2)
    assert _summary(done) == [
        ("r0", "abort", "timeout", []),
        ("r1", "abort", "aborted", []),
        ("r2", "abort", "timeout", []),
    ]
    assert len(server.generates) == 1


# ----------------------------------------------------------------- is_paused


def test_is_paused_makes_no_http_call():
    server = Server(lose=[])
    with server.engine as engine:
        assert engine.is_paused() is False and server.calls == []
        engine.pause("retract")
        before = len(server.calls)
        assert engine.is_paused() is True and is_paused(engine) is True
        assert len(server.calls) == before
        engine.resume()
        assert engine.is_paused() is False
        assert [path for path, _ in server.calls] == ["/pause_generation", "/continue_generation"]
    assert is_paused(engine) is True  # closed: it cannot say, so nothing is unloaded


def test_retire_stale_skips_a_paused_sglang_engine_without_asking_health():
    server = Server(lose=[])
    with server.engine as engine:
        engine.pause("in_place")
        assert retire_stale(engine, "run", keep=0) == []
        engine.resume()
        assert retire_stale(engine, "run", keep=0) == [ADAPTER]
    paths = [path for path, _ in server.calls]
    assert "/health" not in paths and "/model_info" not in paths
    assert paths.count("/unload_lora_adapter") == 1


def test_a_get_on_a_connection_the_server_closed_is_sent_once_more_and_a_post_is_not():
    """uvicorn closes an idle kept-alive connection after 5 s; a GET that races it is safe to repeat."""
    resets: list[str] = []

    def handle(request: httpx.Request) -> httpx.Response:
        if len(resets) < 1 or request.method == "POST":
            resets.append(request.method)
            raise httpx.ReadError("Connection reset by peer", request=request)
        cards = [{"id": "base", "root": "base", "parent": None}, {"id": ADAPTER, "root": "/x", "parent": "base"}]
        return httpx.Response(200, json={"data": cards})

    engine = HTTPEngine(SGLANG, "http://fake", timeout_s=30)
    engine._http = httpx.Client(base_url="http://fake", transport=httpx.MockTransport(handle))
    assert list(engine.list_adapters()) == [ADAPTER] and resets == ["GET"]
    with pytest.raises(EngineUnavailable, match="cannot reach the engine"):
        engine.resume()
    assert resets == ["GET", "POST"]
    engine.close()
