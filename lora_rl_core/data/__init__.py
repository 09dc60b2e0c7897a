"""Datasets, synthetic arithmetic problems, prompt sampling and prompt rendering."""

from lora_rl_core.data.arithmetic import TEST_POOL_SIZE, ArithmeticGenerator, arithmetic_split
from lora_rl_core.data.problems import DATASETS, Problem, load_dataset, load_jsonl_problems
from lora_rl_core.data.prompts import build_messages, render_prompt
from lora_rl_core.data.sampler import PromptSampler
from lora_rl_core.data.seeding import stable_seed

__all__ = [
    "DATASETS",
    "TEST_POOL_SIZE",
    "ArithmeticGenerator",
    "Problem",
    "PromptSampler",
    "arithmetic_split",
    "build_messages",
    "load_dataset",
    "load_jsonl_problems",
    "render_prompt",
    "stable_seed",
]
