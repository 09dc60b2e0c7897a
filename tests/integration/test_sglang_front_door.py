"""Bounded residency on SGLang: the request sequences that make SGLang 0.5.17's unload wait forever, and that our
SGLang client (`abort="detach"`, drain before unload) and `lora-rl serve` in front of SGLang never send them.

The look-alike SGLang server keeps adapter reference counts as 0.5.17 does and records every unload that would
wait forever (`lora_rl_testing.sglang_fake`, `hung_unloads`; it gives up after 1 s here). Raw clients show the
hazards: a `/generate` with `n > 1` (sglang#36894), an abort of a queued request and a pause in `abort` mode
(sglang#34205). Then the same sequences through our client and through our engine server in front of the
look-alike: every unload goes through, no count is left, and every request ends with a reason. Requests are
held queued by an `in_place` pause of the look-alike's engine, so aborts land while they are in flight.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import httpx
import pytest
from transformers import AutoModelForCausalLM

from lora_rl_core.engines import GenerationRequest, SamplingParams
from lora_rl_core.engines.remote import SERVER, SGLANG, HTTPEngine
from lora_rl_core.engines.serve.app import EngineServer
from lora_rl_testing.adapters import random_lora_factory
from lora_rl_testing.servers import serve_app_in_thread
from lora_rl_testing.sglang_fake import SGLangFakeServer

pytestmark = pytest.mark.slow  # uvicorn in threads

A = "front-v000001"
PARAMS = SamplingParams(max_new_tokens=4, temperature=1.0, seed=3)
WAIT_S = 20.0


@pytest.fixture(scope="module", autouse=True)
def prefect_harness():
    """No Prefect server is needed here: overrides the package's session-wide harness for this module."""
    yield


@pytest.fixture
def fake(backend, tiny_model_dir) -> Iterator[tuple[SGLangFakeServer, str]]:
    server = SGLangFakeServer(
        backend, served_model_name="tiny", request_timeout_s=30.0, control_timeout_s=30.0, unload_wait_s=1.0
    )
    tensors, config = random_lora_factory(AutoModelForCausalLM.from_pretrained(tiny_model_dir))(1)
    backend.load_adapter(A, tensors=tensors, config=config)
    server.adapters.loaded[A] = {"path": "__tensor__", "sha256": None}
    with serve_app_in_thread(server.app()) as url:
        yield server, url


def wait_until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def in_background(call: Callable[[], object]) -> Future:
    pool = ThreadPoolExecutor(max_workers=1)
    future = pool.submit(call)
    pool.shutdown(wait=False)
    return future


def unload(url: str) -> httpx.Response:
    return httpx.post(f"{url}/unload_lora_adapter", json={"lora_name": A}, timeout=WAIT_S)


def raw_generate(url: str, rid: str, n: int = 1) -> Future:
    body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 4, "n": n}, "lora_path": A, "rid": rid}
    return in_background(lambda: httpx.post(f"{url}/generate", json=body, timeout=WAIT_S))


# ----------------------------------------------------------------- the hazards, raw


def test_a_raw_n4_request_leaves_the_count_below_zero_and_the_unload_hangs(fake):
    server, url = fake
    assert raw_generate(url, "g", n=4).result(timeout=WAIT_S).status_code == 200
    assert server.refs[A] == -4  # one reference taken, five released (the prefix request and 4 samples)
    assert unload(url).status_code == 500
    assert server.hung_unloads == [(A, -4)]


@pytest.mark.parametrize("how", ["abort by id", "pause in abort mode"])
def test_a_raw_abort_of_a_queued_request_leaks_its_reference_and_the_unload_hangs(fake, backend, how):
    server, url = fake
    backend.pause("in_place")
    try:
        answer = raw_generate(url, "q")
        wait_until(lambda: backend.health()["queue_depth"] == 1, "the request to be queued")
        if how == "abort by id":
            httpx.post(f"{url}/abort_request", json={"rid": "q"}, timeout=WAIT_S)
        else:
            httpx.post(f"{url}/pause_generation", json={"mode": "abort"}, timeout=WAIT_S)
        assert answer.result(timeout=WAIT_S).status_code == 499
    finally:
        backend.resume()
    assert server.refs[A] == 1 and unload(url).status_code == 500 and server.hung_unloads == [(A, 1)]


# ----------------------------------------------------------------- our client


def test_our_client_ends_an_aborted_request_at_once_and_sglang_finishes_it(fake, backend):
    server, url = fake
    with HTTPEngine(SGLANG, url, timeout_s=30, control_timeout_s=30) as client:
        backend.pause("in_place")
        try:
            futures = [client.submit(GenerationRequest([5, 6, 7 + i], A, PARAMS, request_id=f"d{i}")) for i in (0, 1)]
            wait_until(lambda: backend.health()["queue_depth"] == 2, "both requests to be queued")
            assert client.abort("d0") == 1 and client.abort("d0") == 0  # a request is ended once
            first = futures[0].result(timeout=5)  # at once, while the server still holds it queued
            assert (first.finish_reason, first.abort_reason, first.adapter_version) == ("abort", "aborted", 1)
            assert not futures[1].done() and client.list_adapters()[A]["in_flight"] == 2
            unloading = in_background(lambda: client.unload_adapter(A, timeout_s=WAIT_S))
            time.sleep(0.3)
            assert not unloading.done()  # it waits for the two requests, which the server still runs
        finally:
            backend.resume()
        unloading.result(timeout=WAIT_S)
        assert futures[1].result(timeout=WAIT_S).finish_reason in ("eos", "length")
        assert client.list_adapters() == {} and client.metrics()["in_flight"] == 0
    assert server.refs[A] == 0 and server.hung_unloads == []
    assert backend.metrics()["aborted"] == {}  # nothing was aborted on the server


def test_our_clients_abort_pause_retracts_and_its_requests_end_paused(fake, backend):
    server, url = fake
    with HTTPEngine(SGLANG, url, timeout_s=30, control_timeout_s=30) as client:
        backend.pause("in_place")
        done = in_background(lambda: client.generate([GenerationRequest([5, 6], A, PARAMS, request_id="p0")]))
        wait_until(lambda: backend.health()["queue_depth"] == 1, "the request to be queued")
        client.pause("abort")
        [out] = done.result(timeout=5)
        assert (out.finish_reason, out.abort_reason) == ("abort", "paused")
        assert backend.health()["paused"] and client.list_adapters()[A]["in_flight"] == 1
        backend.resume()  # the look-alike's own in_place pause above
        client.resume()
        client.unload_adapter(A, timeout_s=WAIT_S)
    assert server.refs[A] == 0 and server.hung_unloads == []


def test_the_deadline_ends_requests_without_closing_the_connection(fake, backend):
    server, url = fake
    with HTTPEngine(SGLANG, url, timeout_s=0.5, control_timeout_s=30) as client:
        backend.pause("in_place")
        try:
            [out] = client.generate([GenerationRequest([5, 6], A, PARAMS, request_id="t0")])
            assert (out.finish_reason, out.abort_reason) == ("abort", "timeout")
            assert client.list_adapters()[A]["in_flight"] == 1  # SGLang still has it
        finally:
            backend.resume()
        client.unload_adapter(A, timeout_s=WAIT_S)
    assert server.refs[A] == 0 and server.hung_unloads == []


# ----------------------------------------------------------------- our server in front of SGLang


def test_the_front_door_turns_the_hazardous_sequences_into_safe_ones(fake, backend):
    server, url = fake
    with HTTPEngine(SGLANG, url, timeout_s=30, control_timeout_s=30) as upstream:
        door = EngineServer(upstream, served_model_name="tiny", request_timeout_s=30.0, control_timeout_s=30.0)
        with serve_app_in_thread(door.app()) as front:
            n4 = raw_generate(front, "g", n=4).result(timeout=WAIT_S)
            assert n4.status_code == 200 and len(n4.json()) == 4
            assert {o["meta_info"]["weight_version"] for o in n4.json()} == {1}

            backend.pause("in_place")
            try:
                queued = [raw_generate(front, rid) for rid in ("q0", "q1", "q2")]
                wait_until(lambda: backend.health()["queue_depth"] == 3, "three requests to be queued")
                assert httpx.post(f"{front}/abort_request", json={"rid": "q0"}, timeout=WAIT_S).json() == {"aborted": 1}
                httpx.post(f"{front}/pause_generation", json={"mode": "abort"}, timeout=WAIT_S)
                reasons = [q.result(timeout=5).json()["meta_info"]["finish_reason"] for q in queued]
                assert [r["type"] for r in reasons] == ["abort"] * 3
                assert [r["message"] for r in reasons] == ["aborted", "paused", "paused"]
            finally:
                backend.resume()
                httpx.post(f"{front}/continue_generation", timeout=WAIT_S)
            assert unload(front).json()["success"] is True
            models = httpx.get(f"{front}/v1/models", timeout=WAIT_S).json()["data"]
            assert [m["id"] for m in models] == ["tiny"]
    assert server.refs[A] == 0 and server.hung_unloads == [] and backend.metrics()["aborted"] == {}


def test_our_server_in_front_reports_the_requests_it_holds(fake, backend):
    """The front door's `/v1/models` counts every client's requests in flight (SGLang reports none), which is
    what `retire_stale` reads."""
    _, url = fake
    with HTTPEngine(SGLANG, url, timeout_s=30, control_timeout_s=30) as upstream:
        door = EngineServer(upstream, served_model_name="tiny")
        with serve_app_in_thread(door.app()) as front, HTTPEngine(SERVER, front) as client:
            backend.pause("in_place")
            try:
                calls = [raw_generate(front, f"r{i}", n=2) for i in range(3)]
                wait_until(lambda: client.list_adapters()[A]["in_flight"] == 6, "six requests in flight")
            finally:
                backend.resume()
            assert all(c.result(timeout=WAIT_S).status_code == 200 for c in calls)
            assert client.list_adapters()[A]["in_flight"] == 0


def test_a_resume_never_waits_behind_the_generation_calls_a_pause_holds(fake, backend):
    """120 requests held by a paused server occupy 120 connections; the resume goes out on its own connections
    (httpx's default pool has 100: on the H100 the resume of a soak waited for one until its timeout)."""
    _, url = fake
    with HTTPEngine(SGLANG, url, timeout_s=60, control_timeout_s=10) as client:
        client.pause("in_place")
        futures = [client.submit(GenerationRequest([5, 6], A, PARAMS, request_id=f"h{i}")) for i in range(120)]
        wait_until(lambda: backend.health()["queue_depth"] == 120, "120 requests to be queued")
        start = time.monotonic()
        client.resume()
        assert time.monotonic() - start < 5
        assert all(f.result(timeout=WAIT_S).finish_reason in ("eos", "length") for f in futures)
        client.unload_adapter(A, timeout_s=WAIT_S)


def test_lora_rl_serve_stands_in_front_of_sglang(fake, tiny_model_dir, tmp_path):
    """`lora-rl serve engine.type=sglang engine.urls=[URL]`: the command serves the SGLang at URL through our
    client, so a client's n=2 call and its abort reach SGLang as safe requests and the unload goes through."""
    import socket
    import sys
    from pathlib import Path

    from tests.support import processes

    server, url = fake
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    front = f"http://127.0.0.1:{port}"
    args = [f"model.name_or_path={tiny_model_dir}", "model.dtype=float32", "engine.type=sglang"]
    args += [f"engine.urls=[{url}]", f"store.uri=file://{tmp_path}/store", "--port", str(port)]
    lora_rl = str(Path(sys.executable).with_name("lora-rl"))
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    with (tmp_path / "out.txt").open("w") as out:
        proc = processes.popen([lora_rl, "serve", *args], stdout=out, stderr=out, env=env)
    try:
        wait_until(lambda: _answers(f"{front}/v1/models"), "lora-rl serve to answer")
        models = httpx.get(f"{front}/v1/models", timeout=WAIT_S).json()["data"]
        assert A in [m["id"] for m in models]  # SGLang's adapter, listed through our server
        n2 = raw_generate(front, "cli", n=2).result(timeout=WAIT_S)
        assert n2.status_code == 200 and [o["meta_info"]["weight_version"] for o in n2.json()] == [1, 1]
        assert unload(front).json()["success"] is True
    finally:
        processes.stop(proc)
    assert server.refs[A] == 0 and server.hung_unloads == [], (tmp_path / "out.txt").read_text()[-3000:]


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
