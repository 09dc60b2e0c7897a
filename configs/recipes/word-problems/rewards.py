"""Reward functions for the word-problems recipe, written as TRL users write them.

Each is called once per batch with the prompts, the completions and every other column of the dataset rows by
name (here MAWPS's `answer` and `equation_prefix`), and returns one value per completion (None: no opinion).
"""

import re

OPERATORS = {"+": r"\+", "-": r"[-\u2212]", "*": r"[*x\u00d7]", "/": r"[/\u00f7]"}
ANSWER = re.compile(r"####\s*-?\$?\d")


def writes_the_equation(prompts, completions, equation_prefix, **kwargs):
    """Partial credit for the right operation: 1.0 when the completion's working (the text before its last
    `####`) writes the row's one-step reference equation (`equation_prefix` `* 56 9`: `56 * 9`, or `9 * 56`
    since `*` and `+` commute) and the completion states a number after `####`; else 0.0. Restating the
    question earns nothing (it names the quantities, never the operation). None for rows whose equation has
    more than one step."""
    out = []
    for completion, equation in zip(completions, equation_prefix, strict=True):
        text = completion if isinstance(completion, str) else completion[-1]["content"]
        parts = (equation or "").split()
        if len(parts) != 3 or parts[0] not in OPERATORS:
            out.append(None)
            continue
        op, a, b = parts
        pairs = [(a, b), (b, a)] if op in "+*" else [(a, b)]
        pattern = "|".join(rf"(?<![\d.]){re.escape(x)}\s*{OPERATORS[op]}\s*{re.escape(y)}(?![\d.])" for x, y in pairs)
        answered = "####" in text and ANSWER.match(text, text.rfind("####")) is not None
        working = text.rsplit("####", 1)[0]
        out.append(1.0 if answered and re.search(pattern, working) else 0.0)
    return out
