"""The hot-swap stress run at CI size (tiny model): adapter swaps under concurrent sampling, aborts and pauses.

In-process against `EmbeddedEngine` and over HTTP against our engine server (uvicorn in a thread on
127.0.0.1, a free port) through `ServerEngine`; the full size is `benchmarks/hotswap_stress.py`. The last
tests feed the checker a lying engine to show that it catches what it claims to.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from lora_rl_core.engines import EmbeddedEngine
from lora_rl_testing.adapters import random_lora_factory
from lora_rl_testing.servers import serve_in_thread
from lora_rl_testing.stress import StressReport, run_hotswap_stress

pytestmark = pytest.mark.slow  # uvicorn in a thread, stress at CI size

CI_SIZE = {"swaps": 20, "clients": 8, "n": 4, "deadline_s": 60.0, "abort_prob": 0.2, "pause_prob": 0.3}


@pytest.fixture(scope="module", autouse=True)
def prefect_harness():
    """No Prefect server is needed here: overrides the package's session-wide harness for this module."""
    yield


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture()
def engine(tiny_model_dir, tok) -> Iterator[EmbeddedEngine]:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with EmbeddedEngine(model, tok, max_batch_size=32) as e:
        yield e


@pytest.fixture(scope="module")
def make_adapter(tiny_model_dir):
    return random_lora_factory(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32))


def assert_invariants(report: StressReport) -> None:
    """Every invariant holds, and the run really swapped, sampled, aborted and paused."""
    assert report.ok, f"violations {report.violations()}; examples {report.examples}"
    assert report.swaps == CI_SIZE["swaps"] and report.swap_failures == 0
    assert report.wall_s < CI_SIZE["deadline_s"]
    ended = report.completed + sum(report.aborted.values()) + report.rejected
    assert ended == report.requests == report.groups * CI_SIZE["n"]
    assert report.completed > 0 and report.aborted.get("aborted", 0) > 0 and sum(report.pauses.values()) > 0
    assert report.retired > 0


def test_in_process_stress(engine, make_adapter, tok):
    report = run_hotswap_stress(engine, make_adapter, **CI_SIZE, vocab_size=len(tok))
    assert_invariants(report)
    assert report.samples == "group" and report.target == "EmbeddedEngine"


@pytest.mark.parametrize("samples", ["n", "group"])
def test_http_stress(engine, make_adapter, tok, samples):
    with serve_in_thread(engine, request_timeout_s=30.0, control_timeout_s=30.0) as url:
        report = run_hotswap_stress(url, make_adapter, **CI_SIZE, vocab_size=len(tok), samples=samples)
    assert_invariants(report)
    assert report.target == url and report.samples == samples


@pytest.mark.parametrize("retire", ["unload", "keep"])
def test_sglang_target_against_the_fake(engine, make_adapter, tok, retire):
    """The `sglang-group` target of the benchmark (an `SGLangEngine`), against the fake SGLang server, which
    revives unloaded adapters as 0.5.17 does: no invariant breaks, and no retired version comes back."""
    from lora_rl_core.engines.remote import SGLANG, HTTPEngine
    from lora_rl_testing.servers import serve_app_in_thread
    from lora_rl_testing.sglang_fake import SGLangFakeServer

    fake = SGLangFakeServer(engine, served_model_name="tiny", request_timeout_s=30.0, control_timeout_s=30.0)
    with serve_app_in_thread(fake.app()) as url, HTTPEngine(SGLANG, url, timeout_s=30, retire=retire) as client:
        report = run_hotswap_stress(client, make_adapter, **CI_SIZE, vocab_size=len(tok))
        kept = client.metrics()["retired_resident"]
    assert report.ok, f"violations {report.violations()}; examples {report.examples}"
    assert report.swaps == CI_SIZE["swaps"] and report.retired > 0 and report.completed > 0
    assert report.revived_adapters == 0 and fake.reloaded == []
    assert kept == (report.retired if retire == "keep" else 0)  # `keep` never calls the server's unload


def test_our_server_in_front_of_the_fake_keeps_residency_bounded_and_no_unload_hangs(engine, make_adapter, tok):
    """The soak at CI size (`benchmarks/sglang_soak.py`): our engine server in front of the look-alike SGLang
    (which keeps 0.5.17's reference counts), clients sending SGLang's `n` with aborts and pauses, the bounded
    swapper keeping 3 versions: no invariant breaks, no unload would hang on SGLang, no count is left, and
    SGLang never lists more than 3 versions (checked after every swap by the swapper's own listing, and here)."""
    from lora_rl_core.engines.remote import SGLANG, HTTPEngine
    from lora_rl_core.engines.serve.app import EngineServer
    from lora_rl_testing.servers import serve_app_in_thread
    from lora_rl_testing.sglang_fake import SGLangFakeServer

    fake = SGLangFakeServer(engine, served_model_name="tiny", unload_wait_s=5.0)
    seen: list[int] = []
    with (
        serve_app_in_thread(fake.app()) as url,
        HTTPEngine(SGLANG, url, timeout_s=30, tensor_transport="inline") as client,
        serve_app_in_thread(EngineServer(client, served_model_name="tiny").app()) as front,
    ):
        listed = client.list_adapters

        def counted() -> dict:  # every listing the front door makes, i.e. what SGLang holds at that moment
            out = listed()
            seen.append(len(out))
            return out

        client.list_adapters = counted  # type: ignore[method-assign]
        options = {**CI_SIZE, "samples": "n", "keep": 3, "bounded": True}
        report = run_hotswap_stress(front, make_adapter, **options, vocab_size=len(tok))
    assert_invariants(report)
    assert fake.hung_unloads == [] and {k: v for k, v in fake.refs.items() if v} == {}
    assert seen and max(seen) <= 3


class Lying:
    """Wraps an engine and tampers with `generate`'s answers (or stalls) to test the checker."""

    def __init__(self, engine: EmbeddedEngine, *, bump: bool = False, drop: bool = False, stall_s: float = 0.0):
        self._engine, self.bump, self.drop, self.stall_s = engine, bump, drop, stall_s

    def __getattr__(self, name: str):
        return getattr(self._engine, name)

    def generate(self, requests, *, timeout_s=None):
        time.sleep(self.stall_s)
        out = self._engine.generate(requests, timeout_s=timeout_s)
        if self.bump and out[-1].adapter_version is not None:
            out[-1] = dataclasses.replace(out[-1], adapter_version=out[-1].adapter_version + 1)
        return out[:-1] if self.drop else out


SMALL = {"swaps": 3, "clients": 2, "n": 4, "deadline_s": 30.0, "abort_prob": 0.0, "pause_prob": 0.0}


def test_checker_catches_a_mixed_version_group(engine, make_adapter, tok):
    report = run_hotswap_stress(Lying(engine, bump=True), make_adapter, **SMALL, vocab_size=len(tok))
    assert not report.ok
    assert report.version_mismatches == report.mixed_groups == report.groups > 0


def test_checker_catches_a_lost_sample(engine, make_adapter, tok):
    report = run_hotswap_stress(Lying(engine, drop=True), make_adapter, **SMALL, vocab_size=len(tok))
    assert report.lost == report.groups > 0 and not report.ok


def test_checker_catches_a_hang(engine, make_adapter, tok):
    stalled = Lying(engine, stall_s=3.0)
    report = run_hotswap_stress(stalled, make_adapter, **{**SMALL, "deadline_s": 1.0}, vocab_size=len(tok))
    assert report.hangs >= SMALL["clients"] and not report.ok
