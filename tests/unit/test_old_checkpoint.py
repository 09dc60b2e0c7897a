"""A run checkpointed by an older version (`tests/fixtures/old-checkpoint`: commit aafde06's store of a 2-step
tiny run) resumes with today's code: the trainer takes the step-2 checkpoint's weights as they were saved, the
stored versions are kept as they are, and the run goes on to step 3 (issue 44: the plan's records changed, the
checkpoint format did not)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from lora_rl_core.checkpoint import CheckpointStore
from lora_rl_core.config import load_config
from lora_rl_core.run import open_run
from lora_rl_core.run.loop import RunPhases, run_steps
from lora_rl_core.run.resume import restore
from tests.integration.tiny_run import write_tiny_config

FIXTURE = Path(__file__).parents[1] / "fixtures" / "old-checkpoint" / "store"


def _manifest_sha(store: Path, version: int) -> str:
    manifest = json.loads((store / "old-ckpt" / "adapters" / f"v{version:06d}" / "manifest.json").read_text())
    return json.dumps(manifest["files"], sort_keys=True)


def test_a_run_checkpointed_before_the_plan_records_changed_resumes(tmp_path, tiny_model_dir):
    store = tmp_path / "store"
    shutil.copytree(FIXTURE, store)
    old_versions = {v: _manifest_sha(store, v) for v in (0, 1, 2)}
    saved = CheckpointStore(f"file://{store}").load("old-ckpt", 2)["trainer"]
    cfg = load_config(write_tiny_config(tmp_path, tiny_model_dir, "old", trainer={"steps": 3}), [])
    run = open_run(cfg, "old-ckpt")
    try:
        info = restore(run)
        assert (info.restored_step, info.policy_version) == (2, 2)
        restored = run.trainer.state_dict()["tensors"]
        assert saved["tensors"].keys() == restored.keys() and any("lora_" in k for k in restored)
        weights = [k for k in restored if not k.startswith("rng/")]  # the RNG state moves with the run's draws
        assert all(torch.equal(restored[k], saved["tensors"][k]) for k in weights)  # LoRA weights, AdamW moments
        with RunPhases(run) as phases:
            done = run_steps(phases, steps=3)
        assert [m["step"] for m in done.history] == [1, 2, 3] and done.final.version == 3
        assert run.store.versions("old-ckpt") == [0, 1, 2, 3]
        assert {v: _manifest_sha(store, v) for v in (0, 1, 2)} == old_versions  # kept as stored
        assert run.checkpoints.latest("old-ckpt") == 3
        assert done.history[-1]["train_sequences"] > 0 and done.history[0]["train_sequences"] > 0  # replayed
    finally:
        run.close()
