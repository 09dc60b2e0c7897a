"""Reward functions as TRL users write them, and scoring a batch with several weighted ones.

`score`: `RewardSet` (a run's weighted terms; async functions concurrent under a timeout; None skips),
`RewardBatch`, `ScoredRewards`; `load`: a function by name (built-in, `module:function`, `file.py:function`);
`builtin`: `math` (math-verify) and `format`; `verify`: `MathVerifier` (math-verify in worker processes, with a
deadline per answer); `answers`: where a completion states its answer (`####`, `\\boxed{}`).
"""

from lora_rl_core.rewards.answers import answer_span, has_gsm8k_answer, stated_text
from lora_rl_core.rewards.builtin import BUILTIN_REWARDS, MathReward, completion_text, format_reward
from lora_rl_core.rewards.load import load_reward_function
from lora_rl_core.rewards.score import (
    RewardBatch,
    RewardSet,
    RewardTerm,
    ScoredRewards,
)
from lora_rl_core.rewards.verify import MathVerifier, check_answer

__all__ = [
    "BUILTIN_REWARDS",
    "MathReward",
    "MathVerifier",
    "RewardBatch",
    "RewardSet",
    "RewardTerm",
    "ScoredRewards",
    "answer_span",
    "check_answer",
    "completion_text",
    "format_reward",
    "has_gsm8k_answer",
    "stated_text",
    "load_reward_function",
]
