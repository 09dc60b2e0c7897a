"""Training checkpoints in the object store, with the adapter store's manifest rule.

Layout (docs/DESIGN.md): `<store>/<run_id>/checkpoints/step-000010/` holding `tensors.safetensors` (the
tensors of the run's own state: RNG states), `state.json` (everything else: step, rollout mode, with tensors
replaced by `{"__tensor__": key}`), the trainer's state as one `rank-00000.safetensors` + `rank-00000.json`
per trainer rank (`write_shard`: each rank's part of the LoRA weights and AdamW moments and its RNG; the JSON
places each piece, and rank 0's holds the trainer's meta), and `manifest.json`, written LAST with the sha256
and size of each file. A checkpoint exists iff its manifest exists and every file matches it, so a writer
killed mid-upload leaves nothing a reader would load. No pickle: arbitrary nested state is flattened into
safetensors + JSON. All I/O goes through the adapter store's `StoreIO`: transient errors are retried with
backoff, symlinks in local stores are refused, reads are size-capped.
Checkpoints of older runs hold the whole trainer state in `tensors.safetensors` and still load.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import fsspec
import torch
from safetensors.torch import load as load_safetensors

from lora_rl_core.adapters.io import safetensors_bytes
from lora_rl_core.adapters.names import validate_run_id
from lora_rl_core.errors import StoreError
from lora_rl_core.store.io import RetryPolicy, StoreIO

_STEP_DIR = re.compile(r"step-(\d{6})$")
_FILES = ("tensors.safetensors", "state.json")
_SHARD_FILE = re.compile(r"rank-\d{5}\.safetensors$")
SHARDED = "sharded"
"""`state["trainer"]` of a checkpoint whose trainer state is in the ranks' files (`write_shard`)."""


class Piece(NamedTuple):
    """A rank's part of one tensor of the trainer state: `data` (CPU), the whole tensor's `shape` and the
    index of `data`'s first element in it (`offset`, one per dimension; all 0 for a whole tensor)."""

    data: torch.Tensor
    shape: list[int]
    offset: list[int]


@dataclass(frozen=True)
class CheckpointTarget:
    """Where a trainer rank writes its part of the checkpoint of `step`: the store root (`store.uri`), its
    fsspec options and the run."""

    uri: str
    run_id: str
    step: int
    storage_options: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ShardReport:
    """A trainer rank's finished write of its part of the checkpoint of `step`: the manifest entries of its
    files (`{name: {"sha256", "size"}}`), or `error` (what failed) and no files."""

    step: int
    rank: int
    files: dict[str, dict[str, Any]]
    error: str | None = None


MAX_CHECKPOINT_FILE_BYTES = 64 * 2**30  # LoRA weights + AdamW moments stay far below this


def flatten_state(obj: Any, prefix: str = "") -> tuple[dict[str, torch.Tensor], Any]:
    """Split nested dicts/lists/tuples of tensors and JSON scalars into (tensors, JSON tree).

    Each tensor is stored under its dotted path and replaced in the tree by `{"__tensor__": path}`.
    Dict keys become strings (int keys are tagged so they come back as ints).

    Raises:
        TypeError: a leaf is neither a tensor nor a JSON scalar.
    """
    if isinstance(obj, torch.Tensor):
        return {prefix: obj.detach().cpu().contiguous()}, {"__tensor__": prefix}
    if isinstance(obj, dict):
        tensors: dict[str, torch.Tensor] = {}
        tree: dict[str, Any] = {}
        for key, value in obj.items():
            name = f"__int__{key}" if isinstance(key, int) else str(key)
            sub_t, tree[name] = flatten_state(value, f"{prefix}.{name}" if prefix else name)
            tensors.update(sub_t)
        return tensors, tree
    if isinstance(obj, list | tuple):
        tensors, items = {}, []
        for i, value in enumerate(obj):
            sub_t, sub_tree = flatten_state(value, f"{prefix}.{i}")
            tensors.update(sub_t)
            items.append(sub_tree)
        return tensors, {"__tuple__": items} if isinstance(obj, tuple) else items
    if obj is None or isinstance(obj, bool | int | float | str):
        return {}, obj
    raise TypeError(f"cannot checkpoint {prefix or 'value'} of type {type(obj).__name__}")


def unflatten_state(tree: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """Inverse of `flatten_state`."""
    if isinstance(tree, dict):
        if set(tree) == {"__tensor__"}:
            return tensors[tree["__tensor__"]]
        if set(tree) == {"__tuple__"}:
            return tuple(unflatten_state(v, tensors) for v in tree["__tuple__"])
        return {(int(k[7:]) if k.startswith("__int__") else k): unflatten_state(v, tensors) for k, v in tree.items()}
    if isinstance(tree, list):
        return [unflatten_state(v, tensors) for v in tree]
    return tree


class CheckpointStore:
    """Save, list, load and prune training checkpoints of a run under an fsspec URI.

    Args:
        uri: the store root, e.g. `file://./runs` or `s3://bucket/prefix`.
        storage_options: passed to fsspec.
        retry: backoff policy for transient store errors.
    """

    def __init__(
        self, uri: str, storage_options: dict[str, Any] | None = None, retry: RetryPolicy | None = None
    ) -> None:
        fs, root = fsspec.core.url_to_fs(uri, **(storage_options or {}))
        self._io = StoreIO(fs, retry or RetryPolicy())
        self._root = root.rstrip("/")

    def _dir(self, run_id: str, step: int | None = None) -> str:
        base = f"{self._root}/{validate_run_id(run_id)}/checkpoints"
        return base if step is None else f"{base}/step-{step:06d}"

    def save(
        self,
        run_id: str,
        step: int,
        state: dict[str, Any],
        *,
        shards: dict[str, dict[str, Any]] | None = None,
        before_manifest: Callable[[], None] | None = None,
    ) -> str:
        """Write the checkpoint of `step` (files first, manifest last); returns its folder path.

        `shards`: the manifest entries of the files the trainer's ranks wrote (`write_shard`), with
        `state["trainer"]` = `SHARDED`; without them `state` holds the whole trainer state.
        Leftovers of an attempt that died before its manifest are overwritten; an existing complete
        checkpoint of the same step loses its manifest first, so no reader mixes old and new files.
        `before_manifest` is called with the files written and the manifest not yet (fault-injection tests
        crash the writer there).

        Raises:
            TypeError: `state` holds something that is neither a tensor nor a JSON scalar.
            StoreError: the store failed after retries.
        """
        tensors, tree = flatten_state(state)
        blobs = {
            "tensors.safetensors": safetensors_bytes(tensors, metadata=None),
            "state.json": json.dumps(tree).encode(),
        }
        folder = self._dir(run_id, step)
        files = self._put(folder, blobs)
        if before_manifest is not None:
            before_manifest()
        manifest = {
            "run_id": run_id,
            "step": step,
            "created_at": _dt.datetime.now(_dt.UTC).isoformat(),
            "files": {**(shards or {}), **files},
        }
        self._io.put(f"{folder}/manifest.json", json.dumps(manifest, indent=1).encode())
        return folder

    def write_shard(
        self, run_id: str, step: int, rank: int, pieces: dict[str, Piece], meta: dict[str, Any] | None
    ) -> dict[str, dict[str, Any]]:
        """Write trainer rank `rank`'s part of the checkpoint of `step`: `rank-RRRRR.safetensors` (the pieces'
        data) and `rank-RRRRR.json` (each piece's place in its whole tensor, and `meta`, the trainer's JSON
        state, from rank 0). The checkpoint exists once `save` writes its manifest with the entries returned.

        Returns:
            The files' manifest entries, `{name: {"sha256", "size"}}`.

        Raises:
            StoreError: the store failed after retries.
        """
        index = {"pieces": {k: {"shape": p.shape, "offset": p.offset} for k, p in pieces.items()}, "trainer": meta}
        blobs = {
            f"rank-{rank:05d}.safetensors": safetensors_bytes({k: p.data for k, p in pieces.items()}, metadata=None),
            f"rank-{rank:05d}.json": json.dumps(index).encode(),
        }
        return self._put(self._dir(run_id, step), blobs)

    def _put(self, folder: str, blobs: dict[str, bytes]) -> dict[str, dict[str, Any]]:
        """Write files into a checkpoint folder, its manifest removed first (a complete checkpoint of the step,
        written again, is never read with new files under its old manifest); returns their manifest entries."""
        if self._io.size(f"{folder}/manifest.json") is not None:
            self._io.rm(f"{folder}/manifest.json")
        for name, data in blobs.items():
            self._io.put(f"{folder}/{name}", data)
        return {n: {"sha256": hashlib.sha256(d).hexdigest(), "size": len(d)} for n, d in blobs.items()}

    def steps(self, run_id: str) -> list[int]:
        """Steps with a manifest (complete checkpoints), ascending."""
        found = [int(m[1]) for name in self._io.ls_dirs(self._dir(run_id)) if (m := _STEP_DIR.search(name))]
        return sorted(s for s in found if self._io.size(f"{self._dir(run_id, s)}/manifest.json") is not None)

    def latest(self, run_id: str) -> int | None:
        """The newest complete checkpoint step, or None."""
        steps = self.steps(run_id)
        return steps[-1] if steps else None

    def load(self, run_id: str, step: int) -> dict[str, Any]:
        """Read and verify the checkpoint of `step`.

        Raises:
            StoreError: missing manifest, or a file missing or whose sha256/size differs (names the file).
        """
        folder = self._dir(run_id, step)
        raw = self._io.get(f"{folder}/manifest.json", 2**20)
        if raw is None:
            raise StoreError(f"no checkpoint of run {run_id!r} at step {step} (have {self.steps(run_id)})")
        files = json.loads(raw)["files"]
        blobs = {name: self._verified(folder, name, files.get(name)) for name in _FILES}
        state = unflatten_state(json.loads(blobs["state.json"]), load_safetensors(blobs["tensors.safetensors"]))
        if state.get("trainer") == SHARDED:
            ranks = sorted(name.removesuffix(".safetensors") for name in files if _SHARD_FILE.match(name))
            state["trainer"] = self._assemble(folder, files, ranks)
        return state

    def _assemble(self, folder: str, files: dict[str, Any], ranks: list[str]) -> dict[str, Any]:
        """The whole trainer state (`trainer.state.gather_state` format) from the ranks' files: each tensor put
        together from its pieces, which must fit in it, agree on its shape and dtype, and cover it once. This is
        what lets N ranks' checkpoint load on M ranks.

        Raises:
            StoreError: pieces that cannot be put back together (naming the folder, the rank's file, the tensor
                and the fix: delete this checkpoint's manifest to resume from the one before it).
        """
        whole: dict[str, torch.Tensor] = {}
        covered: dict[str, torch.Tensor] = {}  # which elements a piece has set (bool, the tensor's shape)
        meta = None

        def refuse(why: str) -> StoreError:
            return StoreError(
                f"checkpoint {folder} cannot be put back together from its {len(ranks)} ranks' files: {why}; "
                f"delete {folder}/manifest.json to resume from the checkpoint before it"
            )

        for rank in ranks:
            index = json.loads(self._verified(folder, f"{rank}.json", files.get(f"{rank}.json")))
            data = load_safetensors(self._verified(folder, f"{rank}.safetensors", files.get(f"{rank}.safetensors")))
            meta = index["trainer"] if index["trainer"] is not None else meta
            for key, place in index["pieces"].items():
                piece, shape, offset = data.get(key), list(place["shape"]), list(place["offset"])
                if piece is None:
                    raise refuse(f"{rank}.json places {key} but {rank}.safetensors does not hold it")
                if key not in whole:  # the first piece of a tensor makes it (and its coverage mask) once
                    whole[key] = torch.empty(shape, dtype=piece.dtype)
                    covered[key] = torch.zeros(shape, dtype=torch.bool)
                full, mask = whole[key], covered[key]
                if list(full.shape) != shape or full.dtype != piece.dtype:
                    raise refuse(
                        f"{rank} says {key} is {shape} {piece.dtype}, an earlier rank {list(full.shape)} {full.dtype}"
                    )
                if (
                    len(offset) != len(shape)
                    or piece.dim() != len(shape)
                    or any(o < 0 or o + n > s for o, n, s in zip(offset, piece.shape, shape, strict=True))
                ):
                    raise refuse(f"{rank}'s piece of {key} ({list(piece.shape)} at {offset}) lies outside {shape}")
                where = tuple(slice(o, o + n) for o, n in zip(offset, piece.shape, strict=True))
                if mask[where].any():
                    raise refuse(f"{rank}'s piece of {key} ({list(piece.shape)} at {offset}) overlaps an earlier one")
                mask[where] = True
                full[where].copy_(piece)
        if meta is None:
            raise refuse("none holds the trainer meta (rank 0's file)")
        saved = meta.get("world_size")
        if isinstance(saved, int) and saved != len(ranks):
            raise refuse(f"it was written by {saved} ranks, and the manifest lists the files of {ranks}")
        gaps = sorted(k for k, m in covered.items() if not bool(m.all()))
        if gaps:
            raise refuse(f"they do not cover {gaps[:3]}")
        return {"tensors": whole, "meta": meta}

    def _verified(self, folder: str, name: str, entry: dict[str, Any] | None) -> bytes:
        if entry is None:
            raise StoreError(f"checkpoint {folder}: its manifest does not list {name}")
        data = self._io.get(f"{folder}/{name}", MAX_CHECKPOINT_FILE_BYTES)
        if data is None:
            raise StoreError(f"checkpoint file {folder}/{name} is missing although its manifest lists it")
        digest = hashlib.sha256(data).hexdigest()
        if digest != entry["sha256"] or len(data) != entry["size"]:
            raise StoreError(
                f"checkpoint file {folder}/{name} is corrupt: sha256 {digest[:12]}…, "
                f"manifest says {entry['sha256'][:12]}… ({len(data)} vs {entry['size']} bytes)"
            )
        return data

    def prune(self, run_id: str, keep_last: int) -> list[int]:
        """Delete all but the newest `keep_last` checkpoints (manifest first); returns the steps deleted."""
        steps = self.steps(run_id)
        doomed = steps[: max(0, len(steps) - keep_last)]
        for step in doomed:
            self._io.rm(f"{self._dir(run_id, step)}/manifest.json")
            self._io.rm_tree(self._dir(run_id, step))
        return doomed
