"""Embedded engine over a request's life: adapter usage counts and unload deadlines, pause and abort, and many
clients, aborts and loads at once (split from `test_engine.py`)."""

from __future__ import annotations

import random
import threading
import time

import pytest

from lora_rl_core.adapters import adapter_version
from lora_rl_core.engines import GenerationRequest, SamplingParams
from lora_rl_core.errors import EngineError
from tests.support.embedded_engine import (
    A1,
    A2,
    GREEDY,
    gated,
    in_flight,
    load,
    prompts,
    random_adapter,
    wait_until,
)

# -------------------------------------------------------- usage and deadlines


def test_usage_counts_return_to_zero_after_every_kind_of_ending(engine, tiny_model_dir):
    load(engine, A1, tiny_model_dir, seed=1)
    p = prompts(tiny_model_dir, 1)[0]
    engine.generate([GenerationRequest(p, A1, GREEDY)])
    assert in_flight(engine, A1) == 0  # completed
    with gated(engine) as (_, entered):  # aborted while its batch runs
        request = GenerationRequest(p, A1, GREEDY)
        future = engine.submit(request)
        assert entered.wait(3.0) and in_flight(engine, A1) == 1
        assert engine.abort(request.request_id) == 1
        out = future.result(timeout=1.0)
        assert (out.finish_reason, out.abort_reason, out.completion_ids) == ("abort", "aborted", [])
        assert in_flight(engine, A1) == 1  # the batch still runs; released when it ends
    assert wait_until(lambda: in_flight(engine, A1) == 0)
    with gated(engine) as (_, entered):  # timed out while its batch runs
        start = time.monotonic()
        out = engine.generate([GenerationRequest(p, A1, GREEDY)], timeout_s=0.2)[0]
        assert time.monotonic() - start < 2.0 and (out.finish_reason, out.abort_reason) == ("abort", "timeout")
        assert out.adapter_version == 1
    assert wait_until(lambda: in_flight(engine, A1) == 0)
    engine.pause("retract")  # timed out while queued
    assert engine.generate([GenerationRequest(p, A1, GREEDY)], timeout_s=0.05)[0].abort_reason == "timeout"
    engine.resume()
    engine._model.generate = lambda requests: 1 / 0  # errored
    with pytest.raises(EngineError, match="generation failed: ZeroDivisionError"):
        engine.generate([GenerationRequest(p, A1, GREEDY)])
    del engine._model.generate
    assert in_flight(engine, A1) == 0
    assert engine.metrics()["aborted"] == {"aborted": 1, "timeout": 2}
    assert engine.generate([GenerationRequest(p, A1, GREEDY)])[0].finish_reason in ("eos", "length")


def test_unload_waits_for_its_holder_while_loads_proceed(engine, tiny_model_dir):
    load(engine, A1, tiny_model_dir, seed=1)
    p = prompts(tiny_model_dir, 1)[0]
    errors: list[Exception] = []

    def unload() -> None:
        try:
            engine.unload_adapter(A1, timeout_s=5.0)
        except Exception as exc:
            errors.append(exc)

    with gated(engine) as (gate, entered):
        future = engine.submit(GenerationRequest(p, A1, GREEDY))
        assert entered.wait(3.0)
        unloader = threading.Thread(target=unload)
        unloader.start()
        time.sleep(0.05)
        assert unloader.is_alive()  # waiting for the running request
        with pytest.raises(EngineError, match="has never been loaded"):
            engine.submit(GenerationRequest(p, A1, GREEDY))  # unregistered at once
        load(engine, A2, tiny_model_dir, seed=2, timeout_s=2.0)  # a load is not blocked by the waiting unload
        assert unloader.is_alive()
        gate.set()
        unloader.join(timeout=3.0)
    assert not unloader.is_alive() and errors == []
    out = future.result(timeout=1.0)
    assert out.finish_reason in ("eos", "length") and out.adapter_version == 1
    assert sorted(engine.list_adapters()) == [A2]


def test_unload_deadline_lists_the_requests_holding_it(engine, tiny_model_dir):
    load(engine, A1, tiny_model_dir, seed=1)
    p = prompts(tiny_model_dir, 1)[0]
    with gated(engine) as (_, entered):
        future = engine.submit(GenerationRequest(p, A1, GREEDY, request_id="holder-1"))
        assert entered.wait(3.0)
        with pytest.raises(EngineError, match=r"1 requests still hold it after 0.1 s: \['holder-1'\]"):
            engine.unload_adapter(A1, timeout_s=0.1)
        assert A1 not in engine.list_adapters() and engine.metrics()["unloading"] == {A1: ["holder-1"]}
    assert future.result(timeout=3.0).finish_reason in ("eos", "length")
    assert wait_until(lambda: engine.metrics()["unloading"] == {})  # freed once its holder ended


# ------------------------------------------------------------- pause / abort


@pytest.mark.parametrize("mode", ["retract", "in_place"])
def test_pause_keeps_queued_requests_and_they_complete_after_resume(engine, tiny_model_dir, mode):
    load(engine, A1, tiny_model_dir, seed=1)
    engine.pause(mode)
    futures = [engine.submit(GenerationRequest(p, A1, GREEDY)) for p in prompts(tiny_model_dir, 2)]
    time.sleep(0.1)
    assert not any(f.done() for f in futures) and engine.health()["queue_depth"] == 2
    engine.resume()
    assert all(f.result(timeout=3.0).finish_reason in ("eos", "length") for f in futures)


def test_pause_abort_aborts_queued_requests_with_a_reason(engine, tiny_model_dir):
    load(engine, A1, tiny_model_dir, seed=1)
    p = prompts(tiny_model_dir, 1)[0]
    engine.pause("retract")
    futures = [engine.submit(GenerationRequest(p, a, GREEDY)) for a in (A1, None)]
    engine.pause("abort")
    outs = [f.result(timeout=1.0) for f in futures]
    assert [(c.finish_reason, c.abort_reason, c.adapter) for c in outs] == [
        ("abort", "paused", A1),
        ("abort", "paused", None),
    ]
    later = engine.submit(GenerationRequest(p, A1, GREEDY))  # still paused: queued, not run
    time.sleep(0.05)
    assert not later.done()
    engine.resume()
    assert later.result(timeout=3.0).finish_reason in ("eos", "length")
    with pytest.raises(EngineError, match="pause mode"):
        engine.pause("sleep")


def test_completion_records_the_version_admitted(engine, tiny_model_dir):
    load(engine, A1, tiny_model_dir, seed=1)
    p = prompts(tiny_model_dir, 1)[0]
    engine.pause("retract")
    waiting = engine.submit(GenerationRequest(p, A1, GREEDY))
    load(engine, A2, tiny_model_dir, seed=2)  # a newer version arrives while the request waits
    engine.resume()
    out = waiting.result(timeout=3.0)
    assert (out.adapter, out.adapter_version) == (A1, 1) and out.finish_reason in ("eos", "length")
    engine.pause("retract")  # unloaded before admission: aborted, never served by another version
    waiting = engine.submit(GenerationRequest(p, A1, GREEDY))
    engine.unload_adapter(A1, timeout_s=1.0)
    engine.resume()
    out = waiting.result(timeout=3.0)
    assert (out.finish_reason, out.abort_reason, out.adapter) == ("abort", "adapter_unloaded", A1)


def test_abort_and_close_end_every_request(engine, tiny_model_dir):
    p = prompts(tiny_model_dir, 1)[0]
    engine.pause("retract")
    requests = [GenerationRequest(p, None, GREEDY) for _ in range(3)]
    futures = [engine.submit(r) for r in requests]
    assert engine.abort("no-such-request") == 0
    assert engine.abort(requests[0].request_id) == 1
    assert futures[0].result(timeout=1.0).abort_reason == "aborted"
    with pytest.raises(EngineError, match="duplicate request ids"):
        engine.submit(requests[1])  # still queued under that id
    with pytest.raises(EngineError, match="duplicate request ids"):
        engine.generate([GenerationRequest(p, None, GREEDY, request_id="x")] * 2)
    assert engine.health()["queue_depth"] == 2
    engine.close()
    assert [f.result(timeout=1.0).abort_reason for f in futures[1:]] == ["engine_closed"] * 2
    assert engine.health()["ok"] is False
    with pytest.raises(EngineError, match="closed"):
        engine.submit(GenerationRequest(p, None, GREEDY))


# ---------------------------------------------------------------- concurrency


def test_concurrent_requests_aborts_and_loads_end_cleanly(make_engine, tiny_model_dir):
    engine = make_engine(max_batch_size=8, max_loras_per_batch=3, max_loaded_loras=3)
    tensors, config = random_adapter(tiny_model_dir, seed=1)
    engine.load_adapter(A1, tensors=tensors, config=config)
    params = SamplingParams(max_new_tokens=4, temperature=0.0)
    ps = prompts(tiny_model_dir, 8)
    newest, outcomes, asked, errors = [A1], [], {}, []
    lock = threading.Lock()

    def client(i: int) -> None:
        rng = random.Random(i)
        for k in range(5):
            request = GenerationRequest(ps[i], rng.choice([None, newest[0]]), params, request_id=f"c{i}-{k}")
            try:
                future = engine.submit(request)
                if rng.random() < 0.3:
                    engine.abort(request.request_id)
                out = future.result(timeout=10.0)
            except Exception as exc:
                errors.append(exc)
                continue
            with lock:
                outcomes.append(out)
                asked[request.request_id] = request.adapter

    def loader() -> None:
        for v in range(2, 6):
            engine.load_adapter(f"run-v{v:06d}", tensors=tensors, config=config, timeout_s=10.0)
            newest[0] = f"run-v{v:06d}"
            time.sleep(0.01)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(8)] + [threading.Thread(target=loader)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=20.0)
    assert not any(t.is_alive() for t in threads) and errors == []
    assert len(outcomes) == 40
    for c in outcomes:
        assert c.finish_reason in ("eos", "length") or (c.finish_reason, c.abort_reason) == ("abort", "aborted")
        assert c.adapter == asked[c.request_id] and c.adapter_version == adapter_version(c.adapter)
    assert wait_until(lambda: all(i["in_flight"] == 0 for i in engine.list_adapters().values()))
    assert engine.health()["queue_depth"] == 0 and engine.metrics()["resident"] <= 3
