"""A user reward loaded by `module:function` in the integration test: fraction of digit characters.

A tiny random model almost never solves arithmetic, so the math reward would be
all zeros; this reward varies across completions, which gives the flow real
advantages to train on.
"""


def digit_fraction(completion: str, answer: str) -> float:
    """Fraction of the completion's characters that are digits (0.0 for an empty completion)."""
    return sum(ch.isdigit() for ch in completion) / len(completion) if completion else 0.0
