"""Truncated completions: what a completion cut at the token limit does to the reward and the update.

`algorithm.truncation` (docs/DESIGN.md, "Truncated completions") picks one of:

* `keep`: nothing; a cut completion is trained on as sampled.
* `mask`: a cut completion (`finish_reason == "length"`) adds no loss (`TrainBatch.from_scored`); TRL's
  `mask_truncated_completions` and DAPO's overlong filtering (Yu et al. 2025, sec. 3.4). Its reward still
  counts in its group's advantages, which are computed first (as TRL does).
* `overlong-penalty`: DAPO's soft overlong punishment (`overlong_penalty`), added to the reward before the
  advantages.
"""

from __future__ import annotations

import torch
from torch import Tensor


def overlong_penalty(lengths_B: Tensor, *, max_new_tokens: int, buffer: int, penalty: float) -> Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13; verl `reward_manager/dapo.py`,
    `overlong_buffer`): 0 for a completion of at most `max_new_tokens - buffer` tokens, then linear down to
    `-penalty` at `max_new_tokens`: `min(0, -penalty * (n - (max_new_tokens - buffer)) / buffer)`.

    Args:
        lengths_B: `[B]` completion lengths, tokens (any integer or float dtype).
        max_new_tokens: the rollout's token limit `L_max`.
        buffer: `L_cache`, tokens before the limit over which the penalty grows; `1 <= buffer <= max_new_tokens`.
        penalty: the penalty at the limit (verl's `penalty_factor`), > 0.

    Returns:
        `[B]` float32 penalties, each in `[-penalty, 0]` (lengths past the limit are clamped to it).

    Raises:
        ValueError: `buffer` outside `[1, max_new_tokens]` or `penalty <= 0`.
    """
    if not 1 <= buffer <= max_new_tokens:
        raise ValueError(f"buffer must be in [1, max_new_tokens={max_new_tokens}], got {buffer}")
    if penalty <= 0:
        raise ValueError(f"penalty must be > 0, got {penalty}")
    lengths_B = lengths_B.to(torch.float32).clamp(max=max_new_tokens)
    exceed_B = lengths_B - (max_new_tokens - buffer)  # tokens into the buffer
    return (-penalty * exceed_B / buffer).clamp(max=0.0)
