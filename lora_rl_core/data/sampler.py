"""Seeded, resumable iteration over a problem list.

Each epoch visits every problem once in an order shuffled by
``random.Random(stable_seed(seed, epoch))``; a batch that runs past the end
of an epoch continues into the next one. The cursor ``(epoch, index)`` is
the whole state, so a checkpoint stores three ints.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from lora_rl_core.data.problems import Problem
from lora_rl_core.data.seeding import stable_seed
from lora_rl_core.errors import DataError

_STATE_KEYS = ("epoch", "index", "seed")


def _is_int(value: object) -> bool:
    """True for a real int (not a bool)."""
    return isinstance(value, int) and not isinstance(value, bool)


class PromptSampler:
    """Seeded shuffled iteration over ``problems`` with a resumable cursor.

    Args:
        problems: the problems to draw from (non-empty).
        seed: the shuffle seed; epoch ``e`` uses ``stable_seed(seed, e)``.

    Raises:
        DataError: an empty problem list.
    """

    def __init__(self, problems: Sequence[Problem], seed: int) -> None:
        if len(problems) == 0:
            raise DataError("PromptSampler needs at least one problem; the dataset is empty")
        self.problems = list(problems)
        self.seed = seed
        self.epoch = 0
        self.index = 0
        self._order = self._shuffled(0)

    def _shuffled(self, epoch: int) -> list[int]:
        """Return the visiting order of problem indices for ``epoch``."""
        order = list(range(len(self.problems)))
        random.Random(stable_seed(self.seed, epoch)).shuffle(order)
        return order

    def next_batch(self, n: int) -> list[Problem]:
        """Return the next ``n`` problems, continuing into the next epoch at the end of one.

        Raises:
            DataError: ``n < 1``.
        """
        if not _is_int(n) or n < 1:
            raise DataError(f"batch size must be a positive integer, got {n!r}")
        batch: list[Problem] = []
        while len(batch) < n:
            if self.index == len(self.problems):
                self.epoch, self.index = self.epoch + 1, 0
                self._order = self._shuffled(self.epoch)
            batch.append(self.problems[self._order[self.index]])
            self.index += 1
        return batch

    def batch_at(self, position: int, n: int) -> tuple[list[Problem], dict]:
        """The ``n`` problems from absolute ``position`` of the endless shuffled stream (epoch
        ``position // len(problems)``), and the cursor after them; this sampler's own cursor does not move,
        so rollouts of several steps may draw at once from several threads.

        Raises:
            DataError: ``position < 0`` or ``n < 1``.
        """
        if not _is_int(position) or position < 0:
            raise DataError(f"position must be a non-negative integer, got {position!r}")
        epoch, index = divmod(position, len(self.problems))
        cursor = PromptSampler(self.problems, self.seed)
        cursor.load_state_dict({"epoch": epoch, "index": index, "seed": self.seed})
        return cursor.next_batch(n), cursor.state_dict()

    def state_dict(self) -> dict:
        """Return the cursor as JSON-serialisable ``{"epoch": int, "index": int, "seed": int}``."""
        return {"epoch": self.epoch, "index": self.index, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        """Restore a cursor from ``state_dict()``; the following batches are then identical.

        Raises:
            DataError: ``state`` is not such a dict, has out-of-range values, or its
                seed differs from this sampler's seed.
        """
        if not isinstance(state, dict) or sorted(state) != sorted(_STATE_KEYS):
            raise DataError(f"sampler state must be a dict with keys {list(_STATE_KEYS)}, got {state!r}")
        if not all(_is_int(state[k]) for k in _STATE_KEYS):
            raise DataError(f"sampler state values must be integers, got {state!r}")
        if state["seed"] != self.seed:
            raise DataError(
                f"sampler state has seed {state['seed']} but the sampler has seed {self.seed}; "
                "resume with the same seed"
            )
        if state["epoch"] < 0 or not 0 <= state["index"] <= len(self.problems):
            raise DataError(
                f"sampler state {state!r} is out of range for {len(self.problems)} problems; "
                "was it saved for a different dataset?"
            )
        self.epoch, self.index = state["epoch"], state["index"]
        self._order = self._shuffled(self.epoch)
