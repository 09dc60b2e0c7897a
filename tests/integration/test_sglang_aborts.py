"""Aborts inside a `/generate` batch against the look-alike SGLang server, which fails the whole call with HTTP
499 as SGLang 0.5.17 does (`lora_rl_testing.sglang_fake`; docs/SGLANG.md, "Seen with our client").

These are the SGLang client's `abort="forward"` (`engine.sglang_abort: forward`): aborts sent to SGLang. The
default, `detach`, sends none (tests/integration/test_sglang_front_door.py).

The fake first, raw: a batch with one request aborted by id answers 499 `Request RID was aborted` and its other
requests are dropped. Then through `SGLangEngine`: the aborted request comes back aborted with the reason the
client gave, the others with real tokens (sent again); a pause in `abort` mode ends every request `paused`;
our own engine server keeps answering per-row aborts. Requests are held queued by an `in_place` pause first,
so the abort always lands while the call is in flight.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager

import httpx
import pytest

from lora_rl_core.engines import EmbeddedEngine, GenerationRequest, SamplingParams
from lora_rl_core.engines.remote import SERVER, SGLANG, HTTPEngine
from lora_rl_core.engines.serve.app import create_app
from lora_rl_testing.servers import serve_app_in_thread
from lora_rl_testing.sglang_fake import SGLangFakeServer

pytestmark = pytest.mark.slow  # uvicorn in a thread

PARAMS = SamplingParams(max_new_tokens=4, temperature=1.0, seed=3)
WAIT_S = 20.0


@pytest.fixture(scope="module", autouse=True)
def prefect_harness():
    """No Prefect server is needed here: overrides the package's session-wide harness for this module."""
    yield


@pytest.fixture
def fake(backend) -> Iterator[tuple[SGLangFakeServer, str]]:
    server = SGLangFakeServer(backend, served_model_name="tiny", request_timeout_s=30.0, control_timeout_s=30.0)
    with serve_app_in_thread(server.app()) as url:
        yield server, url


def wait_until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def queued(backend: EmbeddedEngine, n: int) -> Callable[[], bool]:
    return lambda: backend.health()["queue_depth"] >= n


def batch(ids: list[str]) -> list[GenerationRequest]:
    return [GenerationRequest([5, 6, 7 + i], None, PARAMS, request_id=rid) for i, rid in enumerate(ids)]


def in_background(call: Callable[[], object]) -> Future:
    pool = ThreadPoolExecutor(max_workers=1)
    future = pool.submit(call)
    pool.shutdown(wait=False)
    return future


@contextmanager
def batch_held_in_queue(client: HTTPEngine, backend: EmbeddedEngine, ids: list[str]) -> Iterator[Future]:
    """`client.generate(batch(ids))` running in the background, its requests queued behind an in-place pause
    until the block ends (then resumed, whatever happened)."""
    client.pause("in_place")
    try:
        done = in_background(lambda: client.generate(batch(ids)))
        wait_until(queued(backend, len(ids)), "the batch to be queued")
        yield done
    finally:
        client.resume()


def test_the_fake_fails_the_whole_batch_with_499_when_one_request_is_aborted(fake, backend):
    server, url = fake
    backend.pause("in_place")
    try:
        body = {"input_ids": [[5, 6], [7, 8], [9, 10]], "rid": ["x0", "x1", "x2"], "sampling_params": {"n": 1}}
        answer = in_background(lambda: httpx.post(f"{url}/generate", json=body, timeout=WAIT_S))
        wait_until(queued(backend, 3), "the batch to be queued")
        assert httpx.post(f"{url}/abort_request", json={"rid": "x1"}, timeout=WAIT_S).status_code == 200
        response = answer.result(timeout=WAIT_S)
    finally:
        backend.resume()
    assert response.status_code == 499
    assert response.json() == {"error": {"message": "Request x1 was aborted"}}
    assert backend.health()["queue_depth"] == 0  # the other two were dropped, not left to run
    assert backend.metrics()["aborted"] == {"aborted": 3}


def test_one_aborted_request_of_a_batch_ends_aborted_and_the_others_complete(fake, backend):
    server, url = fake
    with HTTPEngine(SGLANG, url, timeout_s=30, control_timeout_s=30, abort="forward") as client:
        with batch_held_in_queue(client, backend, ["b0", "b1", "b2"]) as done:
            assert client.abort("b1") == 1
            wait_until(lambda: {"b0~1", "b2~1"} <= set(server.rids), "the other two to be sent again")
        out = done.result(timeout=WAIT_S)
    assert [(c.request_id, c.finish_reason, c.abort_reason) for c in out] == [
        ("b0", out[0].finish_reason, None),
        ("b1", "abort", "aborted"),
        ("b2", out[2].finish_reason, None),
    ]
    for c in (out[0], out[2]):
        assert c.finish_reason in ("eos", "length") and c.completion_ids and len(c.logprobs) == len(c.completion_ids)
    assert out[1].completion_ids == [] and out[1].logprobs == []


def test_a_pause_in_abort_mode_ends_every_request_of_the_batch_paused(fake, backend):
    server, url = fake
    with HTTPEngine(SGLANG, url, timeout_s=30, control_timeout_s=30, abort="forward") as client:
        with batch_held_in_queue(client, backend, ["p0", "p1", "p2"]) as done:
            client.pause("abort")
            out = done.result(timeout=WAIT_S)
            assert client.is_paused() is True
        assert client.metrics()["in_flight"] == 0
    assert [(c.request_id, c.finish_reason, c.abort_reason, c.completion_ids) for c in out] == [
        (rid, "abort", "paused", []) for rid in ("p0", "p1", "p2")
    ]


def test_our_engine_server_still_answers_per_row_aborts(backend):
    with (
        serve_app_in_thread(create_app(backend, served_model_name="tiny")) as url,
        HTTPEngine(SERVER, url, timeout_s=30, control_timeout_s=30) as client,
    ):
        with batch_held_in_queue(client, backend, ["s0", "s1", "s2"]) as done:
            assert client.abort("s1") == 1
        out = done.result(timeout=WAIT_S)
    assert [(c.finish_reason == "abort", c.abort_reason) for c in out] == [
        (False, None),
        (True, "aborted"),
        (False, None),
    ]
