"""One behavioural suite for every engine kind, in two parts by protocol: what a training step needs
(`RolloutEngine`: generate, load/list/unload, is_paused, members, close) and what serving needs besides
(`ServingEngine`: submit, abort, pause/resume, flush, health, metrics). The same tests run against each
implementation; each kind implements both protocols (`test_implements_both_protocols`).

Subjects, one per engine kind that can run on a CPU, each doing its work on `EmbeddedEngine`s over the tiny
random model (`tiny_model_dir`):

* `embedded`: the `EmbeddedEngine` itself, in process.
* `server`: `ServerEngine` (our HTTP client) talking to `lora-rl serve`'s app (`create_app`), uvicorn in a
  thread on 127.0.0.1.
* `sglang`: `SGLangEngine` talking to a fake SGLang server (`lora_rl_testing.sglang_fake`): our app with
  SGLang 0.5.x's answers where ours carry more (empty `/abort_request` and `/health` answers,
  `finish_reason` message "Aborted by AbortReq.", `weight_version` "default", bare `/v1/models` cards),
  so the client is held to real SGLang's wire format, not to our server's extras.
* `multi`: a `MultiEngine` over two embedded engines (prompts dealt round-robin, adapter changes broadcast).
* `ray`: the registry's Ray replicas (`engine.ray_replicas: 1`, a local Ray with 2 CPUs): a `MultiEngine` over
  a `RayEngine` whose embedded engine lives in a Ray actor.

Behaviours: generation keeps request order and names adapter and version per completion; `submit`
resolves as `generate`; an unknown adapter is an error, never base-model output; load, list, unload
(SGLang's no-upsert rule); abort with a reason ends a request with `finish_reason` abort and that
reason; pause holds requests until resume, pause(abort) ends them as `paused`; flush, health,
`members()`, close. Adapters are loaded by path: the one source all of them take. About 40 s in all (Ray's
start and an actor per test are most of it).
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from lora_rl_core.adapters import adapter_version
from lora_rl_core.config import EmbeddedEngineConfig, ModelConfig
from lora_rl_core.engines import (
    EmbeddedEngine,
    EngineInputs,
    GenerationRequest,
    MultiEngine,
    SamplingParams,
    ServingEngine,
)
from lora_rl_core.engines.registry import build_engine
from lora_rl_core.engines.remote import SERVER, SGLANG, HTTPEngine
from lora_rl_core.engines.serve.app import create_app
from lora_rl_core.errors import EngineError
from lora_rl_testing.adapters import random_lora_factory
from lora_rl_testing.servers import serve_app_in_thread
from lora_rl_testing.sglang_fake import create_sglang_fake_app

pytestmark = pytest.mark.slow  # uvicorn in a thread for the HTTP subjects

KINDS = ("embedded", "server", "sglang", "multi", "ray")
GREEDY = SamplingParams(max_new_tokens=5, temperature=0.0)
V1, V2 = "conf-v000001", "conf-v000002"
WAIT_S = 10.0


@pytest.fixture(scope="module", autouse=True)
def prefect_harness():
    """No Prefect server is needed here: overrides the package's session-wide harness for this module."""
    yield


@dataclass
class Subject:
    """The engine under test and the engines that do its work, seen through their own `health()` and
    `metrics()` (in process, or through a Ray actor).

    Attributes:
        engine: the engine under test.
        backends: the embedded engines behind it (or handles that answer for them).
        members: what `engine.members()` must list.
    """

    engine: ServingEngine
    backends: list[ServingEngine]
    members: list[ServingEngine]

    def queue_depth(self) -> int:
        """Requests waiting in the backends' queues."""
        return sum(b.health()["queue_depth"] for b in self.backends)

    def base_requests(self) -> int:
        """Requests the backends served with the base model."""
        return sum(b.metrics()["base"]["requests"] for b in self.backends)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def adapter_dirs(tiny_model_dir, tmp_path_factory) -> dict[str, str]:
    """PEFT folders of two random adapter versions: name -> local path."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    make = random_lora_factory(model, scale=1.0)
    out = {}
    for version, name in ((1, V1), (2, V2)):
        tensors, config = make(version)
        folder = tmp_path_factory.mktemp(name)
        save_file(tensors, folder / "adapter_model.safetensors")
        (folder / "adapter_config.json").write_text(json.dumps(config))
        out[name] = str(folder)
    return out


@pytest.fixture(scope="module")
def local_ray():
    """A local Ray with 2 CPUs for the `ray` subject, started only when that subject runs."""
    ray = pytest.importorskip("ray")
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)  # not one already here
    yield
    ray.shutdown()


@pytest.fixture(params=KINDS)
def subject(request, tiny_model_dir, tokenizer) -> Iterator[Subject]:
    if request.param == "ray":
        request.getfixturevalue("local_ray")
        yield from _ray_subject(tiny_model_dir)
        return
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with EmbeddedEngine(model, tokenizer, max_batch_size=8) as backend:
        if request.param == "embedded":
            yield Subject(backend, [backend], [backend])
            return
        if request.param == "multi":
            second = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
            with EmbeddedEngine(second, tokenizer, max_batch_size=8) as other:
                yield Subject(MultiEngine([backend, other]), [backend, other], [backend, other])
            return
        if request.param == "server":
            app, client = create_app(backend, served_model_name="tiny"), functools.partial(HTTPEngine, SERVER)
        else:
            app, client = create_sglang_fake_app(backend), functools.partial(HTTPEngine, SGLANG)
        with serve_app_in_thread(app) as url, client(url, timeout_s=30, control_timeout_s=30) as engine:
            yield Subject(engine, [backend], [engine])


def _ray_subject(tiny_model_dir) -> Iterator[Subject]:
    """The registry's Ray replicas: one replica actor, its engine answering health and metrics itself."""
    model_cfg = ModelConfig(name_or_path=str(tiny_model_dir), dtype="float32", device="cpu")
    built = build_engine(EngineInputs(EmbeddedEngineConfig(ray_replicas=1, max_batch_size=8, timeout_s=30), model_cfg))
    try:
        replicas = list(built.engine.members())
        yield Subject(built.engine, replicas, replicas)
    finally:
        built.close()


def prompts(tokenizer, n: int) -> list[list[int]]:
    return [tokenizer(f"What is {i} + {2 * i}?")["input_ids"][: 3 + i % 4] for i in range(n)]


def wait_until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def queued(subject: Subject, n: int = 1) -> Callable[[], bool]:
    return lambda: subject.queue_depth() >= n


# ----------------------------------------------------------------- the protocols


def test_implements_both_protocols(subject):
    """Every kind serves both seams: the step's (`RolloutEngine`) and serving's (`ServingEngine`), and so do
    the single engines behind it."""
    from lora_rl_core.engines import RolloutEngine

    for engine in (subject.engine, *subject.engine.members()):
        assert isinstance(engine, RolloutEngine) and isinstance(engine, ServingEngine), type(engine).__name__


# ----------------------------------------------------------------- the step's protocol: generation


def test_generate_keeps_order_and_names_adapter_and_version(subject, tokenizer, adapter_dirs):
    engine = subject.engine
    engine.load_adapter(V1, path=adapter_dirs[V1])
    pairs = [(p, a) for p in prompts(tokenizer, 4) for a in (V1, None)]
    requests = [GenerationRequest(p, a, GREEDY) for p, a in pairs]
    got = engine.generate(requests)
    assert [c.request_id for c in got] == [r.request_id for r in requests]
    assert [(c.prompt_ids, c.adapter, c.adapter_version) for c in got] == [(p, a, adapter_version(a)) for p, a in pairs]
    assert all(c.finish_reason in ("eos", "length") and c.abort_reason is None for c in got)
    assert all(len(c.logprobs) == len(c.completion_ids) > 0 for c in got)

    backwards = engine.generate([GenerationRequest(p, a, GREEDY) for p, a in reversed(pairs)])
    assert [c.completion_ids for c in reversed(backwards)] == [c.completion_ids for c in got]  # mapped by position


def test_submit_resolves_like_generate(subject, tokenizer):
    prompt = prompts(tokenizer, 1)[0]
    request = GenerationRequest(prompt, None, GREEDY, request_id="submitted-1")
    done = subject.engine.submit(request).result(timeout=WAIT_S)
    assert (done.request_id, done.adapter, done.adapter_version) == ("submitted-1", None, None)
    [expected] = subject.engine.generate([GenerationRequest(prompt, None, GREEDY)])
    assert done.completion_ids == expected.completion_ids


def test_unknown_adapter_is_an_error_not_base_output(subject, tokenizer):
    requests = [GenerationRequest(p, "ghost-v000001", GREEDY) for p in prompts(tokenizer, 2)]
    with pytest.raises(EngineError, match="ghost-v000001"):
        subject.engine.generate(requests)
    assert subject.base_requests() == 0  # nothing was served by the base model instead


# ----------------------------------------------------------------- the step's protocol: adapters


def test_load_list_unload(subject, tokenizer, adapter_dirs):
    engine = subject.engine
    engine.load_adapter(V1, path=adapter_dirs[V1])
    engine.load_adapter(V2, path=adapter_dirs[V2])
    listed = engine.list_adapters()
    assert {name: info["version"] for name, info in listed.items()} == {V1: 1, V2: 2}
    with pytest.raises(EngineError, match=V1):
        engine.load_adapter(V1, path=adapter_dirs[V2])  # SGLang has no upsert: a loaded name is refused

    engine.unload_adapter(V1)
    assert list(engine.list_adapters()) == [V2]
    with pytest.raises(EngineError, match=V1):
        engine.generate([GenerationRequest(prompts(tokenizer, 1)[0], V1, GREEDY)])
    with pytest.raises(EngineError):
        engine.unload_adapter(V1)
    [done] = engine.generate([GenerationRequest(prompts(tokenizer, 1)[0], V2, GREEDY)])
    assert (done.adapter, done.adapter_version) == (V2, 2)


# ----------------------------------------------------------------- serving's protocol: submit (above), abort, pause


def test_abort_with_reason_ends_the_request(subject, tokenizer):
    engine = subject.engine
    engine.pause("in_place")  # the request waits in the queue until aborted
    try:
        request = GenerationRequest(prompts(tokenizer, 1)[0], None, GREEDY, request_id="to-abort")
        future = engine.submit(request)
        wait_until(queued(subject), "the request to be queued")
        assert engine.abort("to-abort", reason="timeout") == 1
        done = future.result(timeout=WAIT_S)
        assert (done.request_id, done.finish_reason, done.abort_reason) == ("to-abort", "abort", "timeout")
        assert done.completion_ids == [] and done.logprobs == []
        assert engine.abort("nobody") == 0
        with pytest.raises(EngineError, match="because"):
            engine.abort(None, reason="because")
    finally:
        engine.resume()


def test_pause_holds_requests_until_resume(subject, tokenizer):
    engine = subject.engine
    assert engine.is_paused() is False
    engine.pause("in_place")
    try:
        assert engine.health()["paused"] is True and engine.is_paused() is True
        future = engine.submit(GenerationRequest(prompts(tokenizer, 1)[0], None, GREEDY))
        wait_until(queued(subject), "the request to be queued")
        time.sleep(0.3)
        assert not future.done()
    finally:
        engine.resume()
    assert future.result(timeout=WAIT_S).finish_reason in ("eos", "length")
    assert engine.health()["paused"] is False and engine.is_paused() is False


def test_pause_abort_ends_queued_requests_as_paused(subject, tokenizer):
    engine = subject.engine
    engine.pause("in_place")
    try:
        futures = [engine.submit(GenerationRequest(p, None, GREEDY)) for p in prompts(tokenizer, 2)]
        wait_until(queued(subject, 2), "both requests to be queued")
        engine.pause("abort")
        done = [f.result(timeout=WAIT_S) for f in futures]
    finally:
        engine.resume()
    assert [(c.finish_reason, c.abort_reason) for c in done] == [("abort", "paused")] * 2


# ----------------------------------------------------------------- serving's protocol: flush, health; members, close


def test_flush_health_members_and_close(subject, tokenizer):
    engine = subject.engine
    assert engine.flush_cache() is True  # idle
    assert engine.health()["ok"] is True
    assert list(engine.members()) == subject.members
    engine.close()
    engine.close()  # idempotent
    with pytest.raises(EngineError, match="closed"):
        engine.generate([GenerationRequest(prompts(tokenizer, 1)[0], None, GREEDY)])


def test_close_ends_queued_requests_of_the_embedded_engine(tiny_model_dir, tokenizer):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    engine = EmbeddedEngine(model, tokenizer)
    engine.pause("in_place")
    future = engine.submit(GenerationRequest([5, 6, 7], None, GREEDY))
    engine.close()
    done = future.result(timeout=WAIT_S)
    assert (done.finish_reason, done.abort_reason) == ("abort", "engine_closed")


def test_multi_engine_members_flatten_and_abort_passes_the_reason(tiny_model_dir, tokenizer):
    from lora_rl_core.engines.multi import MultiEngine

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with EmbeddedEngine(model, tokenizer) as engine:
        inner = MultiEngine([engine])
        outer = MultiEngine([inner])
        assert outer.members() == [engine]
        assert outer.is_paused() is False
        engine.pause("in_place")
        assert outer.is_paused() is True  # a member is
        future = outer.submit(GenerationRequest([5, 6, 7], None, GREEDY, request_id="m1"))
        assert outer.abort("m1", reason="adapter_unloaded") == 1
        assert future.result(timeout=WAIT_S).abort_reason == "adapter_unloaded"
        outer.close()
        assert engine.health()["closed"] is True
        with pytest.raises(EngineError, match="closed"):
            outer.generate([GenerationRequest([5, 6, 7], None, GREEDY)])
