"""User rewards loaded by name in the integration tests, written as TRL users write them.

A tiny random model almost never solves arithmetic, so the math reward would be all zeros; `digit_fraction`
varies across completions, which gives the flow real advantages to train on.
"""


def digit_fraction(prompts, completions, completion_ids=None, **kwargs) -> list[float]:
    """Fraction of each completion's characters that are digits (0.0 for an empty completion)."""
    return [sum(ch.isdigit() for ch in c) / len(c) if c else 0.0 for c in completions]
