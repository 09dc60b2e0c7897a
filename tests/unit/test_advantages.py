"""Advantage estimators against hand-computed numbers."""

from __future__ import annotations

import pytest
import torch

from lora_rl_core.algorithm import (
    ADVANTAGE_ESTIMATORS,
    critic_advantages,
    drgrpo_advantages,
    group_has_signal,
    grpo_advantages,
    masked_group_advantages,
    rloo_advantages,
)

# Group 0 has signal (mean 0.5), group 1 is all equal.
REWARDS_NG = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0]])


def test_grpo_uses_unbiased_std_and_zeroes_flat_groups():
    # unbiased std of [1, 0, 0, 1] = sqrt(4 * 0.25 / 3) = 0.57735; 0.5 / 0.57735 = 0.8660
    adv_NG = grpo_advantages(REWARDS_NG)
    expected = torch.tensor([[0.8660, -0.8660, -0.8660, 0.8660], [0.0, 0.0, 0.0, 0.0]])
    torch.testing.assert_close(adv_NG, expected, atol=1e-4, rtol=0)
    assert not adv_NG.isnan().any()


def test_grpo_asymmetric_group():
    # [3, 0, 0]: mean 1, deviations [2, -1, -1], unbiased var (4 + 1 + 1) / 2 = 3, std 1.7320508
    adv_NG = grpo_advantages(torch.tensor([[3.0, 0.0, 0.0]]), eps=0.0)
    torch.testing.assert_close(adv_NG, torch.tensor([[1.1547005, -0.5773503, -0.5773503]]))


def test_drgrpo_subtracts_group_mean_only():
    torch.testing.assert_close(
        drgrpo_advantages(REWARDS_NG), torch.tensor([[0.5, -0.5, -0.5, 0.5], [0.0, 0.0, 0.0, 0.0]])
    )
    torch.testing.assert_close(drgrpo_advantages(torch.tensor([[3.0, 0.0, 0.0]])), torch.tensor([[2.0, -1.0, -1.0]]))


def test_rloo_subtracts_mean_of_the_others():
    # 1 - (0 + 0 + 1) / 3 = 0.6667; 0 - (1 + 0 + 1) / 3 = -0.6667
    adv_NG = rloo_advantages(REWARDS_NG)
    expected = torch.tensor([[0.6667, -0.6667, -0.6667, 0.6667], [0.0, 0.0, 0.0, 0.0]])
    torch.testing.assert_close(adv_NG, expected, atol=1e-4, rtol=0)
    # [3, 0, 0]: 3 - 0 = 3; 0 - (3 + 0) / 2 = -1.5
    torch.testing.assert_close(rloo_advantages(torch.tensor([[3.0, 0.0, 0.0]])), torch.tensor([[3.0, -1.5, -1.5]]))


def test_integer_rewards_become_float():
    adv_NG = drgrpo_advantages(torch.tensor([[1, 0]]))
    assert adv_NG.dtype == torch.float32
    torch.testing.assert_close(adv_NG, torch.tensor([[0.5, -0.5]]))


def test_group_has_signal():
    assert group_has_signal(REWARDS_NG).tolist() == [True, False]
    assert group_has_signal(torch.tensor([[0.5, 0.5 + 1e-3]]), atol=1e-2).tolist() == [False]


def test_registry_names():
    assert ADVANTAGE_ESTIMATORS == {
        "grpo": grpo_advantages,
        "drgrpo": drgrpo_advantages,
        "rloo": rloo_advantages,
        "gae": critic_advantages,
    }


def test_gae_takes_no_advantage_from_the_group():
    assert critic_advantages(REWARDS_NG).eq(0).all()  # the critic's GAE makes them in the train phase


@pytest.mark.parametrize("fn", [grpo_advantages, drgrpo_advantages, rloo_advantages, group_has_signal])
def test_bad_shape_names_the_shape(fn):
    with pytest.raises(ValueError, match=r"shape \(4,\)"):
        fn(torch.tensor([1.0, 0.0, 0.0, 1.0]))


@pytest.mark.parametrize("fn", [grpo_advantages, rloo_advantages])
def test_group_size_one_is_rejected_where_undefined(fn):
    with pytest.raises(ValueError, match=r"group_size must be >= 2.*\(3, 1\)"):
        fn(torch.ones(3, 1))


def test_drgrpo_group_size_one_gives_zeros():
    torch.testing.assert_close(drgrpo_advantages(torch.tensor([[2.0], [5.0]])), torch.zeros(2, 1))


@pytest.mark.parametrize("name", sorted(ADVANTAGE_ESTIMATORS))
def test_advantages_of_a_group_with_skipped_rows_are_those_of_its_scored_rows_alone(name):
    estimator = ADVANTAGE_ESTIMATORS[name]
    rewards_NG = torch.tensor([[1.0, 0.0, 9.0, 1.0], [1.0, 0.0, 7.0, 7.0], [3.0, 2.0, 2.0, 5.0]])
    skipped_NG = torch.tensor([[False, False, True, False], [False, False, True, True], [True, True, True, False]])
    got = masked_group_advantages(rewards_NG, skipped_NG, estimator)
    assert torch.allclose(got[0, [0, 1, 3]], estimator(torch.tensor([[1.0, 0.0, 1.0]]))[0]) and got[0, 2] == 0
    assert torch.allclose(got[1, :2], estimator(torch.tensor([[1.0, 0.0]]))[0]) and got[1, 2:].eq(0).all()
    assert got[2].eq(0).all()  # one scored row: nothing to compare it with
    full = torch.tensor([[1.0, 0.0, 2.0, 1.0]])
    assert torch.allclose(
        masked_group_advantages(full, torch.zeros(1, 4, dtype=torch.bool), estimator), estimator(full)
    )


def test_the_signal_of_a_group_with_skipped_rows_is_that_of_its_scored_rows():
    rewards_NG = torch.tensor([[1.0, 0.0, 9.0, 1.0], [5.0, 5.0, 9.0, 5.0], [5.0, 5.0, 5.0, 5.0]])
    skipped_NG = torch.tensor([[False, False, True, False], [False, False, True, False], [True, True, True, True]])
    assert group_has_signal(rewards_NG, skipped_NG=skipped_NG).tolist() == [True, False, False]
    assert group_has_signal(rewards_NG).tolist() == [True, True, False]  # the skipped 9 would count without the mask
