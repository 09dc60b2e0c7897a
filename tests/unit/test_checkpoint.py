"""Checkpoints: pickle-free flattening, manifest-last visibility, verification, pruning, and trainer states
written in parts by the ranks (`write_shard`) put back together on load."""

from __future__ import annotations

import threading

import pytest
import torch

from lora_rl_core.checkpoint import SHARDED, CheckpointStore, CheckpointTarget, Piece, flatten_state, unflatten_state
from lora_rl_core.errors import StoreError
from lora_rl_core.trainer.shards import ShardWriter

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


def _two_ranks(store: CheckpointStore, step: int) -> dict[str, dict]:
    """A [5, 3] weight split 3 + 2 rows over two ranks (FSDP2's Shard(0)), a scalar only rank 0 writes, each
    rank's RNG; rank 0 holds the meta. Returns the manifest entries of the four files."""
    w = torch.arange(15.0).view(5, 3)
    rank0 = {
        "params/w": Piece(w[:3].clone(), [5, 3], [0, 0]),
        "optimizer/w/step": Piece(torch.tensor(4.0), [], []),
        "rng/rank0/cpu": Piece(torch.tensor([1, 2], dtype=torch.uint8), [2], [0]),
    }
    rank1 = {
        "params/w": Piece(w[3:].clone(), [5, 3], [3, 0]),
        "rng/rank1/cpu": Piece(torch.tensor([3], dtype=torch.uint8), [1], [0]),
    }
    files = store.write_shard("run", step, 0, rank0, {"format": "x", "world_size": 2})
    files.update(store.write_shard("run", step, 1, rank1, None))
    return files


def test_a_trainer_state_written_by_two_ranks_loads_whole(tmp_path):
    store = CheckpointStore(f"file://{tmp_path}")
    files = _two_ranks(store, 1)
    assert store.steps("run") == []  # the ranks' files alone are no checkpoint
    store.save("run", 1, {"step": 1, "trainer": SHARDED}, shards=files)
    trainer = store.load("run", 1)["trainer"]
    assert trainer["meta"] == {"format": "x", "world_size": 2}
    assert torch.equal(trainer["tensors"]["params/w"], torch.arange(15.0).view(5, 3))
    assert trainer["tensors"]["optimizer/w/step"].item() == 4.0
    assert trainer["tensors"]["rng/rank1/cpu"].tolist() == [3]


def test_a_rank_file_corrupt_unlisted_or_short_is_named(tmp_path):
    store = CheckpointStore(f"file://{tmp_path}")
    files = _two_ranks(store, 1)
    store.save("run", 1, {"trainer": SHARDED}, shards=files)
    shard = tmp_path / "run" / "checkpoints" / "step-000001" / "rank-00001.safetensors"
    shard.write_bytes(shard.read_bytes()[:-4] + b"\0\0\0\0")
    with pytest.raises(StoreError, match="rank-00001.safetensors is corrupt"):
        store.load("run", 1)
    files = _two_ranks(store, 2)
    del files["rank-00001.json"]
    store.save("run", 2, {"trainer": SHARDED}, shards=files)
    with pytest.raises(StoreError, match="manifest does not list rank-00001.json"):
        store.load("run", 2)
    files = _two_ranks(store, 3)
    store.save("run", 3, {"trainer": SHARDED}, shards={k: v for k, v in files.items() if "00001" not in k})
    with pytest.raises(
        StoreError,
        match=r"from its 1 ranks' files: it was written by 2 ranks, and the manifest lists the files of "
        r"\['rank-00000'\]; delete .*step-000003/manifest.json to resume from the checkpoint before it",
    ):
        store.load("run", 3)


@pytest.mark.parametrize(
    ("rank1", "meta", "why"),
    [
        (
            {"params/w": Piece(torch.zeros(3, 3), [5, 3], [2, 0])},
            2,
            r"rank-00001's piece of params/w \(\[3, 3\] at \[2, 0\]\) overlaps an earlier one",
        ),
        # rows 2-3: row 2 twice and row 4 never, 15 elements in all: counting them would take it as whole
        ({"params/w": Piece(torch.zeros(2, 3), [5, 3], [2, 0])}, 2, "overlaps an earlier one"),
        ({"params/w": Piece(torch.zeros(1, 3), [5, 3], [3, 0])}, 2, r"they do not cover \['params/w'\]"),
        (
            {"params/w": Piece(torch.zeros(2, 3), [5, 3], [4, 0])},
            2,
            r"rank-00001's piece of params/w \(\[2, 3\] at "
            r"\[4, 0\]\) lies outside \[5, 3\]",
        ),
        (
            {"params/w": Piece(torch.zeros(2, 3), [6, 3], [3, 0])},
            2,
            r"rank-00001 says params/w is \[6, 3\] "
            r"torch.float32, an earlier rank \[5, 3\]",
        ),
        ({"params/w": Piece(torch.zeros(2, 3, dtype=torch.float16), [5, 3], [3, 0])}, 2, "torch.float16, an earlier"),
        ({"params/w": Piece(torch.zeros(2, 3), [5, 3], [3, 0])}, 4, "it was written by 4 ranks"),
    ],
)
def test_rank_files_that_cannot_be_put_back_together_are_refused_in_one_line(tmp_path, rank1, meta, why):
    """Bad input: a checkpoint whose ranks' pieces overlap, stick out of their tensor, disagree on its shape or
    dtype, or whose meta names another number of ranks than wrote files, is refused naming the folder, the rank
    and the tensor, with the fix; the store is left as it was."""
    store = CheckpointStore(f"file://{tmp_path}")
    w = torch.arange(15.0).view(5, 3)
    files = store.write_shard("run", 1, 0, {"params/w": Piece(w[:3].clone(), [5, 3], [0, 0])}, {"world_size": meta})
    files.update(store.write_shard("run", 1, 1, rank1, None))
    store.save("run", 1, {"trainer": SHARDED}, shards=files)
    with pytest.raises(StoreError, match=why) as err:
        store.load("run", 1)
    assert "\n" not in str(err.value) and "step-000001/manifest.json to resume" in str(err.value)
    assert store.steps("run") == [1]  # nothing deleted or rewritten


def test_a_rank_keeps_at_most_two_snapshots_while_the_store_is_slow(tmp_path, monkeypatch):
    """`ShardWriter`: with two writes running, a third snapshot waits for the oldest (back-pressure); each write
    is reported once, in order."""
    gate = threading.Event()

    def slow(self, run_id, step, rank, pieces, meta):
        gate.wait(10)
        return {f"rank-{rank:05d}.json": {"sha256": "x", "size": step}}

    monkeypatch.setattr(CheckpointStore, "write_shard", slow)
    writer = ShardWriter(0)
    try:
        for step in (1, 2):
            writer.submit(CheckpointTarget(f"file://{tmp_path}", "bp", step), {}, None)
        third = threading.Thread(target=writer.submit, args=(CheckpointTarget(f"file://{tmp_path}", "bp", 3), {}, None))
        third.start()
        third.join(0.3)
        assert third.is_alive() and writer.finished() == []  # waiting for the oldest write
        gate.set()
        third.join(10)
        assert not third.is_alive()
        assert [(r.step, r.error) for r in writer.finished(wait=True)] == [(1, None), (2, None), (3, None)]
        assert writer.finished(wait=True) == []
    finally:
        gate.set()
        writer.close()
