"""`build_run` builds every component once and owns them: the config snapshot is written, `close()` stops
the engine, a failure half-way closes what was built; the tasks' registry names a run that is not open."""

from __future__ import annotations

import pytest

from lora_rl_core.config import load_config
from lora_rl_core.errors import EngineError, LoraRLError, StoreError
from lora_rl_core.run import components, start_run
from lora_rl_core.run.rundir import RunDir
from tasks import registry
from tests.integration.tiny_run import write_tiny_config


@pytest.fixture
def cfg(tmp_path, tiny_model_dir):
    return load_config(write_tiny_config(tmp_path, tiny_model_dir, "comp"))


def test_build_run_writes_the_snapshot_and_close_stops_the_engine(cfg, tmp_path):
    run = start_run(cfg, "comp-1")
    try:
        snapshot = RunDir(cfg.store.uri, "comp-1").read_config()
        assert snapshot is not None and snapshot["lora"]["rank"] == 4
        plan = snapshot["plan"]  # the run plan, written once with the config
        assert plan["dtype"] == "float32" and plan["device"] == "cpu"
        assert plan["choices"]["trainer.micro_batch_size"]["value"] == cfg.trainer.micro_batch_size
        assert len(run.inputs.train) == 64 and len(run.inputs.test) == 4
        assert run.policy.version is None and run.engine.health()["ok"]
    finally:
        run.close()
    with pytest.raises(EngineError):
        run.engine.generate([])


def test_a_failing_trainer_build_closes_the_engine(cfg, monkeypatch):
    built = []
    real_build_engine = components.build_engine

    def spy(*args, **kwargs):
        built.append(real_build_engine(*args, **kwargs))
        return built[-1]

    def broken(*args, **kwargs):
        raise RuntimeError("no trainer today")

    monkeypatch.setattr(components, "build_engine", spy)
    monkeypatch.setattr(components, "build_trainer", broken)
    with pytest.raises(RuntimeError, match="no trainer today"):
        start_run(cfg, "comp-2")
    assert len(built) == 1
    with pytest.raises(EngineError):
        built[0].engine.generate([])


def test_bad_run_id_fails_before_anything_is_built(cfg):
    with pytest.raises(StoreError, match="invalid run id"):
        start_run(cfg, "../escape")


def test_registry_names_a_run_that_is_not_open():
    with pytest.raises(LoraRLError, match="run 'nowhere' is not open in this process"):
        registry.get_run("nowhere")
    registry.close_run("nowhere")  # closing what is not open is a no-op


def test_a_version_held_by_a_rollout_is_not_retired_until_released(cfg):
    """Async rollouts hold the version they sample with: syncs retire versions beyond `max_staleness + 1`
    (here 2), but never a held one; the first sync after its release retires it."""
    from lora_rl_core.run import versions

    run = start_run(cfg, "comp-hold")
    try:
        versions.sync(run, versions.publish(run, 0))
        listed = lambda: sorted(n for n in run.engine.list_adapters() if n.startswith("comp-hold"))  # noqa: E731
        with run.policy.hold() as held:
            assert held == 0 and run.policy.held() == {0}
            for step in (1, 2, 3):
                stats = versions.sync(run, versions.publish(run, step))
                assert stats.adapter == f"comp-hold-v{step:06d}"
            assert listed() == ["comp-hold-v000000", "comp-hold-v000002", "comp-hold-v000003"]
            assert stats.retired == ["comp-hold-v000001"]  # at the sync of v3; v0, older, stays held
        assert run.policy.held() == set()
        stats = versions.sync(run, versions.publish(run, 4))
        assert stats.retired == ["comp-hold-v000000", "comp-hold-v000002"]
        assert listed() == ["comp-hold-v000003", "comp-hold-v000004"]
    finally:
        run.close()


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_the_library_loop_trains_a_tiny_run_without_prefect(tmp_path, tiny_model_dir, mode):
    """`run_steps` over `RunPhases`: two steps publish versions 1 and 2 and the engine serves the last; in async
    mode the rollouts run on a worker thread, one step ahead, and stay within `max_staleness`."""
    from lora_rl_core.run.loop import RunPhases, run_steps

    cfg = load_config(write_tiny_config(tmp_path, tiny_model_dir, f"loop-{mode}"), [f"rollout.mode={mode}"])
    run = start_run(cfg, f"loop-{mode}")
    try:
        with RunPhases(run) as phases:
            done = run_steps(phases, steps=2, ahead=run.plan.rollouts_ahead())
        assert done.final.version == 2 and [m["step"] for m in done.history] == [1, 2]
        assert run.policy.version == 2 and f"loop-{mode}-v000002" in run.engine.list_adapters()
        assert run.store.versions(f"loop-{mode}") == [0, 1, 2]
        assert all(m["stale_rejected"] == 0 for m in done.history)
        # the train phase's parts, for the GPU benchmarks: the update seen from the run holds the trainer's own
        # time, and every step's checkpoint (checkpoint_every 1) had its snapshot timed
        assert all(m["update_seconds"] >= m["train_seconds"] > 0 for m in done.history)
        assert all(m["checkpointed"] and m["snapshot_seconds"] > 0 for m in done.history)
    finally:
        run.close()


def test_the_kv_cache_is_released_for_the_block_and_taken_back_even_when_it_fails():
    from types import SimpleNamespace

    from lora_rl_core.run.components import RunComponents

    calls: list[str] = []

    class Server:
        def __init__(self, name: str, saver: bool) -> None:
            self.name, self.memory_saver = name, saver

        def release_memory(self) -> float:
            calls.append(f"release {self.name}")
            return 0.0

        def resume_memory(self) -> float:
            calls.append(f"resume {self.name}")
            return 0.0

    run = SimpleNamespace(built=SimpleNamespace(servers=[Server("a", True), Server("b", False)]))
    with RunComponents.engine_memory_released(run):  # type: ignore[arg-type]
        calls.append("train")
    assert calls == ["release a", "train", "resume a"]  # a server without the saver is left alone
    calls.clear()
    with pytest.raises(RuntimeError), RunComponents.engine_memory_released(run):  # type: ignore[arg-type]
        calls.append("train")
        raise RuntimeError("out of memory")
    assert calls == ["release a", "train", "resume a"]


def test_a_failed_resume_after_a_failed_update_does_not_hide_the_update_error(caplog):
    """SGLang's resume fails when the trainer's failed step still holds the GPU: the trainer's error is the one
    the run reports (it names the fix), the resume's is logged."""
    from types import SimpleNamespace

    from lora_rl_core.errors import EngineError, TrainerOutOfMemoryError
    from lora_rl_core.run.components import RunComponents

    class Server:
        memory_saver = True

        def release_memory(self) -> float:
            return 0.0

        def resume_memory(self) -> float:
            raise EngineError("SGLang /resume_memory_occupation failed: server disconnected")

    run = SimpleNamespace(built=SimpleNamespace(servers=[Server()]))
    with pytest.raises(TrainerOutOfMemoryError, match="lower"), RunComponents.engine_memory_released(run):  # type: ignore[arg-type]
        raise TrainerOutOfMemoryError("out of GPU memory: lower rollout.max_new_tokens")
    assert "resume_memory_occupation failed" in caplog.text
    with pytest.raises(EngineError, match="resume_memory_occupation"), RunComponents.engine_memory_released(run):  # type: ignore[arg-type]
        pass  # after an update that succeeded, a failed resume is the error


def test_a_run_is_prepared_once_per_process_and_the_flow_builds_from_what_the_cli_handed_over(cfg, monkeypatch):
    """Issue 44, item 2: `lora-rl train` prepares the run (store, data, tokenizer, rewards, leak check, grader,
    plan) before Prefect and hands it over; the flow's `open_run` builds from it without preparing again. A
    flow run with nothing handed over (a deployment's) prepares once."""
    from lora_rl_core.config import StoreConfig
    from lora_rl_core.run import prepare_run

    calls: list[str] = []
    real_load, real_plan, real_store = components.load_inputs, components.make_plan, StoreConfig.build

    def counted(name, fn):
        def spy(*args, **kwargs):
            calls.append(name)
            return fn(*args, **kwargs)

        return spy

    monkeypatch.setattr(components, "load_inputs", counted("inputs", real_load))
    monkeypatch.setattr(components, "make_plan", counted("plan", real_plan))
    monkeypatch.setattr(StoreConfig, "build", counted("store", real_store))
    prepared = prepare_run(cfg)
    assert sorted(calls) == ["inputs", "plan", "store"]  # the store inside the inputs
    same_config = type(cfg).model_validate_json(cfg.model_dump_json())  # as a flow's parameter may arrive
    with registry.handed_over(prepared):
        try:
            registry.open_run(same_config, "comp-handed")
            run = registry.get_run("comp-handed")
            assert run.inputs is prepared.inputs and run.plan is prepared.plan and len(calls) == 3
        finally:
            registry.close_run("comp-handed")
    calls.clear()
    try:
        registry.open_run(cfg, "comp-alone")  # nothing handed over: prepared here, once
        assert sorted(calls) == ["inputs", "plan", "store"]
    finally:
        registry.close_run("comp-alone")


def test_a_prepared_run_no_flow_took_is_closed_at_the_end_of_the_hand_over(cfg, monkeypatch):
    from lora_rl_core.run import prepare_run

    prepared = prepare_run(cfg)
    closed: list[bool] = []
    monkeypatch.setattr(type(prepared.inputs.grader), "close", lambda self: closed.append(True))
    with registry.handed_over(prepared):
        pass  # the flow failed before open_run
    assert closed == [True]
