"""The extractor on every gold solution: the vendored data must score as intended.

For each gsm8k test row the worked solution scores 1 against its own answer
and 0 against another row's numerically different answer; for mawps,
``"#### {answer}"`` scores 1.
"""

from __future__ import annotations

import json
from pathlib import Path

from lora_rl_core.rewards import format_reward, math_reward, parse_number

DATA_DIR = Path(__file__).resolve().parents[2] / "data"


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def _gold(solution: str) -> str:
    return solution.rsplit("####", 1)[1].strip()


def _different_answer(golds: list[str], i: int) -> str:
    """The next row's answer (cyclically) whose value differs from row ``i``'s."""
    for step in range(1, len(golds)):
        other = golds[(i + step) % len(golds)]
        if parse_number(other) != parse_number(golds[i]):
            return other
    raise AssertionError("all answers are equal")


def test_gsm8k_gold_solutions_score_one_and_wrong_answers_zero():
    rows = _rows(DATA_DIR / "gsm8k" / "test.jsonl")
    assert len(rows) == 1319
    golds = [_gold(row["answer"]) for row in rows]
    right = [
        i for i, (row, gold) in enumerate(zip(rows, golds, strict=True)) if math_reward(row["answer"], gold) != 1.0
    ]
    wrong = [i for i, row in enumerate(rows) if math_reward(row["answer"], _different_answer(golds, i)) != 0.0]
    assert right == []
    assert wrong == []
    assert all(format_reward(row["answer"], gold) == 1.0 for row, gold in zip(rows, golds, strict=True))


def test_mawps_formatted_answers_score_one():
    rows = _rows(DATA_DIR / "mawps" / "test.jsonl")
    assert len(rows) == 384
    failed = [row["answer"] for row in rows if math_reward(f"#### {row['answer']}", row["answer"]) != 1.0]
    assert failed == []
