"""A run that fails at step k and is resumed equals an uninterrupted run, without recomputing earlier steps.

Versions and checkpoints are written in the background (`trainer.background_publish`, the default), so a run
can also fail, or be killed, while one of them is in flight: the version's upload (its files written, its
manifest not) or a checkpoint. The resumed run never sees the half-written object, restores the newest
complete checkpoint, publishes a version the checkpoint holds but the store lost from the restored trainer,
trains only the steps after the checkpoint, and ends with the same versions as an uninterrupted run.
"""

from __future__ import annotations

import functools
import os
import signal
import sys
from pathlib import Path

import pytest
import torch

from lora_rl_core.checkpoint import CheckpointStore
from lora_rl_core.errors import BackgroundWriteError
from lora_rl_core.faults import InjectedFault
from lora_rl_core.run import phases
from lora_rl_core.store import AdapterStore
from lora_rl_core.trainer import PolicyTrainer
from tests.integration.tiny_run import write_tiny_config
from tests.support import processes

pytestmark = pytest.mark.slow  # the flow under the Prefect test server

REPO = Path(__file__).resolve().parents[2]


def _write_config(tmp_path, tiny_model_dir, run_id: str, **trainer):
    return str(
        write_tiny_config(
            tmp_path,
            tiny_model_dir,
            run_id,
            run={"id": run_id, "eval_before_after": False},
            rollout={"max_new_tokens": 6},
            trainer={"steps": 4, **trainer},
            data={"train_size": 32},
        )
    )


@pytest.fixture(scope="module")
def straight(tmp_path_factory, tiny_model_dir) -> dict[int, dict[str, torch.Tensor]]:
    """The versions of an uninterrupted run: version -> tensors."""
    from flows.grpo_lora import train

    tmp_path = tmp_path_factory.mktemp("straight")
    train(config_path=_write_config(tmp_path, tiny_model_dir, "straight"))
    store = AdapterStore(f"file://{tmp_path / 'store'}")
    assert store.versions("straight") == [0, 1, 2, 3, 4]
    return {v: store.load_tensors("straight", v)[0] for v in store.versions("straight")}


@pytest.fixture
def executed(monkeypatch) -> list[tuple[str, int]]:
    """Every rollout sampled and every update the trainer computed, as (phase, step), in order."""
    calls: list[tuple[str, int]] = []
    training: list[int] = []
    rollout, train, update = phases.rollout, phases.train, PolicyTrainer.train_step

    @functools.wraps(rollout)  # the flow's task of the same name runs it
    def traced_rollout(run, step):
        calls.append(("rollout", step))
        return rollout(run, step)

    @functools.wraps(train)
    def traced_train(run, step):
        training.append(step)
        return train(run, step)

    def traced_update(self, batch):
        calls.append(("train", training[-1]))
        return update(self, batch)

    monkeypatch.setattr(phases, "rollout", traced_rollout)
    monkeypatch.setattr(phases, "train", traced_train)
    monkeypatch.setattr(PolicyTrainer, "train_step", traced_update)
    return calls


def _assert_same_versions(store: AdapterStore, run_id: str, straight: dict[int, dict[str, torch.Tensor]]) -> None:
    assert store.versions(run_id) == sorted(straight)
    for version, expected in straight.items():
        tensors, _ = store.load_tensors(run_id, version)
        assert tensors.keys() == expected.keys()
        for key in expected:
            torch.testing.assert_close(tensors[key], expected[key], atol=1e-5, rtol=1e-4)
    assert any(not torch.equal(straight[4][k], straight[1][k]) for k in straight[4])  # it learned something


def test_killed_and_resumed_run_equals_uninterrupted_run(tmp_path, tiny_model_dir, straight, executed, monkeypatch):
    from flows.grpo_lora import train

    monkeypatch.setenv("LORA_RL_FAULT", "train:3")
    resumed_cfg = _write_config(tmp_path, tiny_model_dir, "resumed")
    with pytest.raises(InjectedFault):
        train(config_path=resumed_cfg)
    assert ("train", 2) in executed and ("train", 3) not in executed
    executed.clear()
    train(config_path=resumed_cfg)  # a new flow run with the same run id resumes it
    # steps 1-2 come from the step-2 checkpoint (their stats replayed); step 3's rollout was cached before the fault
    assert executed == [("train", 3), ("rollout", 4), ("train", 4)]
    _assert_same_versions(AdapterStore(f"file://{tmp_path / 'store'}"), "resumed", straight)


def test_a_run_checkpointed_every_other_step_resumes_from_its_last_checkpoint(
    tmp_path, tiny_model_dir, straight, executed, monkeypatch
):
    """Step 4 fails with checkpoints at steps 2 (and 4): the resumed run replays steps 1-2 from the checkpoint,
    trains step 3 again, keeps the stored version 3, and trains step 4."""
    from flows.grpo_lora import train

    config = _write_config(tmp_path, tiny_model_dir, "every2", checkpoint_every=2)
    monkeypatch.setenv("LORA_RL_FAULT", "train:4")
    with pytest.raises(InjectedFault):
        train(config_path=config)
    store = AdapterStore(f"file://{tmp_path / 'store'}")
    assert store.versions("every2") == [0, 1, 2, 3] and CheckpointStore(store.uri).latest("every2") == 2
    stored_v3 = store.manifest("every2", 3).data_dir
    executed.clear()
    train(config_path=config)
    assert executed == [("train", 3), ("train", 4)]  # the rollouts of steps 3 and 4 were cached
    assert store.manifest("every2", 3).data_dir == stored_v3  # the stored version, not written again
    _assert_same_versions(store, "every2", straight)


@pytest.mark.parametrize(
    ("fault", "message", "stored"),
    [
        # v2's files are written, its manifest is not; step 2's checkpoint (its manifest written after v2, when
        # its ranks are done) is never completed: the writer stops at the failure
        ("publish:2", r"adapter version inflight-v000002 .*InjectedFault", [0, 1]),
        # step 2's checkpoint files are written, its manifest is not: v2 (published before it) is kept
        ("checkpoint:2", r"the checkpoint of step 2 of run inflight .*InjectedFault", [0, 1, 2]),
    ],
)
def test_a_background_write_that_fails_in_flight_fails_the_run_and_resume_redoes_it(
    tmp_path, tiny_model_dir, straight, executed, monkeypatch, fault, message, stored
):
    from flows.grpo_lora import train

    config = _write_config(tmp_path, tiny_model_dir, "inflight")
    monkeypatch.setenv("LORA_RL_FAULT", fault)
    with pytest.raises(BackgroundWriteError, match=message):
        train(config_path=config)
    store = AdapterStore(f"file://{tmp_path / 'store'}")
    checkpoint = 1
    assert store.versions("inflight") == stored  # nothing of the failed write is visible, earlier ones intact
    assert CheckpointStore(store.uri).latest("inflight") == checkpoint
    executed.clear()
    train(config_path=config)
    # only the steps after the restored checkpoint train again (step 3's rollout may have run before the failure)
    assert [s for phase, s in executed if phase == "train"] == list(range(checkpoint + 1, 5))
    _assert_same_versions(store, "inflight", straight)


KILLED = """
import sys
from flows.grpo_lora import train
train(config_path=sys.argv[1])
"""


def test_a_run_killed_while_a_version_uploads_resumes_from_its_checkpoint(tmp_path, tiny_model_dir, straight, executed):
    """kill -9 of the flow's process while the background upload of v2 has written its files, not its
    manifest: v2 is invisible, and so is step 2's checkpoint (its manifest follows v2, once its ranks are done);
    the resumed run restores step 1's checkpoint and trains steps 2-4 again."""
    from prefect.settings import PREFECT_API_URL

    from flows.grpo_lora import train

    config = _write_config(tmp_path, tiny_model_dir, "killed")
    env = {
        **os.environ,
        "LORA_RL_FAULT": "publish:2:kill",
        "PREFECT_API_URL": str(PREFECT_API_URL.value()),  # the test server: the flow's results persist there
        "PREFECT_HOME": str(tmp_path / "prefect-home"),
        "PYTHONPATH": os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]),
    }
    done = processes.run([sys.executable, "-c", KILLED, config], env=env, cwd=REPO, timeout=600, capture_output=True)
    assert done.returncode == -signal.SIGKILL, done.stderr.decode(errors="replace")[-3000:]
    store = AdapterStore(f"file://{tmp_path / 'store'}")
    assert store.versions("killed") == [0, 1] and CheckpointStore(store.uri).latest("killed") == 1
    half = list((tmp_path / "store" / "killed" / "adapters" / "v000002").glob("*/adapter_model.safetensors"))
    assert half and not (tmp_path / "store" / "killed" / "adapters" / "v000002" / "manifest.json").exists()

    train(config_path=config)
    assert [s for phase, s in executed if phase == "train"] == [2, 3, 4]
    _assert_same_versions(store, "killed", straight)
