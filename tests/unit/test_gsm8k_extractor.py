"""The math reward on every gold solution: the vendored data must score as intended.

For each gsm8k test row the worked solution scores 1 against its own answer
and 0 against another row's numerically different answer; for mawps,
``"#### {answer}"`` scores 1. Checked by math-verify in one worker (about 2,700 answers).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lora_rl_core.rewards import MathVerifier, format_reward

DATA_DIR = Path(__file__).resolve().parents[2] / "data"


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def _gold(solution: str) -> str:
    return solution.rsplit("####", 1)[1].strip()


def _value(answer: str) -> float:
    return float(answer.replace(",", ""))


@pytest.fixture(scope="module")
def verifier():
    with MathVerifier() as v:
        v.check(["1"], ["1"], "flexible")  # the worker starts under the fixture, which owns it
        yield v


def _different_answer(golds: list[str], i: int) -> str:
    """The next row's answer (cyclically) whose value differs from row ``i``'s."""
    for step in range(1, len(golds)):
        other = golds[(i + step) % len(golds)]
        if _value(other) != _value(golds[i]):
            return other
    raise AssertionError("all answers are equal")


def test_gsm8k_gold_solutions_score_one_and_wrong_answers_zero(verifier):
    rows = _rows(DATA_DIR / "gsm8k" / "test.jsonl")
    assert len(rows) == 1319
    solutions = [row["answer"] for row in rows]
    golds = [_gold(s) for s in solutions]
    right = verifier.check(golds, solutions, "strict")
    wrong = verifier.check([_different_answer(golds, i) for i in range(len(rows))], solutions, "strict")
    assert [i for i, ok in enumerate(right) if not ok] == []
    assert [i for i, ok in enumerate(wrong) if ok] == []
    assert format_reward(prompts=[""] * len(rows), completions=solutions) == [1.0] * len(rows)


def test_mawps_formatted_answers_score_one(verifier):
    rows = _rows(DATA_DIR / "mawps" / "test.jsonl")
    assert len(rows) == 384
    verdicts = verifier.check([row["answer"] for row in rows], [f"#### {row['answer']}" for row in rows], "strict")
    assert [row["answer"] for row, ok in zip(rows, verdicts, strict=True) if not ok] == []
