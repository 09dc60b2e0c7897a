"""Evaluation beyond greedy accuracy: the unbiased pass@k estimator (Chen et al. 2021) on hand-computed
values."""

from __future__ import annotations

import math

import pytest

from lora_rl_core.evaluation import pass_at_k


@pytest.mark.parametrize(
    ("n", "c", "k", "expected"),
    [
        (5, 2, 1, 0.4),  # pass@1 is the success rate
        (5, 2, 2, 1 - 3 / 10),  # 1 - C(3, 2) / C(5, 2)
        (5, 2, 4, 1.0),  # n - c < k: every draw of 4 holds a success
        (4, 0, 2, 0.0),
        (4, 4, 1, 1.0),
        (10, 3, 5, 1 - math.comb(7, 5) / math.comb(10, 5)),
    ],
)
def test_pass_at_k_is_the_unbiased_estimator(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected)


@pytest.mark.parametrize(("n", "c", "k"), [(4, 5, 1), (4, 1, 0), (4, 1, 5), (4, -1, 1)])
def test_pass_at_k_refuses_impossible_counts(n, c, k):
    with pytest.raises(ValueError, match="pass@k needs"):
        pass_at_k(n, c, k)
