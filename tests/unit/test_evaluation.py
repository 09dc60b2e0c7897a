"""Evaluation beyond greedy accuracy: the unbiased pass@k estimator (Chen et al. 2021) on hand-computed
values, and skipped completions in a group's advantages."""

from __future__ import annotations

import math

import pytest
import torch

from lora_rl_core.algorithm import ADVANTAGE_ESTIMATORS
from lora_rl_core.evaluation import pass_at_k
from lora_rl_core.run.phases import _fill_skipped, group_advantages


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


@pytest.mark.parametrize("name", sorted(ADVANTAGE_ESTIMATORS))
def test_advantages_of_a_group_with_skipped_rows_are_those_of_its_scored_rows_alone(name):
    estimator = ADVANTAGE_ESTIMATORS[name]
    rewards_NG = torch.tensor([[1.0, 0.0, 9.0, 1.0], [1.0, 0.0, 7.0, 7.0], [3.0, 2.0, 2.0, 5.0]])
    skipped_NG = torch.tensor([[False, False, True, False], [False, False, True, True], [True, True, True, False]])
    got = group_advantages(rewards_NG, skipped_NG, estimator)
    assert torch.allclose(got[0, [0, 1, 3]], estimator(torch.tensor([[1.0, 0.0, 1.0]]))[0]) and got[0, 2] == 0
    assert torch.allclose(got[1, :2], estimator(torch.tensor([[1.0, 0.0]]))[0]) and got[1, 2:].eq(0).all()
    assert got[2].eq(0).all()  # one scored row: nothing to compare it with
    full = torch.tensor([[1.0, 0.0, 2.0, 1.0]])
    assert torch.allclose(group_advantages(full, torch.zeros(1, 4, dtype=torch.bool), estimator), estimator(full))


def test_a_skipped_completion_takes_its_groups_mean_so_the_scored_ones_set_the_statistics():
    rewards_NG = torch.tensor([[1.0, 0.0, 9.0, 1.0], [5.0, 5.0, 5.0, 5.0]], dtype=torch.float64)
    skipped_NG = torch.tensor([[False, False, True, False], [True, True, True, True]])
    filled = _fill_skipped(rewards_NG, skipped_NG)
    assert filled.tolist() == [[1.0, 0.0, 2 / 3, 1.0], [0.0, 0.0, 0.0, 0.0]]
    assert filled[0].mean().item() == pytest.approx(2 / 3)  # the group's mean is that of its scored rows
