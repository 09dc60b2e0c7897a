"""Batch formation: max_loras_per_batch (base counted), max_batch_size, FIFO order, no starvation."""

from __future__ import annotations

import pytest

from lora_rl_core.engines.embedded.scheduler import BatchLimits, form_batch

G, H = "greedy", "hot"  # stand-ins for SamplingParams (any hashable)


def test_empty_queue_gives_empty_batch():
    assert form_batch([], BatchLimits(4, 2)) == []


def test_base_model_counts_as_one_of_max_loras_per_batch():
    queue = [(None, G), ("a", G), ("b", G), ("a", G), (None, G), ("c", G)]
    assert form_batch(queue, BatchLimits(64, 2)) == [0, 1, 3, 4]  # {base, a}; b and c wait
    assert form_batch(queue, BatchLimits(64, 3)) == [0, 1, 2, 3, 4]  # {base, a, b}
    assert form_batch(queue, BatchLimits(64, 4)) == [0, 1, 2, 3, 4, 5]


def test_max_batch_size_takes_the_oldest_first():
    queue = [("a", G)] * 10
    assert form_batch(queue, BatchLimits(4, 8)) == [0, 1, 2, 3]


def test_the_oldest_request_fixes_the_sampling_params_of_the_batch():
    queue = [("a", H), ("a", G), ("b", H), (None, G)]
    assert form_batch(queue, BatchLimits(8, 8)) == [0, 2]


def test_pinned_adapters_do_not_count_against_max_unpinned():
    queue = [("a", G), ("b", G), ("p", G), (None, G)]
    limits = BatchLimits(8, 8, max_unpinned=1, pinned=frozenset({"p"}))
    assert form_batch(queue, limits) == [0, 2, 3]


def test_limits_below_one_are_rejected():
    with pytest.raises(ValueError):
        BatchLimits(0, 8)
    with pytest.raises(ValueError):
        BatchLimits(8, 8, max_unpinned=0)


def _drain(queue: list[tuple[str, str]], limits: BatchLimits, arrivals: list[tuple[str, str]]) -> list[list[str]]:
    """Run batches until the queue is empty; after each batch `arrivals` join the queue (once per round,
    for the first 20 rounds). Returns the request labels of each batch."""
    batches = []
    for round_ in range(200):
        if not queue:
            return batches
        picked = form_batch([(a, s) for a, s, _ in queue], limits)
        batches.append([queue[i][2] for i in picked])
        queue = [q for i, q in enumerate(queue) if i not in set(picked)]
        if round_ < 20:
            queue += [(a, s, f"{a}-{round_}") for a, s in arrivals]
    raise AssertionError("queue never drained")


def test_fifo_order_and_no_starvation_under_a_stream_of_other_adapters():
    # one batch slot per adapter: "cold" arrives behind "hot" requests while more "hot" keep arriving
    queue = [("hot", G, "hot-a"), ("hot", G, "hot-b"), ("cold", G, "cold"), ("hot", G, "hot-c")]
    batches = _drain(queue, BatchLimits(2, 1), arrivals=[("hot", G)] * 2)
    assert batches[0] == ["hot-a", "hot-b"]
    assert batches[1] == ["cold"]  # the oldest request always runs next: no starvation
    served = [label for batch in batches for label in batch]
    hot = [label for label in served if label.startswith("hot")]
    assert hot[:3] == ["hot-a", "hot-b", "hot-c"]  # same-adapter requests keep their order


def test_mixed_params_and_adapters_all_get_served_in_bounded_rounds():
    queue = [(a, s, f"{a}{s}{i}") for i, (a, s) in enumerate([("a", G), ("b", H), ("c", G), ("d", H), (None, G)] * 3)]
    batches = _drain(queue, BatchLimits(3, 2), arrivals=[])
    served = [label for batch in batches for label in batch]
    assert sorted(served) == sorted(label for *_, label in queue)
    assert len(batches) <= len(queue)
