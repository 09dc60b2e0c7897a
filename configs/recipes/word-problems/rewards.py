"""Reward functions for the word-problems recipe, written as TRL users write them.

Each is called once per batch with the prompts, the completions and every other column of the dataset rows by
name (here MAWPS's `answer` and `equation_prefix`), and returns one value per completion (None: no opinion).
"""

import re

NUMBER = re.compile(r"\d+(?:\.\d+)?")


def uses_the_numbers(prompts, completions, equation_prefix, **kwargs):
    """Partial credit: the share of the numbers in the row's reference equation that the completion mentions
    (a model that copies the right quantities is on its way to the answer). None when the equation has none."""
    out = []
    for completion, equation in zip(completions, equation_prefix, strict=True):
        text = completion if isinstance(completion, str) else completion[-1]["content"]
        wanted = set(NUMBER.findall(equation or ""))
        out.append(len(wanted & set(NUMBER.findall(text))) / len(wanted) if wanted else None)
    return out
