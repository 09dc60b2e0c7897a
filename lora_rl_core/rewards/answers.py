"""Where a completion states its answer, and whether it states it in the GSM8K format.

`answer_span` finds the text math-verify should parse (`lora_rl_core.rewards.verify`): the first number after
the last `####` (GSM8K's convention, which math-verify alone misreads when words follow the number); otherwise
the whole completion, where math-verify finds a `\\boxed{}` or the last expression itself. `stated_text` is
the answer as text, for gold answers with no math in them. Number tokens may carry thousands commas, a sign,
decimals, a fraction (`3/4`, `\\frac{3}{4}`), a percent or a currency sign (`$ € £`).
"""

from __future__ import annotations

import re

_SIGN = r"(?:(?<![\w)\]}])[-+\u2212])?"  # a sign only where it cannot be a binary minus
_UNSIGNED = r"(?:\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+)"
_NUMBER_RE = re.compile(rf"{_SIGN}[$€£]?{_SIGN}{_UNSIGNED}(?:\s*/\s*{_UNSIGNED})?(?:\s*%)?")
_FORMAT_RE = re.compile(rf"####\s*{_NUMBER_RE.pattern}")


def _boxed_content(text: str) -> str | None:
    """Return the content of the last balanced ``\\boxed{...}`` in ``text``, or ``None``."""
    start = text.rfind("\\boxed{")
    while start != -1:
        depth, begin = 0, start + len("\\boxed")
        for pos in range(begin, len(text)):
            depth += {"{": 1, "}": -1}.get(text[pos], 0)
            if depth == 0:
                return text[begin + 1 : pos]
        start = text.rfind("\\boxed{", 0, start)
    return None


def answer_span(text: str) -> str:
    """The part of a completion that math-verify should parse: the first number after the last ``####`` when
    there is one (``#### -3 apples, 4 left`` states -3), else the whole completion."""
    if "####" in text:
        found = _NUMBER_RE.search(text.rsplit("####", 1)[1])
        if found:
            return found.group(0).strip()
    return text


def has_gsm8k_answer(text: str) -> bool:
    """Whether the completion contains ``#### <number>``."""
    return _FORMAT_RE.search(text) is not None


def stated_text(text: str) -> str:
    """The answer a completion states as text: the first line after the last ``####``, else the last
    ``\\boxed{}``'s content, else the whole completion."""
    if "####" in text:
        lines = text.rsplit("####", 1)[1].strip().splitlines()
        return lines[0] if lines else ""
    boxed = _boxed_content(text)
    return boxed if boxed is not None else text
