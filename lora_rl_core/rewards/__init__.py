"""Reward functions as TRL users write them, and scoring a batch with several weighted ones.

`score`: `RewardSet` (a run's weighted terms; async functions concurrent under a timeout; None skips),
`RewardBatch`, `ScoredRewards`; `load`: a function by name (built-in, `module:function`, `file.py:function`);
`builtin`: `math` and `format`; `verify`: `check_answer` and `MathVerifier` (numbers compared here, symbolic
answers through math-verify in worker processes, with a deadline per answer); `answers`: the answer a completion
states (`####`, `\\boxed{}`, the last number) and numeric comparison; `grader`: the evaluation's fixed grader;
`leaks`: the check that no term pays for a restated prompt.
"""

from lora_rl_core.rewards.answers import ANSWER_FORMATS, AnswerFormat, extract_answer, has_gsm8k_answer
from lora_rl_core.rewards.builtin import BUILTIN_REWARDS, MathReward, completion_text, format_reward
from lora_rl_core.rewards.grader import AnswerGrader, FunctionGrader, Grader, build_grader
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
    "ANSWER_FORMATS",
    "AnswerFormat",
    "AnswerGrader",
    "FunctionGrader",
    "Grader",
    "build_grader",
    "extract_answer",
    "check_answer",
    "completion_text",
    "format_reward",
    "has_gsm8k_answer",
    "load_reward_function",
]
