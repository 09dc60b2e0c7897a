"""A math-verify check that takes half a second: a deadline test's answer that is past its deadline on any
machine (imported by the verifier's spawned worker, by name)."""

from __future__ import annotations

import time

from lora_rl_core.rewards.answers import AnswerFormat
from lora_rl_core.rewards.verify import check_answer

SECONDS = 0.5


def check_answer_slowly(gold: str, completion: str, answer_format: AnswerFormat) -> bool:
    """`check_answer`, after sleeping `SECONDS`."""
    time.sleep(SECONDS)
    return check_answer(gold, completion, answer_format)
