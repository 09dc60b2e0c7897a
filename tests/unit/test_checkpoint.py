"""Checkpoints: pickle-free flattening, manifest-last visibility, verification, pruning."""

from __future__ import annotations

import pytest
import torch

from lora_rl_core.checkpoint import CheckpointStore, flatten_state, unflatten_state
from lora_rl_core.errors import StoreError

STATE = {
    "trainer": {"params": {"w": torch.arange(6.0).view(2, 3)}, "optimizer": {0: {"step": torch.tensor(3.0)}}},
    "groups": [{"lr": 3e-4, "betas": (0.9, 0.999)}],
    "cursor": {"epoch": 1, "index": 7, "seed": 0},
    "note": None,
}


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(map(_equal, a, b))
    return a == b


def test_flatten_round_trip_keeps_int_keys_tuples_and_tensors():
    tensors, tree = flatten_state(STATE)
    assert set(tensors) == {"trainer.params.w", "trainer.optimizer.__int__0.step"}
    assert _equal(unflatten_state(tree, tensors), STATE)
    with pytest.raises(TypeError, match="cannot checkpoint x"):
        flatten_state({"x": object()})


def test_save_load_latest_and_prune(tmp_path):
    store = CheckpointStore(f"file://{tmp_path}")
    for step in (1, 2, 3):
        store.save("run", step, {**STATE, "cursor": {"epoch": 0, "index": step, "seed": 0}})
    (tmp_path / "run" / "checkpoints" / "step-000004").mkdir()  # an attempt that died before its manifest
    assert store.steps("run") == [1, 2, 3] and store.latest("run") == 3
    assert store.load("run", 2)["cursor"]["index"] == 2
    assert store.prune("run", keep_last=2) == [1]
    assert store.steps("run") == [2, 3] and not (tmp_path / "run" / "checkpoints" / "step-000001").exists()
    assert CheckpointStore(f"file://{tmp_path}").latest("other") is None


def test_corrupt_or_missing_checkpoint_is_a_clear_error(tmp_path):
    store = CheckpointStore(f"file://{tmp_path}")
    store.save("run", 5, STATE)
    path = tmp_path / "run" / "checkpoints" / "step-000005" / "tensors.safetensors"
    path.write_bytes(path.read_bytes()[:-4])
    with pytest.raises(StoreError, match=r"step-000005/tensors.safetensors is corrupt"):
        store.load("run", 5)
    with pytest.raises(StoreError, match=r"no checkpoint of run 'run' at step 6 \(have \[5\]\)"):
        store.load("run", 6)
