"""sync_version and AdapterSubscriber: an embedded engine in-process, a file:// store, and fake engines."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import torch
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
from transformers import AutoModelForCausalLM, AutoTokenizer

from lora_rl_core.adapters import adapter_version
from lora_rl_core.engines import EmbeddedEngine, GenerationRequest, SamplingParams
from lora_rl_core.errors import EngineUnavailable, LoraRLError
from lora_rl_core.lora import peft_config_dict
from lora_rl_core.store import AdapterStore
from lora_rl_core.subscriber import AdapterSubscriber, retire_stale, sync_version

RUN = "sub"
GREEDY = SamplingParams(max_new_tokens=6, temperature=0.0)
PROMPT = [5, 6, 7, 8]


def name(version: int) -> str:
    return f"{RUN}-v{version:06d}"


@pytest.fixture(scope="module")
def adapters(tiny_model_dir) -> tuple[list[dict], dict]:
    """Five different random LoRA state dicts (versions 0-4) and their PEFT config."""
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    peft_model = get_peft_model(base, LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj", "v_proj"]))
    state = get_peft_model_state_dict(peft_model)
    gen = torch.Generator().manual_seed(1)
    versions = [{k: torch.randn(v.shape, generator=gen) for k, v in state.items()} for _ in range(5)]
    return versions, peft_config_dict(peft_model.peft_config["default"])


@pytest.fixture()
def engine(tiny_model_dir) -> Iterator[EmbeddedEngine]:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with EmbeddedEngine(model, AutoTokenizer.from_pretrained(tiny_model_dir), max_batch_size=8) as engine:
        yield engine


@pytest.fixture()
def store(tmp_path) -> AdapterStore:
    return AdapterStore(f"file://{tmp_path}/store")


def publish(store: AdapterStore, adapters, version: int):
    return store.publish(
        RUN, version, tensors=adapters[0][version], adapter_config=adapters[1], step=version, base_model="t"
    )


def loaded(engine) -> list[str]:
    return sorted(engine.list_adapters())


def greedy(engine, adapter: str) -> list[int]:
    return engine.generate([GenerationRequest(PROMPT, adapter, GREEDY)])[0].completion_ids


class FakeEngine:
    """A protocol stand-in: reports what a test sets (sha256, in-flight counts, paused), records unloads."""

    def __init__(self, *, sha256: str | None = None, paused: bool = False) -> None:
        self.adapters: dict[str, dict] = {}
        self.sha256 = sha256
        self.paused = paused
        self.in_flight: dict[str, int] = {}
        self.fail_load: Exception | None = None

    def load_adapter(self, name: str, *, path=None, tensors=None, config=None) -> None:
        if self.fail_load is not None:
            raise self.fail_load
        self.adapters[name] = {"version": adapter_version(name), **({"sha256": self.sha256} if self.sha256 else {})}

    def unload_adapter(self, name: str) -> None:
        del self.adapters[name]

    def list_adapters(self) -> dict[str, dict]:
        return {n: {**info, "in_flight": self.in_flight.get(n, 0)} for n, info in self.adapters.items()}

    def is_paused(self) -> bool:
        return self.paused

    def health(self) -> dict:
        return {"ok": True, "paused": self.paused}

    def members(self) -> list:
        return [self]


def test_loads_each_version_and_retires_beyond_keep(engine, store, adapters):
    subscriber = AdapterSubscriber(store, RUN, engine, keep=2)
    assert subscriber.poll_once() == []
    for version in (1, 2, 3):
        publish(store, adapters, version)
        [result] = subscriber.poll_once()
        assert result.ok and result.name == name(version) and result.path == "store", result.error
        assert subscriber.active.version == version
    assert result.retired == [name(1)]
    assert loaded(engine) == [name(2), name(3)]
    assert engine.generate([GenerationRequest(PROMPT, name(3), GREEDY)])[0].adapter_version == 3
    assert subscriber.poll_once() == []  # nothing new


def test_corrupted_version_is_skipped_and_previous_stays_active(engine, store, adapters, tmp_path):
    subscriber = AdapterSubscriber(store, RUN, engine, keep=2)
    publish(store, adapters, 1)
    subscriber.poll_once()
    before = greedy(engine, name(1))
    publish(store, adapters, 2)
    [weights] = (tmp_path / "store" / RUN / "adapters" / "v000002").glob("*/adapter_model.safetensors")
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF  # one weight byte: the file still parses, only the checksum can tell
    weights.write_bytes(bytes(data))

    [result] = subscriber.poll_once()
    assert not result.ok and not result.retryable and "checksum" in result.error
    assert subscriber.active.version == 1 and 2 in subscriber.skipped
    assert loaded(engine) == [name(1)]
    assert greedy(engine, name(1)) == before
    assert subscriber.poll_once() == []  # a corrupt version is not retried
    publish(store, adapters, 3)
    [result] = subscriber.poll_once()
    assert result.ok and subscriber.active.version == 3


def test_never_retires_while_paused(engine, store, adapters):
    subscriber = AdapterSubscriber(store, RUN, engine, keep=2)
    publish(store, adapters, 1)
    publish(store, adapters, 2)
    subscriber.poll_once()
    engine.pause("in_place")
    publish(store, adapters, 3)
    [result] = subscriber.poll_once()  # nothing may be unloaded, and a third version would go past keep
    assert not result.ok and result.retryable and "keep=2" in result.error
    assert loaded(engine) == [name(1), name(2)] and subscriber.active.version == 2
    engine.resume()
    [result] = subscriber.poll_once()
    assert result.ok and result.retired == [name(1)]
    assert loaded(engine) == [name(2), name(3)]


def test_subscriber_keeps_at_most_keep_versions_and_lets_a_retiring_versions_requests_finish(engine, store, adapters):
    subscriber = AdapterSubscriber(store, RUN, engine, keep=2)
    for version in (1, 2):
        publish(store, adapters, version)
        subscriber.poll_once()
    long = SamplingParams(max_new_tokens=120, temperature=1.0, seed=1)
    running = engine.submit(GenerationRequest(PROMPT, name(1), long, request_id="on-v1"))
    deadline = time.monotonic() + 10
    while engine.health()["queue_depth"] or not engine.list_adapters()[name(1)]["in_flight"]:
        assert time.monotonic() < deadline, "the request on v1 was not admitted"
        time.sleep(0.005)
    publish(store, adapters, 3)
    [result] = subscriber.poll_once()  # v1 is drained (its request runs to its end), then unloaded, then v3
    done = running.result(timeout=10)
    assert result.ok and result.retired == [name(1)] and loaded(engine) == [name(2), name(3)]
    assert done.finish_reason in ("eos", "length") and done.adapter_version == 1
    with pytest.raises(LoraRLError, match="has never been loaded"):
        engine.generate([GenerationRequest(PROMPT, name(1), GREEDY)])


def test_a_bounded_sync_needs_room_for_the_serving_version(store, adapters):
    ref = publish(store, adapters, 1)
    with pytest.raises(LoraRLError, match="keep must be >= 2"):
        sync_version(FakeEngine(), ref, store=store, keep=1, bounded=True)
    with pytest.raises(LoraRLError, match="keep must be >= 2"):
        AdapterSubscriber(store, RUN, FakeEngine(), keep=1)


def test_tensor_path_then_store_path_resync_is_idempotent(engine, store, adapters):
    ref = publish(store, adapters, 1)
    result = sync_version([engine], ref, tensors=adapters[0][1], config=adapters[1], keep=2)
    assert result.ok and result.path == "tensor"
    by_tensors = greedy(engine, name(1))
    again = sync_version(engine, ref, store=store, keep=2)  # already listed: verified, not reloaded
    assert again.ok and loaded(engine) == [name(1)]
    assert greedy(engine, name(1)) == by_tensors


def test_checksum_reported_by_an_engine_must_match_the_store(store, adapters):
    ref = publish(store, adapters, 1)
    good, bad = FakeEngine(sha256=ref.sha256), FakeEngine(sha256="0" * 64)
    result = sync_version([good, bad], ref, store=store, keep=2)
    assert not result.ok and "sha256" in result.error
    assert good.adapters == {} and bad.adapters == {}  # the failed version is unloaded where it got loaded
    assert sync_version([good], ref, store=store, keep=2).ok


def test_unreachable_engine_is_retried_not_skipped(store, adapters):
    publish(store, adapters, 1)
    up, down = FakeEngine(), FakeEngine()
    down.fail_load = EngineUnavailable("POST http://10.0.0.9:30000/load_lora_adapter: no answer within 60 s")
    subscriber = AdapterSubscriber(store, RUN, [up, down], keep=2)
    [result] = subscriber.poll_once()
    assert not result.ok and result.retryable and subscriber.skipped == {} and subscriber.active is None
    down.fail_load = None
    [result] = subscriber.poll_once()
    assert result.ok and subscriber.active.version == 1
    assert name(1) in up.adapters and name(1) in down.adapters


def test_in_flight_pinned_and_other_runs_are_not_retired():
    fake = FakeEngine()
    for adapter in (name(1), name(2), name(3), "other-v000001"):
        fake.load_adapter(adapter)
    fake.in_flight = {name(1): 1}
    assert retire_stale(fake, RUN, keep=1, protect={name(3)}) == [name(2)]
    fake.in_flight = {}
    assert retire_stale([fake], RUN, keep=1, protect={name(3)}) == [name(1)]
    assert sorted(fake.adapters) == ["other-v000001", name(3)]
    fake.paused = True
    fake.load_adapter(name(4))
    assert retire_stale(fake, RUN, keep=1) == []


def test_run_is_bounded_by_max_seconds_and_stop(store):
    subscriber = AdapterSubscriber(store, RUN, FakeEngine(), keep=2, poll_interval_s=0.05)
    start = time.monotonic()
    assert subscriber.run(threading.Event(), max_seconds=0.3) == []
    assert time.monotonic() - start < 3
    stop = threading.Event()
    stop.set()
    assert subscriber.run(stop) == []
