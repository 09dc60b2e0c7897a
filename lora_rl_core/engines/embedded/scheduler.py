"""Batch formation for the embedded engine: which queued requests share the next forward batch.

Pure functions over `(adapter, sampling)` pairs, so the policy is testable without a model.
Mirrors SGLang's admission check for LoRA batches (`sglang/srt/managers/scheduler.py`,
`get_new_batch_prefill`, with `sglang/srt/lora/lora_manager.py` `validate_lora_batch`): a batch holds
at most `max_loras_per_batch` distinct adapters, the base model counting as one (sglang#23141).

Choices made here:

* FIFO with skipping: the oldest queued request always joins the next batch and fixes its sampling
  params (one `GenerationConfig` per forward batch); later requests join in queue order while they fit;
  those that don't stay queued, in order. So no request waits behind more than the requests queued
  before it: no starvation.
* `max_unpinned` caps the distinct non-pinned adapters in one batch, so that every adapter of a batch
  can be resident at once under `max_loaded_loras` (pinned adapters are always resident).

Left out: continuous batching (a batch runs to its end before the next forms) and prefix-aware order.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class BatchLimits:
    """Limits on one forward batch.

    Attributes:
        max_batch_size: sequences per batch (>= 1).
        max_loras_per_batch: distinct adapters per batch, base model (`None`) counted (>= 1).
        max_unpinned: distinct non-pinned adapters per batch (None = no limit).
        pinned: names of pinned adapters (not counted against `max_unpinned`).
    """

    max_batch_size: int
    max_loras_per_batch: int
    max_unpinned: int | None = None
    pinned: frozenset[str] = field(default_factory=frozenset)

    def __post_init__(self) -> None:
        if self.max_batch_size < 1 or self.max_loras_per_batch < 1:
            raise ValueError(f"batch limits must be >= 1, got {self}")
        if self.max_unpinned is not None and self.max_unpinned < 1:
            raise ValueError(f"max_unpinned must be >= 1 (pinned adapters fill the pool), got {self.max_unpinned}")


def form_batch(queue: Sequence[tuple[str | None, Hashable]], limits: BatchLimits) -> list[int]:
    """Choose the next forward batch from the queue.

    Args:
        queue: `(adapter, sampling)` per queued request, oldest first; adapter None = base model.
        limits: the batch limits.

    Returns:
        Indices into `queue` (ascending) of the requests to run now; empty only when the queue is.
    """
    if not queue:
        return []
    key = queue[0][1]
    chosen: list[int] = []
    adapters: set[str | None] = set()
    for i, (adapter, sampling) in enumerate(queue):
        if len(chosen) == limits.max_batch_size:
            break
        if sampling != key or not (adapter in adapters or _fits(adapters, adapter, limits)):
            continue
        adapters.add(adapter)
        chosen.append(i)
    return chosen


def _fits(adapters: set[str | None], adapter: str | None, limits: BatchLimits) -> bool:
    """Whether one more distinct `adapter` fits a batch that already holds `adapters`."""
    if len(adapters) >= limits.max_loras_per_batch:
        return False
    if adapter is None or adapter in limits.pinned or limits.max_unpinned is None:
        return True
    unpinned = sum(1 for a in adapters if a is not None and a not in limits.pinned)
    return unpinned < limits.max_unpinned
