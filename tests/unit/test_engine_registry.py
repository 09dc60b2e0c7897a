"""`build_engine` (the registry of engine kinds): every engine is built from the `engine` section, and `lora-rl eval`
builds through it.

The embedded engine gets every limit of the config (here: the rank cap refuses a larger adapter, the pool
cap evicts); `server`/`sglang` give the HTTP clients (a `MultiEngine` for several URLs) with the Bearer
key from `engine.api_key_env`; `lora-rl eval` applies the config's engine limits and reads a stored
version by path.
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM
from typer.testing import CliRunner

from cli.main import app as cli
from lora_rl_core.config import load_config
from lora_rl_core.engines import EmbeddedEngine, EngineInputs, MultiEngine
from lora_rl_core.engines.registry import ENGINE_KINDS, build_engine
from lora_rl_core.engines.remote import SERVER, SGLANG, HTTPEngine
from lora_rl_core.errors import ConfigError, EngineError
from lora_rl_testing.adapters import random_lora_factory
from tests.integration.tiny_run import write_tiny_config


@pytest.fixture()
def lora(tiny_model_dir):
    """A rank-2 random adapter factory for the tiny model."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    return random_lora_factory(model, rank=2)


def test_embedded_engine_gets_the_config_limits(tiny_model_dir, lora, tmp_path):
    cfg = load_config(None, [f"model.name_or_path={tiny_model_dir}", "model.dtype=float32", "engine.max_lora_rank=1"])
    with build_engine(EngineInputs(cfg.engine, cfg.model)) as built:
        engine = built.engine
        assert isinstance(engine, EmbeddedEngine)
        tensors, config = lora(1)
        with pytest.raises(EngineError, match="rank"):
            engine.load_adapter("r-v000001", tensors=tensors, config=config)

    overrides = ["engine.max_loras_per_batch=1", "engine.max_loaded_loras=1", "engine.eviction_policy=fifo"]
    cfg = load_config(None, [f"model.name_or_path={tiny_model_dir}", "model.dtype=float32", *overrides])
    with build_engine(EngineInputs(cfg.engine, cfg.model)) as built:
        engine = built.engine
        for version in (1, 2):
            tensors, config = lora(version)
            engine.load_adapter(f"r-v{version:06d}", tensors=tensors, config=config)
        resident = {name: info["resident"] for name, info in engine.list_adapters().items()}
        assert resident == {"r-v000001": False, "r-v000002": True}  # one resident adapter at most


@pytest.mark.parametrize(("kind", "dialect"), [("server", SERVER), ("sglang", SGLANG)])
def test_remote_engines_are_http_clients_with_the_key_from_the_env(kind, dialect, monkeypatch):
    monkeypatch.setenv("MY_KEY", "s3cret")
    sync = ["engine.sync=store"] if kind == "sglang" else []
    one = ["engine.urls=[http://127.0.0.1:1]", "engine.api_key_env=MY_KEY", "engine.timeout_s=7"]
    cfg = load_config(None, [f"engine.type={kind}", *one, *sync])
    engine = build_engine(EngineInputs(cfg.engine)).engine
    try:
        assert isinstance(engine, HTTPEngine) and engine.dialect is dialect and engine.timeout_s == 7
        assert engine._http.headers["authorization"] == "Bearer s3cret"
        assert engine.members() == [engine]
    finally:
        engine.close()

    cfg = load_config(None, [f"engine.type={kind}", "engine.urls=[http://127.0.0.1:1,http://127.0.0.1:2]", *sync])
    engines = build_engine(EngineInputs(cfg.engine)).engine
    try:
        assert isinstance(engines, MultiEngine)
        assert [e.url for e in engines.members()] == ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    finally:
        engines.close()


def test_sglang_clients_get_the_tensor_transport_and_retire_policy():
    urls = "engine.urls=[http://127.0.0.1:1]"
    cfg = load_config(None, ["engine.type=sglang", urls, "engine.tensor_transport=inline", "engine.sglang_retire=keep"])
    engine = build_engine(EngineInputs(cfg.engine)).engine
    try:
        assert engine.tensors.transport == "inline" and engine.retire == "keep"
    finally:
        engine.close()
    server = build_engine(EngineInputs(load_config(None, ["engine.type=server", urls]).engine)).engine
    try:
        assert server.retire == "unload"  # our server unloads without hanging: the SGLang-only policy is not applied
    finally:
        server.close()


def test_every_engine_type_has_a_kind_and_replicas_only_where_the_config_allows_them():
    """One registry entry per value of `EngineConfig.type`; `ray_replicas` has a builder exactly for the kinds
    whose config the validator accepts with replicas."""
    from typing import get_args

    from lora_rl_core.config import EngineConfig

    kinds = get_args(get_args(EngineConfig)[0])  # the section's kinds (a `type`-keyed union)
    assert set(ENGINE_KINDS) == {get_args(kind.model_fields["type"].annotation)[0] for kind in kinds}
    assert {k for k, kind in ENGINE_KINDS.items() if kind.replicate is not None} == {"embedded", "sglang"}


def test_ray_replicas_need_the_embedded_engine_or_a_launched_sglang():
    with pytest.raises(ConfigError, match=r"engine.ray_replicas: not an option of engine.type server \(an option of"):
        load_config(None, ["engine.type=server", "engine.urls=[http://127.0.0.1:1]", "engine.ray_replicas=2"])
    with pytest.raises(ConfigError, match="engine.ray_replicas with engine.type sglang needs engine.launch.enabled"):
        load_config(None, ["engine.type=sglang", "engine.urls=[http://127.0.0.1:1]", "engine.ray_replicas=2"])


def test_eval_cli_uses_the_engine_config_and_a_stored_version(tiny_model_dir, lora, tmp_path):
    from lora_rl_core.store import AdapterStore

    config = write_tiny_config(tmp_path, tiny_model_dir, "ev")
    store = AdapterStore(f"file://{tmp_path / 'store'}")
    tensors, adapter_config = lora(1)
    store.publish("ev", 1, tensors=tensors, adapter_config=adapter_config, step=1, base_model="tiny")

    result = CliRunner().invoke(cli, ["eval", "-c", str(config), "--adapter", "ev@latest", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["n"] == 4

    limited = CliRunner().invoke(cli, ["eval", "-c", str(config), "engine.max_lora_rank=1", "--adapter", "ev@1"])
    assert isinstance(limited.exception, EngineError)  # `lora-rl` prints it as one `lora-rl: error:` line
    assert "rank" in str(limited.exception)


def test_closing_sglang_replicas_stops_every_actor_before_giving_back_ray(monkeypatch):
    """Regression: the run's use of Ray was given back (`release_ray`, which shuts down a Ray the run started)
    before the replica actors were stopped, so their servers were not stopped in order and `ray.kill` raised
    into the run's close. A stand-in `ray` module records the order of what closing does."""
    import sys
    import types

    from lora_rl_core.config import LoRAConfig, ModelConfig, SGLangEngineConfig, SGLangLaunchConfig
    from lora_rl_core.engines import BuiltEngine
    from lora_rl_core.engines.launch import ray_sglang

    events: list[str] = []

    class Call:
        def __init__(self, result):
            self.result = result

    class Method:
        def __init__(self, fn):
            self.fn = fn

        def remote(self, *args):
            return Call(self.fn(*args))

    class Actor:
        def __init__(self, inputs, index, log_dir):
            self.index = index
            url = f"http://127.0.0.1:{31000 + index}"
            self.resolved = Method(lambda: {"node": "127.0.0.1", "url": url, "flags": {}, "reasons": {}})
            self.stop = Method(lambda: events.append(f"stop {index}"))

    fake = types.ModuleType("ray")
    fake.remote = lambda cls: types.SimpleNamespace(options=lambda **kw: types.SimpleNamespace(remote=Actor))
    fake.get = lambda calls, timeout=None: [c.result for c in calls] if isinstance(calls, list) else calls.result
    fake.kill = lambda actor, no_restart=True: events.append(f"kill {actor.index}")
    monkeypatch.setitem(sys.modules, "ray", fake)
    monkeypatch.setattr(ray_sglang, "acquire_ray", lambda: events.append("acquire"))
    monkeypatch.setattr(ray_sglang, "release_ray", lambda: events.append("release"))

    class Clients:
        def close(self):
            events.append("close clients")

    engine = SGLangEngineConfig(ray_replicas=2, launch=SGLangLaunchConfig(enabled=True))
    inputs = EngineInputs(engine, ModelConfig(), LoRAConfig())
    built = ray_sglang.start_sglang_replicas(inputs, lambda urls: BuiltEngine(Clients()))  # type: ignore[arg-type]
    assert events == ["acquire"] and len(built.actors) == 2
    built.close()
    assert events == ["acquire", "close clients", "stop 0", "kill 0", "stop 1", "kill 1", "release"]
