"""Problems (any dataset through Hugging Face `datasets`, built-in presets, generated arithmetic), prompt
sampling and prompt rendering.

`problems`: the `Problem` record; `sources`: datasets as problems (`read_problems`, `PRESETS`); `load`: the
problems of a `data` section (`load_problems`) and the prompt instruction; `arithmetic`: the generator;
`prompts`: messages and token ids; `sampler`: seeded resumable iteration; `seeding`: `stable_seed`.
"""

from lora_rl_core.data.arithmetic import TEST_POOL_SIZE, ArithmeticGenerator, arithmetic_split
from lora_rl_core.data.load import dataset_spec, load_problems, prompt_instruction
from lora_rl_core.data.problems import Problem
from lora_rl_core.data.prompts import PromptStyle, build_messages, render_prompt
from lora_rl_core.data.sampler import PromptSampler
from lora_rl_core.data.seeding import stable_seed
from lora_rl_core.data.sources import PRESETS, DatasetSpec, read_problems

__all__ = [
    "PRESETS",
    "TEST_POOL_SIZE",
    "ArithmeticGenerator",
    "DatasetSpec",
    "Problem",
    "PromptSampler",
    "arithmetic_split",
    "build_messages",
    "dataset_spec",
    "load_problems",
    "PromptStyle",
    "prompt_instruction",
    "read_problems",
    "render_prompt",
    "stable_seed",
]
