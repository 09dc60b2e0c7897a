"""Unit tests for lora_rl_core.rewards: extraction, parsing, matching, loading, scoring."""

from __future__ import annotations

import math

import pytest

from lora_rl_core.errors import RewardError
from lora_rl_core.rewards import (
    REWARDS,
    answers_match,
    extract_answer,
    format_reward,
    load_reward,
    math_reward,
    parse_number,
    score_completions,
)

NOT_CALLABLE = 3


def length_reward(completion: str, answer: str) -> float:
    """A custom reward for the load_reward tests."""
    return float(len(completion))


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("She makes 9 * 2 = $<<9*2=18>>18.\n#### 18", "18"),
        ("#### 1,250", "1,250"),
        ("first #### 3 then #### 4 and 5", "4"),
        ("#### -$5.50.", "-$5.50"),
        ("#### 45%", "45%"),
        ("#### 3/4", "3/4"),
        ("#### €5", "€5"),
        ("#### the answer is .5", ".5"),
        ("So the answer is \\boxed{\\frac{1}{2}}.", "\\frac{1}{2}"),
        ("\\boxed{1} then \\boxed{42}", "42"),
        ("\\boxed{x = 5}", "5"),
        ("#### none, so \\boxed{7}", "7"),
        ("16-3-4 = 9 eggs.", "9"),
        ("It costs $12 and then 3.50 dollars.", "3.50"),
        ("The temperature is -7 now", "-7"),
        ("1,2,3", "3"),
        ("no number here", None),
        ("", None),
    ],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1,234", 1234.0),
        ("$12.50", 12.5),
        ("3/4", 0.75),
        ("45%", 45.0),
        ("\\frac{3}{4}", 0.75),
        ("\\dfrac{3}{4}", 0.75),
        ("-\\frac{1}{2}", -0.5),
        ("-7", -7.0),
        ("+3", 3.0),
        (".5", 0.5),
        ("18.", 18.0),
        ("-$5", -5.0),
        ("€5", 5.0),
        ("\\$18", 18.0),
        ("1{,}000", 1000.0),
        ("\u22122", -2.0),
    ],
)
def test_parse_number(text, expected):
    assert parse_number(text) == pytest.approx(expected)


@pytest.mark.parametrize("text", ["", "abc", "1,23", "1/0", "nan", "inf", "1/2/3", "--5", "$", "12 apples"])
def test_parse_number_rejects(text):
    assert parse_number(text) is None


@pytest.mark.parametrize(
    ("predicted", "gold"),
    [
        ("3.50", "3.5"),
        ("1250", "1,250"),
        ("$1,250.00", "1250"),
        ("3/4", "0.75"),
        ("\\frac{1}{2}", "0.5"),
        ("2/3", "0.6666666666666666"),
        ("45%", "45"),
        ("45%", "0.45"),
        ("0.45", "45%"),
        ("-7", "-7"),
        ("0", "0"),
        ("Yes", " yes "),
    ],
)
def test_answers_match(predicted, gold):
    assert answers_match(predicted, gold)


@pytest.mark.parametrize(
    ("predicted", "gold"),
    [
        (None, "1"),
        ("45", "0.45"),
        ("0.67", "0.6666666666666666"),
        ("7", "-7"),
        ("abc", "5"),
        ("1/0", "0"),
        ("no", "yes"),
    ],
)
def test_answers_do_not_match(predicted, gold):
    assert not answers_match(predicted, gold)


def test_rel_tol_is_used():
    assert not answers_match("100.001", "100")
    assert answers_match("100.001", "100", rel_tol=1e-4)


def test_math_and_format_rewards():
    assert math_reward("2 + 3 = 5\n#### 5", "5") == 1.0
    assert math_reward("#### 6", "5") == 0.0
    assert math_reward("I do not know", "5") == 0.0
    assert math_reward("the answer is 5", "5") == 1.0
    assert format_reward("#### 5", "ignored") == 1.0
    assert format_reward("####5.", "ignored") == 1.0
    assert format_reward("the answer is 5", "5") == 0.0
    assert format_reward("#### five", "5") == 0.0


def test_load_reward_by_name_and_path():
    assert load_reward("math") is math_reward
    assert load_reward("format") is format_reward
    assert set(REWARDS) == {"math", "format"}
    assert load_reward("lora_rl_core.rewards:math_reward") is math_reward
    assert load_reward("tests.unit.test_rewards:length_reward")("abc", "") == 3.0


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("accuracy", r"unknown reward 'accuracy'; use one of: format, math, or 'module\.path:function'"),
        ("mod:", r"unknown reward 'mod:'"),
        (
            "no_such_pkg_xyz.mod:fn",
            r"cannot import reward module 'no_such_pkg_xyz\.mod' .*"
            r"ModuleNotFoundError: No module named 'no_such_pkg_xyz'",
        ),
        ("lora_rl_core.rewards:no_such_fn", r"reward module 'lora_rl_core\.rewards' has no attribute 'no_such_fn'"),
        ("tests.unit.test_rewards:NOT_CALLABLE", r"is a int, not a callable"),
    ],
)
def test_load_reward_errors(name, message):
    with pytest.raises(RewardError, match=message):
        load_reward(name)


def test_score_completions_weights_and_raw():
    completions = ["#### 5", "the answer is 5", "#### 4"]
    answers = ["5", "5", "5"]
    totals, raw = score_completions(completions, answers, [("math", math_reward, 1.0), ("format", format_reward, 0.5)])
    assert raw == {"math": [1.0, 1.0, 0.0], "format": [1.0, 0.0, 1.0]}
    assert totals == [1.5, 1.0, 0.5]


def _raises(completion: str, answer: str) -> float:
    if completion == "bad":
        raise ValueError("boom\nsecond line")
    return 1.0


@pytest.mark.parametrize(
    ("fn", "message"),
    [
        (_raises, r"reward 'custom' raised on completion 1: ValueError: boom$"),
        (lambda c, a: math.nan if c == "bad" else 0.0, r"reward 'custom' returned nan for completion 1"),
        (lambda c, a: "1.0", r"reward 'custom' returned '1\.0' for completion 0; it must return a finite number"),
        (lambda c, a: None, r"returned None for completion 0"),
    ],
)
def test_score_completions_bad_reward(fn, message):
    with pytest.raises(RewardError, match=message):
        score_completions(["ok", "bad"], ["1", "1"], [("custom", fn, 1.0)])


def test_score_completions_bad_arguments():
    with pytest.raises(RewardError, match=r"2 completions but 1 answers"):
        score_completions(["a", "b"], ["1"], [("math", math_reward, 1.0)])
    with pytest.raises(RewardError, match=r"distinct names"):
        score_completions(["a"], ["1"], [("m", math_reward, 1.0), ("m", format_reward, 1.0)])
    with pytest.raises(RewardError, match=r"weight inf"):
        score_completions(["a"], ["1"], [("m", math_reward, math.inf)])
