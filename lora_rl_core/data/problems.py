"""The `Problem` record: one prompt with its gold answer and the rest of its dataset row.

Loaders: `lora_rl_core.data.sources` (any dataset through Hugging Face `datasets`, and the built-in GSM8K and
MAWPS presets), `lora_rl_core.data.arithmetic` (generated problems); `lora_rl_core.data.load_problems` picks
by `data.source`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Problem:
    """One prompt, its gold answer when the dataset has one, and the rest of its row.

    Attributes:
        prompt: text (TRL's standard format) or `{"role", "content"}` messages (TRL's conversational format).
        answer: the gold final answer as text, e.g. ``"68"``, ``"1,250"``, ``"3/4"``; None when the dataset
            has no answer column (a reward may need none).
        id: a stable id, e.g. ``"gsm8k-test-17"`` or ``"arith-add-2d-s0-5"``.
        columns: every other column of the dataset row, as `datasets` gives it, passed to reward functions by
            name; not part of equality.
    """

    prompt: str | list[dict[str, str]]
    answer: str | None
    id: str
    columns: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def question(self) -> str:
        """The prompt as text: the prompt itself, or the content of its last user message."""
        if isinstance(self.prompt, str):
            return self.prompt
        users = [m["content"] for m in self.prompt if m["role"] == "user"]
        return users[-1] if users else self.prompt[-1]["content"]
