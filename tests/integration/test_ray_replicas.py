"""Engine replicas and trainer ranks as Ray actors (`lora_rl_core.engines.launch.ray_replicas`,
`lora_rl_core.trainer.ray_actors`) on a local Ray with 2 CPUs.

Checked: 2 replicas give the same greedy completions as 1 and as the in-process engine, with an adapter
loaded from tensors into every replica; a replica whose actor was killed is replaced by a new actor that
reloads its adapters, and the call goes through (with replacement off it fails with `EngineUnavailable`
naming it, and health says so); the flow runs with 2 replicas; the flow with 2 FSDP2
ranks on Ray ends with the in-process run's adapter (within 1e-5); the session's leak check
(tests/support/processes.py) fails the module if a Ray process outlives `ray.shutdown()`.
"""

from __future__ import annotations

import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from lora_rl_core.config import EmbeddedEngineConfig, ModelConfig
from lora_rl_core.engines import EngineInputs, GenerationRequest, SamplingParams
from lora_rl_core.engines.embedded.build import build_embedded_engine
from lora_rl_core.engines.registry import build_engine
from lora_rl_core.errors import EngineUnavailable
from lora_rl_core.subscriber import is_paused
from lora_rl_testing.adapters import random_lora_factory
from tests.support.processes import ended

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.slow  # a local Ray cluster and model loads in actors

GREEDY = SamplingParams(max_new_tokens=5, temperature=0.0)
NAME = "ray-v000001"


@pytest.fixture(scope="module")
def local_ray():
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)  # not one already here
    yield
    ray.shutdown()


@pytest.fixture
def setup(tiny_model_dir):
    model_cfg = ModelConfig(name_or_path=str(tiny_model_dir), dtype="float32", device="cpu")
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    tensors, config = random_lora_factory(model, scale=1.0)(1)
    prompts = [[5, 6, 7], [9, 4], [3, 3, 8, 1], [7, 7], [2, 9, 9]]
    requests = [GenerationRequest(p, a, GREEDY) for p in prompts for a in (None, NAME) for _ in range(2)]
    return model_cfg, tensors, config, requests


def _run(engine, tensors, config, requests) -> list[list[int]]:
    engine.load_adapter(NAME, tensors=tensors, config=config)
    out = engine.generate(requests)
    assert [c.adapter for c in out] == [r.adapter for r in requests]
    return [c.completion_ids for c in out]


def test_two_replicas_generate_what_one_and_the_in_process_engine_generate(local_ray, setup):
    model_cfg, tensors, config, requests = setup
    with build_embedded_engine(EmbeddedEngineConfig(), model_cfg, None) as local:
        want = _run(local, tensors, config, requests)
    one = build_engine(EngineInputs(EmbeddedEngineConfig(ray_replicas=1), model_cfg))  # the registry's Ray replicas
    try:
        assert _run(one.engine, tensors, config, requests) == want
    finally:
        one.close()
    two = build_engine(EngineInputs(EmbeddedEngineConfig(ray_replicas=2), model_cfg))
    try:
        assert _run(two.engine, tensors, config, requests) == want
        assert all(NAME in m.list_adapters() for m in two.engine.members())  # the load reached every replica
        served = [m.metrics()["adapters"].get(NAME, {}).get("requests", 0) for m in two.engine.members()]
        assert all(n > 0 for n in served)  # both replicas took prompts
        # each replica resolved the model's device and dtype on its own host, and said what it chose
        assert [(r["device"], r["dtype"]) for r in two.resolved] == [("cpu", model_cfg.dtype)] * 2
        assert all(r["node"] and r["dtype_reason"] for r in two.resolved)
    finally:
        two.close()


def test_a_killed_replica_is_replaced_with_its_adapters_and_the_call_goes_through(local_ray, setup):
    model_cfg, tensors, config, requests = setup
    built = build_engine(EngineInputs(EmbeddedEngineConfig(ray_replicas=2), model_cfg))
    engines = built.engine
    try:
        want = _run(engines, tensors, config, requests)
        victim = engines.members()[1]
        dead_pid = ray.get(victim.actor.pid.remote())
        ray.kill(victim.actor, no_restart=True)
        out = engines.generate(requests)  # replica-1's share fails, is replaced, and runs again there
        assert [c.completion_ids for c in out] == want
        assert ray.get(victim.actor.pid.remote()) != dead_pid
        assert NAME in victim.list_adapters()  # the new actor reloaded the adapter the dead one held
        assert [m.metrics()["replica_replacements"] for m in engines.members()] == [0, 1]
        assert engines.health()["ok"] is True and engines.is_paused() is False
        engines.members()[0].pause("in_place")
        assert engines.is_paused() is True  # one replica paused: the group is
        engines.members()[0].resume()
    finally:
        built.close()


def test_a_killed_replica_fails_the_call_naming_it_without_replacement(local_ray, setup):
    model_cfg, tensors, config, requests = setup
    built = build_engine(EngineInputs(EmbeddedEngineConfig(ray_replicas=2, ray_replace_dead=False), model_cfg))
    engines = built.engine
    try:
        engines.load_adapter(NAME, tensors=tensors, config=config)
        victim = engines.members()[1]
        ray.kill(victim.actor, no_restart=True)
        with pytest.raises(EngineUnavailable, match="replica-1 died"):
            engines.generate(requests)
        health = engines.health()
        assert health["ok"] is False and health["engines"][0]["ok"] is True
        assert "replica-1 died" in health["engines"][1]["error"]
        with pytest.raises(EngineUnavailable, match="replica-1 died"):
            engines.is_paused()
        assert is_paused(engines) is True  # it cannot say: nothing is unloaded there
    finally:
        built.close()


def test_flow_with_two_engine_replicas_on_ray(local_ray, tiny_model_dir, tmp_path):
    """engine.ray_replicas=2: the training flow's rollouts fan out over two replica actors, every version
    reaches both (tensor path), and the run ends with both serving the last version."""
    from flows.grpo_lora import train
    from tests.integration.tiny_run import write_tiny_config

    path = write_tiny_config(tmp_path, tiny_model_dir, "ray-flow")
    overrides = ["engine.ray_replicas=2", "trainer.steps=2", f"store.uri=file://{tmp_path / 'store'}"]
    summary = train(config_path=str(path), run_id="it-ray", overrides=overrides)
    assert summary["final_adapter"] == "it-ray-v000002"
    from lora_rl_core.run.rundir import RunDir

    snapshot = RunDir(f"file://{tmp_path / 'store'}", "it-ray").read_config()
    assert snapshot is not None and [r["device"] for r in snapshot["plan"]["replicas"]] == ["cpu", "cpu"]
    assert ray.is_initialized()  # the test's cluster: the run neither started nor stopped it
    assert not ray.util.list_named_actors()  # nothing left behind


def test_flow_with_two_trainer_ranks_on_ray_matches_in_process(local_ray, tiny_model_dir, tmp_path):
    """trainer.backend: {type: ray, world_size: 2}: two gloo FSDP2 ranks as Ray actors end with the adapter of
    the in-process run (within 1e-5); their actors and placement group are gone afterwards."""
    from flows.grpo_lora import train
    from lora_rl_core.store import AdapterStore
    from tests.integration.tiny_run import write_tiny_config

    path = write_tiny_config(tmp_path, tiny_model_dir, "ray-trainer")
    train(config_path=str(path), run_id="it-solo")
    train(
        config_path=str(path), run_id="it-ray-fsdp", overrides=["trainer.backend=ray", "trainer.backend.world_size=2"]
    )
    store = AdapterStore(f"file://{tmp_path / 'store'}")
    solo, _ = store.load_tensors("it-solo", 2)
    ranks, _ = store.load_tensors("it-ray-fsdp", 2)
    for key in solo:
        torch.testing.assert_close(ranks[key], solo[key], atol=1e-5, rtol=1e-4)
    assert ray.is_initialized()  # the test's cluster: the run neither started nor stopped it
    assert all(g["state"] == "REMOVED" for g in ray.util.placement_group_table().values())
    deadline = time.monotonic() + 30
    while ray.available_resources().get("CPU") != 2.0 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray.available_resources().get("CPU") == 2.0  # every rank's CPU is back: the actors are gone


def _sglang_replicas_config(tmp_path, tiny_model_dir, name: str):
    """Two SGLang replicas on Ray, each launching the look-alike server (lora_rl_testing/fake_sglang) on its
    own port (`launch.port + i`)."""
    import socket

    from lora_rl_testing.fake_launch import fake_launch
    from tests.integration.tiny_run import write_tiny_config

    def free(port: int) -> bool:
        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", port)) != 0

    port = next(p for p in range(31000, 32000, 7) if free(p) and free(p + 1))
    launch = fake_launch(port=port)
    engine = {"type": "sglang", "sync": "store", "ray_replicas": 2, "ray_gpus_per_replica": 0, "launch": launch}
    return write_tiny_config(tmp_path, tiny_model_dir, name, engine=engine, run={"eval_before_after": False})


def test_sglang_replicas_on_ray_own_their_servers(local_ray, tiny_model_dir, tmp_path, setup):
    """engine.type=sglang + launch + ray_replicas=2: two actors each launch a server; generation spreads over
    both and equals the in-process engine's; a load reaches both; killing an actor stops its server (its
    reaper) and fails the call naming that server; closing the run stops everything."""
    from lora_rl_core.config import load_config
    from lora_rl_core.engines import MultiEngine
    from lora_rl_core.run import open_run
    from lora_rl_testing.adapters import write_peft_folder

    model_cfg, tensors, config, requests = setup
    with build_embedded_engine(EmbeddedEngineConfig(), model_cfg, None) as local:
        want = _run(local, tensors, config, requests)
    folder = write_peft_folder(tensors, config, tmp_path / "adapter")
    run = open_run(load_config(_sglang_replicas_config(tmp_path, tiny_model_dir, "ray-sgl")), "ray-sgl")
    try:
        assert isinstance(run.engine, MultiEngine) and len(run.engine.members()) == 2
        answers = run.runtime["replicas"]  # each server's flags, resolved on its host
        assert [a["url"] for a in answers] == [m.url for m in run.engine.members()]
        assert all(a["reasons"] and a["flags"].keys() == a["reasons"].keys() for a in answers)
        pids = ray.get([a.pids.remote() for a in run.built.actors])
        run.engine.load_adapter(NAME, path=str(folder))
        assert all(NAME in m.list_adapters() for m in run.engine.members())
        assert [c.completion_ids for c in run.engine.generate(requests)] == want
        ray.kill(run.built.actors[1], no_restart=True)
        assert ended(pids[1]["server"], 20) and ended(pids[1]["reaper"], 20)  # the reaper stopped the orphaned server
        url = run.engine.members()[1].url
        with pytest.raises(EngineUnavailable, match=url.split("//")[1]):
            run.engine.generate(requests)
    finally:
        run.close()
    assert all(ended(p["server"]) and ended(p["reaper"]) for p in pids)
