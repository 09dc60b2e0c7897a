"""Publish and checkpoint off the critical path (`trainer.background_publish`), on a tiny run without Prefect.

The store's `write` is gated in these tests, so the upload of a version is provably still running while the
publish has returned and the engine serves the version from memory; a store sync waits for the upload; a
failed upload fails the next step naming the version and its cause and leaves what was stored intact; a
resumed run re-publishes a version whose upload was lost from the restored trainer, and replays the stats of
steps its checkpoint holds instead of training them again.
"""

from __future__ import annotations

import copy
import hashlib
import threading

import pytest
import torch

from lora_rl_core.adapters import safetensors_bytes
from lora_rl_core.checkpoint import CheckpointStore
from lora_rl_core.config import load_config
from lora_rl_core.engines.registry import sync_reads_folder
from lora_rl_core.errors import BackgroundWriteError, ConfigError, StoreError
from lora_rl_core.faults import InjectedFault
from lora_rl_core.records import TrainStats
from lora_rl_core.run import open_run, phases, versions
from lora_rl_core.run.checkpoints import commit_checkpoints, start_checkpoint
from lora_rl_core.run.components import Restored
from lora_rl_core.run.resume import restore
from lora_rl_core.subscriber import SyncResult
from tests.integration.tiny_run import write_tiny_config


@pytest.fixture
def make_run(tmp_path, tiny_model_dir):
    built = []

    def make(run_id: str = "bg", *overrides: str):
        cfg = load_config(write_tiny_config(tmp_path, tiny_model_dir, run_id), list(overrides))
        built.append(open_run(cfg, run_id))
        return built[-1]

    yield make
    for run in built:
        run.close()


def first_version(run) -> None:
    """Publish and sync version 0 and wait for its background write: each test starts from it in the store."""
    versions.sync(run, versions.publish(run, 0))
    versions.flush(run)


def _gate(run, method: str, version_of) -> threading.Event:
    """Hold every call of `run.store.<method>` for a version from 1 on until the returned event is set."""
    gate, real = threading.Event(), getattr(run.store, method)

    def gated(*args, **kwargs):
        if version_of(*args) >= 1:
            assert gate.wait(30), "the test never opened the gate"
        return real(*args, **kwargs)

    setattr(run.store, method, gated)
    return gate


def gate_writes(run) -> threading.Event:
    """Hold every version write (`AdapterStore.write`) from version 1 on until the returned event is set."""
    return _gate(run, "write", lambda prepared: prepared.manifest.version)


def test_publish_returns_before_the_upload_and_the_engine_serves_the_version_from_memory(make_run):
    run = make_run()
    first_version(run)
    gate = gate_writes(run)
    try:
        ref = versions.publish(run, 1)
        stats = versions.sync(run, ref)  # engine.sync tensor, embedded engine: no wait for the store
        assert stats.adapter == "bg-v000001" and stats.sync_path == "tensor" and run.policy.version == 1
        assert "bg-v000001" in run.engine.list_adapters()
        assert run.store.versions("bg") == [0]  # not visible before it is complete
    finally:
        gate.set()
    versions.flush(run)
    assert run.store.versions("bg") == [0, 1] and ref.sha256 is None  # returned before the version was serialised
    assert run.store.ref("bg", 1).model_copy(update={"sha256": None}) == ref  # otherwise exact at once


def gate_prepares(run) -> threading.Event:
    """Hold the serialisation (`AdapterStore.prepare`) of every version from 1 on until the event is set."""
    return _gate(run, "prepare", lambda run_id, version: version)


def test_serialising_a_version_is_off_the_critical_path_but_bad_tensors_fail_at_once(make_run):
    run = make_run()
    first_version(run)
    gate = gate_prepares(run)
    try:
        ref = versions.publish(run, 1)  # the serialisation (safetensors bytes, sha256) waits at the gate
        assert ref.sha256 is None and not run.policy.pending.prepared.done()
        assert versions.sync(run, ref).sync_path == "tensor" and run.policy.version == 1
        with torch.no_grad():
            run.trainer.params[0].fill_(float("nan"))
        with pytest.raises(StoreError, match="NaN or inf values"):
            versions.publish(run, 2)  # checked before an engine gets it, not in the background
    finally:
        gate.set()
    versions.flush(run)
    assert run.store.versions("bg") == [0, 1] and run.policy.pending is None


def test_an_engine_reporting_a_checksum_is_checked_against_the_versions_bytes(make_run, monkeypatch):
    """Our server reports the sha256 of what it loaded: checked against the version's bytes, hashed in place
    while the writer has not serialised them (no wait behind the step's checkpoint)."""
    run = make_run()
    first_version(run)
    listed = run.engine.list_adapters
    reported = {"sha256": "0" * 64}
    monkeypatch.setattr(run.engine, "list_adapters", lambda: {k: {**v, **reported} for k, v in listed().items()})
    stats = versions.sync(run, versions.publish(run, 1))
    assert stats.skipped == "bg-v000001" and "sha256 " + "0" * 64 in stats.error and run.policy.version == 0
    versions.flush(run)
    reported["sha256"] = hashlib.sha256(safetensors_bytes(run.trainer.adapter_state()[0])).hexdigest()
    gate = gate_prepares(run)
    try:
        ref = versions.publish(run, 2)
        pending = run.policy.pending
        assert versions.sync(run, ref).adapter == "bg-v000002" and run.policy.version == 2
        assert ref.sha256 is None and not pending.prepared.done()  # checked without the writer's bytes
    finally:
        gate.set()
    versions.flush(run)
    assert run.store.ref("bg", 2).sha256 == reported["sha256"]  # what the engine was checked against


def test_a_failed_serialisation_fails_the_next_step_and_nobody_waits_on_its_checksum(make_run, monkeypatch):
    run = make_run()
    first_version(run)

    def broken(*args, **kwargs):
        raise OSError("disk full while serialising")

    monkeypatch.setattr(run.store, "prepare", broken)
    ref = versions.publish(run, 1)
    pending = run.policy.pending
    with pytest.raises(BackgroundWriteError, match="adapter version bg-v000001.*disk full"):
        pending.stored.result(timeout=30)
    assert isinstance(pending.prepared.exception(timeout=30), BackgroundWriteError)  # a waiter would wake
    with pytest.raises(BackgroundWriteError, match="disk full"):
        pending.checksum()  # raises instead of waiting for bytes that never come
    with pytest.raises(BackgroundWriteError, match="disk full"):
        versions.publish(run, 2)
    assert ref.sha256 is None and run.store.versions("bg") == [0]


def test_a_store_sync_waits_for_the_upload_of_its_version(make_run):
    run = make_run("bg", "engine.sync=store")
    first_version(run)
    gate = gate_writes(run)
    ref = versions.publish(run, 1)
    result: list = []
    syncing = threading.Thread(target=lambda: result.append(versions.sync(run, ref)))
    syncing.start()
    syncing.join(0.5)
    assert syncing.is_alive() and run.policy.version == 0  # waiting for the upload
    gate.set()
    syncing.join(30)
    assert result[0].adapter == "bg-v000001" and result[0].sync_path == "store"


def test_a_failed_tensor_sync_tries_again_once_the_version_is_stored(make_run, monkeypatch):
    """SGLang falls back to the published folder when it refuses tensors: that folder must be there."""
    run = make_run()
    first_version(run)
    gate = gate_writes(run)
    real, calls = versions.sync_version, []

    def refuses_until_stored(engines, ref, **kwargs):
        calls.append(1 in run.store.versions("bg"))
        if not calls[-1]:
            threading.Timer(0.2, gate.set).start()
            return SyncResult(ref.name, ref.version, False, "tensor", 1, error="tensors refused")
        return real(engines, ref, **kwargs)

    monkeypatch.setattr(versions, "sync_version", refuses_until_stored)
    stats = versions.sync(run, versions.publish(run, 1))
    assert calls == [False, True] and stats.adapter == "bg-v000001" and stats.error is None


def test_a_failed_upload_fails_the_next_step_naming_the_version_and_keeps_what_was_stored(
    make_run, monkeypatch, tmp_path
):
    run = make_run()
    first_version(run)
    monkeypatch.setenv("LORA_RL_FAULT", "publish:1")  # raises with v1's files written, before its manifest
    ref = versions.publish(run, 1)  # returns: the upload fails in the background
    upload = run.policy.pending.stored
    versions.sync(run, ref)
    message = r"adapter version bg-v000001.*InjectedFault: injected fault at publish step 1"
    with pytest.raises(BackgroundWriteError, match=message):
        upload.result(timeout=30)
    with pytest.raises(BackgroundWriteError, match=message) as info:
        phases.train(run, 2)  # the next step fails before it computes an update
    assert isinstance(info.value.__cause__, InjectedFault)
    with pytest.raises(BackgroundWriteError, match=message):
        versions.publish(run, 2)
    with pytest.raises(BackgroundWriteError, match=message):
        versions.flush(run)
    assert run.store.versions("bg") == [0] and run.store.load_tensors("bg", 0)[0]
    assert not (tmp_path / "store" / "bg" / "adapters" / "v000001" / "manifest.json").exists()


def test_without_background_publish_the_upload_happens_inside_publish(make_run, monkeypatch):
    run = make_run("fg", "trainer.background_publish=false")
    ref = versions.publish(run, 0)
    assert ref == run.store.ref("fg", 0) and ref.sha256 is not None  # complete: written inline
    versions.sync(run, ref)
    assert run.store.versions("fg") == [0] and not run.writer.background
    monkeypatch.setenv("LORA_RL_FAULT", "publish:1")
    with pytest.raises(InjectedFault):
        versions.publish(run, 1)
    assert run.store.versions("fg") == [0]


def _checkpoint(run, step: int) -> None:
    """The checkpoint of `step`, complete: the ranks' parts, then the run's part and the manifest."""
    start_checkpoint(run, step)
    commit_checkpoints(run, wait=True)
    run.writer.flush()


def test_snapshots_do_not_change_when_the_trainer_moves_on(make_run, monkeypatch):
    """The checkpoint and the version hold the weights of when they were taken, although the trainer's next
    update (in place) runs before the checkpoint's upload does."""
    run = make_run()
    before = run.trainer.state_dict()["tensors"]
    gate, upload = threading.Event(), CheckpointStore.write_shard
    monkeypatch.setattr(CheckpointStore, "write_shard", lambda self, *a: (gate.wait(30), upload(self, *a))[1])
    start_checkpoint(run, 1)
    tensors, _ = run.trainer.adapter_state()
    adapter_before = copy.deepcopy(tensors)
    with torch.no_grad():
        for p in run.trainer.params:  # what the next optimizer step does: in place
            p.add_(1.0)
    gate.set()
    versions.flush(run)
    saved = run.checkpoints.load(run.run_id, 1)["trainer"]["tensors"]
    assert saved.keys() == before.keys()
    for key, value in before.items():
        assert torch.equal(saved[key], value), key
    assert all(torch.equal(tensors[k], adapter_before[k]) for k in tensors)


def test_a_resumed_run_republishes_a_lost_version_from_the_restored_trainer_and_replays_its_step(make_run, monkeypatch):
    """A crash between step 1's checkpoint and its version: the resumed run restores step 1 and publishes
    version 1 from it; step 1's train phase returns its record without training; version 0 is the stored one."""
    first = make_run("lost")
    versions.sync(first, versions.publish(first, 0))
    with torch.no_grad():
        for p in first.trainer.params:  # step 1's update, as far as the store can tell
            p.add_(0.01)
    recorded = TrainStats(
        trainer={"loss": -1.5}, trained_rows=8, stale_rejected=0, uniform_skipped=0, checkpointed=True
    )
    first.run_dir.write_phase("trained", 1, recorded)
    _checkpoint(first, 1)
    expected, _ = first.trainer.adapter_state()
    monkeypatch.setenv("LORA_RL_FAULT", "publish:1")
    versions.publish(first, 1)
    with pytest.raises(BackgroundWriteError):
        versions.flush(first)
    first.close()
    monkeypatch.delenv("LORA_RL_FAULT")

    second = make_run("lost")
    info = restore(second)
    assert info.restored_step == 1 and second.restored == Restored(step=1, newest_version=0)
    monkeypatch.setattr(second.trainer, "train_step", lambda batch: pytest.fail("step 1 is in the checkpoint"))
    assert phases.train(second, 1) == recorded
    assert versions.publish(second, 0) == second.store.ref("lost", 0)  # as stored, nothing written
    versions.sync(second, versions.publish(second, 1))
    versions.flush(second)
    assert second.store.versions("lost") == [0, 1]
    stored, _ = second.store.load_tensors("lost", 1)
    assert all(torch.equal(stored[k], expected[k]) for k in expected)


def test_a_resumed_run_refuses_to_publish_a_missing_version_it_is_past(make_run):
    run = make_run("gap")
    run.restored = Restored(step=3, newest_version=1)
    with pytest.raises(StoreError, match="version 2 of run gap is missing.*checkpoint of step 3"):
        versions.publish(run, 2)


@pytest.mark.parametrize(
    ("engine", "reads"),
    [
        ({}, False),  # embedded, tensors in process
        ({"sync": "store"}, True),
        ({"type": "server", "urls": ["http://10.0.0.2:30000"]}, False),  # our server takes the tensors
        ({"type": "sglang", "urls": ["http://10.0.0.2:30000"], "tensor_transport": "inline"}, False),
        ({"type": "sglang", "urls": ["http://127.0.0.1:30000"], "tensor_transport": "ipc"}, False),
        ({"type": "sglang", "urls": ["http://127.0.0.1:30000"], "tensor_transport": "disk"}, True),
        ({"type": "sglang", "urls": ["http://10.0.0.2:30000"]}, True),  # auto: another host gets the folder
        ({"type": "sglang", "urls": ["http://127.0.0.1:30000"]}, not torch.cuda.is_available()),  # auto: ipc w/ CUDA
    ],
)
def test_which_syncs_wait_for_the_upload(engine, reads):
    from lora_rl_core.config import RunConfig
    from lora_rl_core.plan import make_plan

    assert make_plan(RunConfig.model_validate({"engine": engine}), train=False).engine.sync_reads_folder is reads


def test_sglang_launched_on_another_gpu_gets_the_file_transport(monkeypatch):
    """`auto` for a launched SGLang that cannot see the trainer's GPU: a local folder per load (`file`), which
    does not wait for the store write (the published folder, `disk`, waits behind the step's checkpoint)."""
    from lora_rl_core.plan.gpus import sglang_shares_trainer_gpu
    from lora_rl_core.plan.make import _transport
    from lora_rl_core.plan.placement import Placement

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    launched = ["engine.type=sglang", "engine.launch.enabled=true"]
    split = load_config(None, [*launched, 'engine.launch.env={"CUDA_VISIBLE_DEVICES": "0"}', "model.device=cuda:1"])
    shared = load_config(None, [*launched, "model.device=cuda:0"])
    chosen = {
        name: _transport(
            cfg,
            torch.device(cfg.model.device),
            sglang_shares_trainer_gpu(cfg, torch.device(cfg.model.device)),
            Placement("as configured"),
        )
        for name, cfg in (("split", split), ("shared", shared))
    }
    assert chosen["split"].value == "file"
    assert not sync_reads_folder(split.engine, "file")
    assert chosen["shared"].value in ("auto", "ipc")  # ipc on the same GPU (where CUDA is here)


def test_a_run_resumed_in_another_rollout_mode_says_so(make_run, caplog):
    """The checkpoint records the resolved rollout.mode; a resume that resolves another one (another machine,
    another setting) warns, naming the setting that keeps the old one."""
    first = make_run("modes")
    assert first.plan.rollout_mode == "sync"  # a CPU: auto is sync
    _checkpoint(first, 1)
    first.close()
    second = make_run("modes", "rollout.mode=async")
    with caplog.at_level("WARNING", logger="lora_rl_core.run.resume"):
        restore(second)
    assert "run modes resumes in rollout.mode async after training in sync up to step 1" in caplog.text
    assert "set rollout.mode: sync to keep it" in caplog.text
    second.close()  # a run is open once per process
    caplog.clear()
    third = make_run("modes")
    with caplog.at_level("WARNING", logger="lora_rl_core.run.resume"):
        restore(third)
    assert "resumes in rollout.mode" not in caplog.text


def test_a_rank_that_cannot_write_its_checkpoint_part_fails_the_run_naming_it(make_run, monkeypatch):
    run = make_run("lostpart")

    def refuse(self, *args):
        raise StoreError("disk full")

    monkeypatch.setattr(CheckpointStore, "write_shard", refuse)
    start_checkpoint(run, 1)
    with pytest.raises(
        BackgroundWriteError,
        match=r"trainer rank 0 could not write its part of the checkpoint of step 1 of run lostpart: "
        r"StoreError: disk full",
    ):
        versions.flush(run)
    assert run.checkpoints.latest("lostpart") is None and run.pending_checkpoints == {}


def test_ranks_in_other_processes_need_a_store_they_reach():
    with pytest.raises(ConfigError, match=r"store.uri=memory://x lives in this process's memory.*file:// or s3://"):
        load_config(None, ["store.uri=memory://x", "trainer.backend=local"])
    assert load_config(None, ["store.uri=memory://x"]).trainer.backend.type == "in-process"
