"""The answer a completion states, and whether a stated number equals a numeric gold answer.

Only the stated answer is read; nothing else of the completion is parsed (a completion that restates the
problem, `"The sum 76 + 57"`, states no answer: issue 31, where math-verify evaluated the restated problem).

Where a completion states its answer (`extract_answer`), after lm-eval's gsm8k filters:

* `strict` (lm-eval's `strict-match`, the format the instruction asks for): the text after the last `####`
  up to the end of its line (where it holds a letter, a digit or LaTeX: `####.` states nothing), else the
  content of the last balanced `\\boxed{}`; else no answer.
* `flexible` (lm-eval's `flexible-extract`): the strict answer where there is one, else the last number in
  the completion.

A number token may carry thousands commas (`1,250`), a sign, decimals (`.5`), a fraction (`3/4`,
`\\frac{3}{4}`), a percent sign or a currency sign (`$ € £`). A number that is an operand of an arithmetic
expression (`34 + 49`, `25000 - 8 * 1500`) is not a stated number, whatever the expression evaluates to.

Numeric comparison (`stated_number`, `numbers_equal`): exact as fractions, else `math.isclose` with
`rel_tol=1e-9` (so a gold `0.6666666666666666` accepts `2/3`, never `0.67`); a percent matches both its
number and a hundredth of it (`45%` matches `45` and `0.45`, on either side).
"""

from __future__ import annotations

import math
import re
from fractions import Fraction
from typing import Literal

AnswerFormat = Literal["strict", "flexible"]
"""Where a completion states its answer (module docstring): `reward.answer_format`."""
ANSWER_FORMATS: tuple[AnswerFormat, ...] = ("strict", "flexible")

_SIGN = r"(?:(?<![\w)\]}])[-+\u2212])?"  # a sign only where it cannot be a binary minus
_UNSIGNED = r"(?:\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+)"
# `3/4` is a fraction; `12 / 4`, with spaces, is a division (an expression).
_NUMBER_RE = re.compile(rf"{_SIGN}[$€£]?{_SIGN}{_UNSIGNED}(?:/{_UNSIGNED})?(?:\s*%)?")
_LATEX_FRAC_RE = re.compile(r"^([-+\u2212]?)\\[dt]?frac\{\s*([^{}]+?)\s*\}\{\s*([^{}]+?)\s*\}$")
_OPERATOR = r"[-+*/×÷^x\u2212\u22c5·]"
# An operator then a number right after a number: the number starts an expression (`34 + 49`, `3x4`).
_OPERATOR_AFTER_RE = re.compile(rf"\s*{_OPERATOR}\s*[$€£(]?\s*\.?\d")
# A number (or a closing bracket) then an operator right before a number: the number ends an expression.
_OPERATOR_BEFORE_RE = re.compile(rf"[\d)]\s*{_OPERATOR}\s*[$€£(]?\s*$")
_STATES_SOMETHING_RE = re.compile(r"[\w\\]")
_PERCENT_WORDS_RE = re.compile(r"\s*(?:percent|per cent)\b", re.IGNORECASE)


def boxed_content(text: str) -> str | None:
    """The content of the last balanced ``\\boxed{...}`` in ``text``, or None."""
    start = text.rfind("\\boxed{")
    while start != -1:
        depth, begin = 0, start + len("\\boxed")
        for pos in range(begin, len(text)):
            depth += {"{": 1, "}": -1}.get(text[pos], 0)
            if depth == 0:
                return text[begin + 1 : pos]
        start = text.rfind("\\boxed{", 0, start)
    return None


def extract_answer(text: str, answer_format: AnswerFormat) -> str | None:
    """The answer `text` states (module docstring), as text, or None where it states none.

    Args:
        text: one completion.
        answer_format: `strict` (after the last `####`, else the last `\\boxed{}`) or `flexible` (else the last
            number that is no operand of an expression).

    Raises:
        ValueError: an unknown `answer_format`.
    """
    check_answer_format(answer_format)
    if "####" in text:
        line = _line_after_marker(text)
        if _STATES_SOMETHING_RE.search(line):  # `####.` (the instruction restated) states nothing
            return line
    boxed = boxed_content(text)
    if boxed is not None and boxed.strip():
        return boxed.strip()
    numbers = list(_NUMBER_RE.finditer(text)) if answer_format == "flexible" else []
    if not numbers or _is_operand(text, numbers[-1]):
        return None
    return numbers[-1].group(0).strip()


def check_answer_format(answer_format: str) -> None:
    """Raises ValueError naming the choices when `answer_format` is not one of `ANSWER_FORMATS`."""
    if answer_format not in ANSWER_FORMATS:
        raise ValueError(f"unknown answer format {answer_format!r}; use one of {', '.join(ANSWER_FORMATS)}")


def stated_number(span: str) -> tuple[Fraction, bool] | None:
    """The number a stated answer `span` (`extract_answer`) begins with, as `(value, is_percent)`, or None where
    it begins with none, or with one that is an operand of an expression (`76 + 57`, `3 * 4`). Words after
    the number are allowed (`5 apples`, `-3, 4 left`); so are words before it (`the answer is .5`)."""
    latex = _LATEX_FRAC_RE.match(span.strip().rstrip("."))
    if latex:
        value = _fraction(f"{latex.group(2)}/{latex.group(3)}")
        if value is None:
            return None
        return (-value if latex.group(1) else value), False
    found = _NUMBER_RE.search(span)
    if found is None or _is_operand(span, found):
        return None
    token = found.group(0).strip()
    percent = token.endswith("%") or _PERCENT_WORDS_RE.match(span, found.end()) is not None
    value = _fraction(token)
    return None if value is None else (value, percent)


def parse_gold_number(gold: str) -> tuple[Fraction, bool] | None:
    """A gold answer's value when the whole gold answer is one number (`1,250`, `-3.5`, `3/4`, `45%`, `$5`,
    `\\frac{3}{4}`), else None (a symbolic or text answer: math-verify's or a text comparison's)."""
    text = gold.strip().rstrip(".").strip()
    whole_number = _LATEX_FRAC_RE.match(text) or _NUMBER_RE.fullmatch(text)
    return stated_number(text) if whole_number else None


def numbers_equal(gold: tuple[Fraction, bool], stated: tuple[Fraction, bool]) -> bool:
    """Whether a stated number equals the gold number (module docstring: exact, else `rel_tol=1e-9`; a percent
    on either side matches its number and a hundredth of it)."""
    golds = {gold[0], gold[0] / 100} if gold[1] else {gold[0]}
    stateds = {stated[0], stated[0] / 100} if stated[1] else {stated[0]}
    return any(g == s or math.isclose(float(g), float(s), rel_tol=1e-9, abs_tol=1e-12) for g in golds for s in stateds)


def has_gsm8k_answer(text: str) -> bool:
    """Whether the completion states a number after its last ``####`` (GSM8K's answer format; an expression
    such as ``#### 34 + 49`` is no stated number)."""
    if "####" not in text:
        return False
    return stated_number(_line_after_marker(text)) is not None


# what may close a `\boxed{}` answer: `$`, `.`, `\]`, `\)`
_AFTER_BOXED_RE = re.compile(r"[\s$.]*(?:\\\]|\\\))?[\s$.]*")


def answer_is_last(text: str) -> bool:
    """Whether `text` states one answer, in the asked format, as its last content: exactly one answer marker
    (one `####`, or one `\\boxed{}` without a `####`), and nothing after the answer but white space (after a
    `\\boxed{}`: a closing `$`, `\\]`, `\\)` or `.`). The line after `####` must state a number
    (`has_gsm8k_answer`: not an expression) and no other number; a `\\boxed{}` must hold something.

    `#### 9\\nThe final answer is 9` (an answer, then more), `#### 5\\n#### 6` (two answers) and `` are not;
    `41 + 57 = 98\\n#### 98` is."""
    body = text.rstrip()
    markers = body.count("####") + body.count("\\boxed{")
    if markers != 1:
        return False
    if "####" in body:
        line = body.rsplit("####", 1)[1]
        # one number on the answer line: `#### 98 trees` is an answer, `#### 98, 41 + 3 = 44` ends with another
        return "\n" not in line and has_gsm8k_answer(body) and len(_NUMBER_RE.findall(line)) == 1
    boxed = boxed_content(body)
    if boxed is None or not boxed.strip():
        return False
    end = body.rfind("\\boxed{") + len("\\boxed{") + len(boxed) + 1  # just past the closing brace
    return _AFTER_BOXED_RE.fullmatch(body, end) is not None


def _line_after_marker(text: str) -> str:
    """The rest of the line after the last ``####``, stripped."""
    return text.rsplit("####", 1)[1].split("\n", 1)[0].strip()


def _is_operand(text: str, found: re.Match[str]) -> bool:
    """Whether the number `found` in `text` is an operand of an arithmetic expression: an operator and a number
    follow it, or a number and an operator come right before it."""
    if _OPERATOR_AFTER_RE.match(text, found.end()) is not None:
        return True
    return _OPERATOR_BEFORE_RE.search(text, 0, found.start()) is not None


def _fraction(token: str) -> Fraction | None:
    """A number token's value (commas, currency, percent sign and spaces removed; `a/b` divided)."""
    clean = token.replace(",", "").replace("\u2212", "-").replace("%", "").replace(" ", "")
    clean = clean.translate(str.maketrans("", "", "$€£"))
    sign = -1 if clean.count("-") % 2 else 1
    clean = clean.replace("-", "").replace("+", "")
    try:
        if "/" in clean:
            num, den = clean.split("/", 1)
            return None if Fraction(den) == 0 else sign * Fraction(num) / Fraction(den)
        return sign * Fraction(clean)
    except (ValueError, ZeroDivisionError):
        return None
