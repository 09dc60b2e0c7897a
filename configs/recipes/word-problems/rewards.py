"""Reward functions for the word-problems recipe, written as TRL users write them.

Each is called once per batch with the prompts, the completions and every other column of the dataset rows by
name (here MAWPS's `answer` and `equation_prefix`), and returns one value per completion (None: no opinion).
"""

import re

NUMBER = re.compile(r"\d+(?:\.\d+)?")
ANSWER = re.compile(r"####\s*-?\$?\d")


def uses_the_numbers(prompts, completions, equation_prefix, **kwargs):
    """Partial credit for an answer worked from the right quantities: the share of the numbers in the row's
    reference equation that the completion's working (the text before its last `####`) mentions, when the
    completion states a number after `####`; 0.0 when it states none, so restating the question, which holds
    every quantity, earns nothing. None when the equation has none."""
    out = []
    for completion, equation in zip(completions, equation_prefix, strict=True):
        text = completion if isinstance(completion, str) else completion[-1]["content"]
        wanted = set(NUMBER.findall(equation or ""))
        if not wanted:
            out.append(None)
            continue
        answered = "####" in text and ANSWER.match(text, text.rfind("####")) is not None
        working = text.rsplit("####", 1)[0]
        out.append(len(wanted & set(NUMBER.findall(working))) / len(wanted) if answered else 0.0)
    return out
