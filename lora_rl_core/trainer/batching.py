"""Training batches as tensors: packing rows into a right-padded micro-batch (`pack`, `PackedBatch`) and
dealing a minibatch's rows to the ranks of a sharded trainer (`rank_micro_batches`)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from lora_rl_core.records import TrainBatch


@dataclass
class PackedBatch:
    """A micro-batch as right-padded tensors. `[b, F]` tensors are in the shifted (next-token) frame, cut to
    the positions that can predict a completion token: frame column `j` is input position `frame_start + j`,
    predicting the token at `frame_start + j + 1`, with `F = L - 1 - frame_start`.

    `frame_start` is the shortest prompt's length minus one: the prompt positions before it never predict a
    completion token, so the model computes no logits there (`logits_to_keep`). On the default arithmetic
    job half of each row is prompt, and the 49k-wide logits and their log-softmax were about 40 % of a
    micro-batch's forward time on a 2-core CPU.
    """

    input_ids: torch.Tensor  # [b, L] long
    attention_mask: torch.Tensor  # [b, L] long
    frame_start: int  # first input position of the frame
    targets_BT: torch.Tensor  # [b, F] long: input_ids[:, frame_start + 1:]
    mask_BT: torch.Tensor  # [b, F] float: 1 on completion tokens
    advantages_B: torch.Tensor  # [b] float
    inference_logprobs_BT: torch.Tensor  # [b, F] float, 0 off the completion


def pack(batch: TrainBatch, pad_id: int, device: torch.device) -> PackedBatch:
    """Right-pad prompt+completion rows into tensors, with the completion mask in the shifted frame
    (`PackedBatch`: the frame starts at the shortest prompt's last token)."""
    rows = [p + c for p, c in zip(batch.prompt_ids, batch.completion_ids, strict=True)]
    b, width = len(rows), max(len(r) for r in rows)
    start = max(0, min(len(p) for p in batch.prompt_ids) - 1)
    ids = torch.full((b, width), pad_id, dtype=torch.long)
    attn = torch.zeros((b, width), dtype=torch.long)
    mask = torch.zeros((b, width - 1 - start))
    inf_lp = torch.zeros((b, width - 1 - start))
    for i, (p, c) in enumerate(zip(batch.prompt_ids, batch.completion_ids, strict=True)):
        ids[i, : len(p) + len(c)] = torch.tensor(p + c)
        attn[i, : len(p) + len(c)] = 1
        # token c[j] sits at input position len(p)+j and is predicted from position len(p)+j-1
        first = len(p) - 1 - start
        mask[i, first : first + len(c)] = 1.0
        inf_lp[i, first : first + len(c)] = torch.tensor(batch.inference_logprobs[i][: len(c)])
    return PackedBatch(
        input_ids=ids.to(device),
        attention_mask=attn.to(device),
        frame_start=start,
        targets_BT=ids[:, start + 1 :].to(device),
        mask_BT=mask.to(device),
        advantages_B=torch.tensor(batch.advantages, dtype=torch.float32, device=device),
        inference_logprobs_BT=inf_lp.to(device),
    )


def rank_micro_batches(
    lengths: list[int], rows: list[int], *, size: int, rank: int = 0, world_size: int = 1
) -> list[list[int]]:
    """This rank's micro-batches (row indices) of one minibatch.

    Rows, sorted by `lengths` (stable), are dealt round-robin to the ranks, so ranks get nearly equal
    row counts and similar length mixes; each rank cuts its rows, in length order, into micro-batches of
    `size` (little padding). Every rank gets the same number of micro-batches: the missing ones are empty
    lists (the trainer runs them as zero-weight dummy passes).

    Args:
        lengths: length of every row of the batch (prompt + completion tokens).
        rows: the minibatch's row indices.
        size: micro-batch size (rows); rank / world_size: this rank and the number of ranks.
    """
    order = sorted(rows, key=lambda i: lengths[i])
    mine = order[rank::world_size]
    micros = [mine[i : i + size] for i in range(0, len(mine), size)]
    most = max(-(-len(order[r::world_size]) // size) for r in range(world_size))
    return micros + [[] for _ in range(most - len(micros))]


def padding_fraction(lengths: list[int], micro_batches: list[list[int]]) -> float:
    """The share of the positions a forward computes that are padding, over `micro_batches` (row indices;
    empty ones skipped): each is right-padded to its longest row (`pack`). 0.0 when there are no rows.

    Rows are sorted by length before they are cut (`rank_micro_batches`), so this is the padding left inside
    each micro-batch: what padding-free packing (varlen attention) would still remove.

    Args:
        lengths: length of every row of the batch (prompt + completion tokens).
    """
    computed = sum(len(m) * max(lengths[i] for i in m) for m in micro_batches if m)
    real = sum(lengths[i] for m in micro_batches for i in m)
    return 1.0 - real / computed if computed else 0.0


def dummy_batch(pad_id: int) -> TrainBatch:
    """One 2-token row with zero advantage: a forward/backward that contributes nothing."""
    return TrainBatch([[pad_id]], [[pad_id]], [0.0], [[0.0]])


def frame(rows: list[torch.Tensor], mask_BT: torch.Tensor) -> torch.Tensor:
    """Scatter per-row completion logprobs back into the `[b, F]` shifted frame."""
    out = torch.zeros_like(mask_BT)
    for i, lp in enumerate(rows):
        out[i, mask_BT[i].bool()] = lp.to(out.device)
    return out


def split_even(n: int, parts: int) -> Iterator[list[int]]:
    """Split range(n) into `parts` contiguous, nearly equal, non-empty chunks."""
    parts = min(parts, n)
    bounds = [round(i * n / parts) for i in range(parts + 1)]
    for lo, hi in zip(bounds, bounds[1:], strict=False):
        yield list(range(lo, hi))
