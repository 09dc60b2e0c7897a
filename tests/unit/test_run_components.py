"""`open_run` builds every component once and owns them: the config snapshot is written, `close()` stops the
engine and forgets the run, a failure half-way closes what was built; a run that is not open is named."""

from __future__ import annotations

import pytest

from lora_rl_core.config import load_config
from lora_rl_core.errors import EngineError, LoraRLError, StoreError
from lora_rl_core.run import components, open_run
from lora_rl_core.run.rundir import RunDir
from tests.integration.tiny_run import write_tiny_config


@pytest.fixture
def cfg(tmp_path, tiny_model_dir):
    return load_config(write_tiny_config(tmp_path, tiny_model_dir, "comp"))


def test_open_run_writes_the_snapshot_and_close_stops_the_engine(cfg, tmp_path):
    run = open_run(cfg, "comp-1")
    try:
        snapshot = RunDir(cfg.store.uri, "comp-1").read_config()
        assert snapshot is not None and snapshot["lora"]["rank"] == 4
        plan = snapshot["plan"]  # the run plan, written once with the config
        assert plan["dtype"] == "float32" and plan["device"] == "cpu"
        assert plan["choices"]["trainer.micro_batch_size"]["value"] == cfg.trainer.micro_batch_size
        assert len(run.inputs.train) == 64 and len(run.inputs.test) == 4
        assert run.policy.version is None and run.engine.health()["ok"]
        assert components.get_run("comp-1") is run
        with pytest.raises(LoraRLError, match="run 'comp-1' is already open in this process"):
            open_run(cfg, "comp-1")
    finally:
        run.close()
    with pytest.raises(EngineError):
        run.engine.generate([])
    assert not components.is_open("comp-1")
    run.close()  # a second close does nothing


def test_a_failing_trainer_build_closes_the_engine(cfg, monkeypatch):
    built = []
    real_build_engine = components.build_engine

    def spy(*args, **kwargs):
        built.append(real_build_engine(*args, **kwargs))
        return built[-1]

    def broken(*args, **kwargs):
        raise RuntimeError("no trainer today")

    monkeypatch.setattr(components, "build_engine", spy)
    monkeypatch.setattr(components, "policy_model", broken)
    with pytest.raises(RuntimeError, match="no trainer today"):
        open_run(cfg, "comp-2")
    assert len(built) == 1 and not components.is_open("comp-2")
    with pytest.raises(EngineError):
        built[0].engine.generate([])


def test_bad_run_id_fails_before_anything_is_built(cfg):
    with pytest.raises(StoreError, match="invalid run id"):
        open_run(cfg, "../escape")


def test_a_run_that_is_not_open_is_named():
    with pytest.raises(LoraRLError, match="run 'nowhere' is not open in this process"):
        components.get_run("nowhere")
    components.close_run("nowhere")  # closing what is not open is a no-op


def test_a_version_held_by_a_rollout_is_not_retired_until_released(cfg):
    """Async rollouts hold the version they sample with: syncs retire versions beyond `max_staleness + 1`
    (here 2), but never a held one; the first sync after its release retires it."""
    from lora_rl_core.run import versions

    run = open_run(cfg, "comp-hold")
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
    run = open_run(cfg, f"loop-{mode}")
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


def test_a_run_is_built_once_per_process_and_the_flow_task_takes_the_open_run(cfg, monkeypatch):
    """Issue 44, item 2: `lora-rl train` opens the run (store, data, tokenizer, rewards, leak check, grader, plan,
    engine, trainer) before Prefect; the flow's `open_run` task takes it by id and only restores it. A flow run
    with no open run (a deployment's) validates the config and builds it once."""
    from lora_rl_core.config import StoreConfig
    from lora_rl_core.run import resume
    from tasks import steps

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
    monkeypatch.setattr(resume, "load_config", counted("config", lambda *args: cfg))  # the tiny config, validated
    from lora_rl_core import models

    monkeypatch.setattr(
        models.AutoTokenizer, "from_pretrained", counted("tokenizer", models.AutoTokenizer.from_pretrained)
    )
    with open_run(cfg, "comp-cli") as run:  # as `lora-rl train` opens it
        # the store inside the inputs; one tokenizer for the inputs, the engine and the trainer
        assert sorted(calls) == ["inputs", "plan", "store", "tokenizer"]
        calls.remove("tokenizer")
        info = steps.open_run.fn(None, [], "comp-cli")  # the flow's task: restores the open run, builds nothing
        assert info.run_id == "comp-cli" and components.get_run("comp-cli") is run and len(calls) == 3
    calls.clear()
    info = steps.open_run.fn("tiny.yaml", [], "comp-alone")  # nothing open: validated and built here, once
    try:
        assert sorted(calls) == ["config", "inputs", "plan", "store", "tokenizer"] and components.is_open(info.run_id)
    finally:
        components.close_run("comp-alone")


def test_the_default_run_id_is_the_configs_or_the_run_name_with_a_unique_suffix(cfg):
    mine = cfg.model_copy(update={"run": cfg.run.model_copy(update={"id": "mine"})})
    assert components.default_run_id(mine, "x") == "mine"
    named = cfg.model_copy(update={"run": cfg.run.model_copy(update={"id": None, "name": "arith"})})
    assert components.default_run_id(named, "0123456789abcdef") == "arith-01234567"
