"""A trainer rank's checkpoint writes: its part of the state (`trainer.state.local_state`) goes to the store on
one background thread of the rank's own, so nothing passes through rank 0 or the run's process, and the next
step trains while it uploads (docs/DESIGN.md, "Checkpoints written by the ranks"). The run learns what was
written from `finished` (`Trainer.written_checkpoints`) and writes the manifest last
(`lora_rl_core.run.checkpoints`)."""

from __future__ import annotations

import concurrent.futures
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from lora_rl_core.checkpoint import CheckpointStore, CheckpointTarget, Piece, ShardReport

MAX_PENDING = 2
"""Snapshots a rank keeps in memory while the store is slower than the steps: a third waits for the oldest."""


class ShardWriter:
    """Writes one rank's parts of checkpoints (`CheckpointStore.write_shard`) in order, on one thread.

    Args:
        rank: the trainer rank (0 in this process).
    """

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self._pool = ThreadPoolExecutor(1, thread_name_prefix=f"checkpoint-rank{rank}")
        self._pending: list[tuple[int, Future[dict[str, dict[str, Any]]]]] = []

    def submit(self, target: CheckpointTarget, pieces: dict[str, Piece], meta: dict[str, Any] | None) -> None:
        """Queue the write of this rank's `pieces` (CPU copies) and `meta` for the checkpoint `target.step`."""
        running = [f for _, f in self._pending if not f.done()]
        if len(running) >= MAX_PENDING:  # back-pressure: the oldest write ends before another snapshot is kept
            concurrent.futures.wait(running[: len(running) - MAX_PENDING + 1])
        store = CheckpointStore(target.uri, target.storage_options)  # fsspec reuses its filesystem instances
        write = self._pool.submit(store.write_shard, target.run_id, target.step, self.rank, pieces, meta)
        self._pending.append((target.step, write))

    def finished(self, wait: bool = False) -> list[ShardReport]:
        """The writes that ended since the last call, in order (with `wait`: every queued write, waited for)."""
        if wait:
            concurrent.futures.wait([f for _, f in self._pending])
        done = [(step, f) for step, f in self._pending if f.done()]
        self._pending = [(step, f) for step, f in self._pending if not f.done()]
        return [_report(step, self.rank, f) for step, f in done]

    def close(self) -> None:
        """Finish the write under way, drop the queued ones and stop the thread."""
        self._pool.shutdown(wait=True, cancel_futures=True)


def _report(step: int, rank: int, write: Future[dict[str, dict[str, Any]]]) -> ShardReport:
    error = write.exception() if not write.cancelled() else None
    if write.cancelled() or error is not None:
        return ShardReport(step, rank, {}, error="cancelled" if error is None else f"{type(error).__name__}: {error}")
    return ShardReport(step, rank, write.result())
