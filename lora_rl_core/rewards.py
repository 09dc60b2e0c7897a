"""Answer extraction, numeric answer matching and reward functions.

A reward function is ``(completion_text, gold_answer) -> float``. Built-ins:

* ``math``: 1.0 when the extracted final answer equals the gold answer numerically.
* ``format``: 1.0 when the completion contains ``#### <number>``.

Choices:

* Extraction order: the first number after the last ``####``; else the last
  ``\\boxed{...}`` (nested braces allowed); else the last number in the text.
* Numbers may carry thousands commas (``1,234``), a sign, decimals (``.5``),
  a fraction (``3/4``, ``\\frac{3}{4}``), a percent sign or a currency sign
  (``$ € £``). Scientific notation and mixed numbers (``1 1/2``) are left out.
* A percent matches both its bare number and a hundredth of it: ``45%``
  matches ``45`` and ``0.45`` (on either side).
* Numbers compare with ``math.isclose(rel_tol=1e-6, abs_tol=1e-9)``, so a gold
  ``0.6666666666666666`` accepts ``2/3`` but not ``0.67``. A gold answer that
  is not a number is compared as whitespace-normalised, case-folded text.

Other reward functions are named as ``"module.path:function"`` (``load_reward``).
"""

from __future__ import annotations

import importlib
import math
import numbers
import re
from collections.abc import Callable, Sequence

from lora_rl_core.errors import RewardError

RewardFn = Callable[[str, str], float]
"""(completion_text, gold_answer) -> reward."""

_SIGN = r"(?:(?<![\w)\]}])[-+\u2212])?"  # a sign only where it cannot be a binary minus
_UNSIGNED = r"(?:\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+)"
_NUMBER_RE = re.compile(rf"{_SIGN}[$€£]?{_SIGN}{_UNSIGNED}(?:\s*/\s*{_UNSIGNED})?(?:\s*%)?")
_PLAIN_RE = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)?(?:\.\d+)?")
_FRAC_RE = re.compile(r"([-+]?)\\[dt]?frac\{([^{}]+)\}\{([^{}]+)\}")
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


def _last_number(text: str) -> str | None:
    """Return the last number token in ``text`` (see module docstring), or ``None``."""
    matches = _NUMBER_RE.findall(text)
    return matches[-1].strip() if matches else None


def extract_answer(text: str) -> str | None:
    """Extract the final answer from a completion.

    Args:
        text: the completion.

    Returns:
        The first number after the last ``####``; else the content of the last
        ``\\boxed{}`` (the content itself if it parses as a number, else its last
        number, else the stripped content); else the last number in the text;
        else ``None``. Number tokens keep their sign, currency and percent signs.
    """
    if "####" in text:
        found = _NUMBER_RE.search(text.rsplit("####", 1)[1])
        if found:
            return found.group(0).strip()
    boxed = _boxed_content(text)
    if boxed is not None:
        if parse_number(boxed) is not None:
            return boxed.strip()
        return _last_number(boxed) or boxed.strip() or None
    return _last_number(text)


def _parse_plain(text: str) -> float | None:
    """Parse a signed decimal with optional thousands commas; ``None`` if it is not one."""
    text = text.strip()
    if not any(c.isdigit() for c in text) or not _PLAIN_RE.fullmatch(text):
        return None
    return float(text.replace(",", ""))


def _parse_ratio(text: str) -> float | None:
    """Parse ``a/b`` or ``\\frac{a}{b}`` (or a plain number); ``None`` if not one or ``b == 0``."""
    frac = _FRAC_RE.fullmatch(text)
    if frac:
        sign, text = frac.group(1), f"{frac.group(2)}/{frac.group(3)}"
        value = _parse_ratio(text)
        return None if value is None else (-value if sign == "-" else value)
    if text.count("/") != 1:
        return _parse_plain(text)
    num, den = (_parse_plain(part) for part in text.split("/"))
    return None if num is None or not den else num / den


def _parse(text: str) -> tuple[float, bool] | None:
    """Parse ``text`` into ``(value, is_percent)``; ``None`` if it is not a number."""
    text = text.strip().rstrip(".").strip()
    for old, new in (("\\$", "$"), ("\\%", "%"), ("{,}", ","), ("\\!", ""), ("\u2212", "-")):
        text = text.replace(old, new)
    percent = text.endswith("%")
    text = text.removesuffix("%").strip()
    sign = text[0] if text[:1] in ("-", "+") else ""
    text = text.removeprefix(sign).strip().strip("$€£").strip()
    value = _parse_ratio(sign + text)
    return None if value is None else (value, percent)


def parse_number(text: str) -> float | None:
    """Parse an answer token into a float.

    Examples: ``"1,234"`` -> 1234, ``"$12.50"`` -> 12.5, ``"3/4"`` -> 0.75,
    ``"45%"`` -> 45 (the percent sign is dropped; see ``answers_match``),
    ``"\\frac{3}{4}"`` -> 0.75, ``"-7"`` -> -7, ``"18."`` -> 18.

    Args:
        text: the token, e.g. from ``extract_answer``.

    Returns:
        The value, or ``None`` if ``text`` is not a number (or divides by zero).
    """
    parsed = _parse(text)
    return None if parsed is None else parsed[0]


def _candidates(text: str) -> list[float] | None:
    """Values ``text`` may stand for: a percent is both ``v`` and ``v / 100``."""
    parsed = _parse(text)
    if parsed is None:
        return None
    value, percent = parsed
    return [value, value / 100] if percent else [value]


def answers_match(predicted: str | None, gold: str, *, rel_tol: float = 1e-6) -> bool:
    """Whether a predicted answer equals the gold answer.

    Numbers compare with ``math.isclose(rel_tol=rel_tol, abs_tol=1e-9)``; a
    percent on either side matches both its number and a hundredth of it
    (``"45%"`` matches ``"45"`` and ``"0.45"``). A non-numeric gold answer is
    compared as case-folded text with whitespace collapsed.

    Args:
        predicted: the extracted answer, or ``None`` (never matches).
        gold: the gold answer text.
        rel_tol: relative tolerance for numbers.
    """
    if predicted is None:
        return False
    gold_values = _candidates(gold)
    if gold_values is None:
        return " ".join(predicted.split()).casefold() == " ".join(gold.split()).casefold()
    pred_values = _candidates(predicted) or []
    return any(math.isclose(p, g, rel_tol=rel_tol, abs_tol=1e-9) for p in pred_values for g in gold_values)


def math_reward(completion: str, answer: str) -> float:
    """1.0 if the completion's extracted answer matches ``answer`` (``answers_match``), else 0.0."""
    return 1.0 if answers_match(extract_answer(completion), answer) else 0.0


def format_reward(completion: str, answer: str) -> float:
    """1.0 if the completion contains ``#### <number>``, else 0.0; ``answer`` is unused."""
    return 1.0 if _FORMAT_RE.search(completion) else 0.0


REWARDS: dict[str, RewardFn] = {"math": math_reward, "format": format_reward}


def _one_line(err: BaseException) -> str:
    """``"ErrorType: first line of the message"`` for a one-line error report."""
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0]}" if lines else type(err).__name__


def load_reward(name: str) -> RewardFn:
    """Return a reward function by registry name or ``"module.path:function"``.

    Args:
        name: a key of ``REWARDS`` (``"math"``, ``"format"``) or ``"pkg.module:function"``.

    Raises:
        RewardError: an unknown registry name, a module that cannot be imported,
            a missing attribute, or an object that is not callable.
    """
    if name in REWARDS:
        return REWARDS[name]
    module_name, sep, attr = name.partition(":")
    if not sep or not module_name or not attr:
        valid = ", ".join(sorted(REWARDS))
        raise RewardError(f"unknown reward {name!r}; use one of: {valid}, or 'module.path:function'")
    try:
        module = importlib.import_module(module_name)
    except Exception as err:  # any import-time failure is the user's module's fault
        raise RewardError(f"cannot import reward module {module_name!r} for {name!r}: {_one_line(err)}") from None
    fn = getattr(module, attr, None)
    if fn is None:
        raise RewardError(f"reward module {module_name!r} has no attribute {attr!r}")
    if not callable(fn):
        raise RewardError(f"reward {name!r} is a {type(fn).__name__}, not a callable (completion, answer) -> float")
    return fn


def _call_reward(name: str, fn: RewardFn, completion: str, answer: str, index: int) -> float:
    """Call one reward function; raise ``RewardError`` on an exception or a non-finite result."""
    try:
        value = fn(completion, answer)
    except Exception as err:
        raise RewardError(f"reward {name!r} raised on completion {index}: {_one_line(err)}") from None
    if not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise RewardError(f"reward {name!r} returned {value!r} for completion {index}; it must return a finite number")
    return float(value)


def score_completions(
    completions: Sequence[str],
    answers: Sequence[str],
    reward_fns: Sequence[tuple[str, RewardFn, float]],
) -> tuple[list[float], dict[str, list[float]]]:
    """Score completions with several weighted reward functions.

    Args:
        completions: the completion texts, length ``N``.
        answers: the gold answer for each completion, length ``N``.
        reward_fns: ``(name, fn, weight)`` triples with distinct names.

    Returns:
        ``(totals_N, raw)``: ``totals_N[i] = sum(weight * fn(completions[i], answers[i]))``
        and ``raw[name]`` the unweighted values of each reward, length ``N``.

    Raises:
        RewardError: mismatched lengths, no or duplicate reward names, a non-finite
            weight, or a reward function raising or returning a non-finite / non-number.
    """
    if len(completions) != len(answers):
        raise RewardError(f"got {len(completions)} completions but {len(answers)} answers; they must pair up")
    names = [name for name, _, _ in reward_fns]
    if not names or len(set(names)) != len(names):
        raise RewardError(f"reward functions need distinct names, at least one; got {names}")
    raw: dict[str, list[float]] = {}
    totals = [0.0] * len(completions)
    for name, fn, weight in reward_fns:
        if not isinstance(weight, numbers.Real) or not math.isfinite(weight):
            raise RewardError(f"reward {name!r} has weight {weight!r}; it must be a finite number")
        raw[name] = [_call_reward(name, fn, c, a, i) for i, (c, a) in enumerate(zip(completions, answers, strict=True))]
        totals = [t + weight * r for t, r in zip(totals, raw[name], strict=True)]
    return totals, raw
