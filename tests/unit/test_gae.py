"""PPO's pure functions (`lora_rl_core.algorithm.gae`) against hand-computed cases."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from lora_rl_core.algorithm.gae import explained_variance, gae_advantages, masked_whiten, token_rewards, value_loss


def test_gae_against_a_hand_computed_case():
    # one row of 3 tokens, reward 1 at the end; gamma 0.9, lam 0.8; V after the last token is 0
    # delta2 = 1 + 0.9*0 - 0.7 = 0.3                    A2 = 0.3
    # delta1 = 0 + 0.9*0.7 - 0.6 = 0.03                  A1 = 0.03 + 0.72*0.3 = 0.246
    # delta0 = 0 + 0.9*0.6 - 0.5 = 0.04                  A0 = 0.04 + 0.72*0.246 = 0.21712
    # second row: 2 real tokens, reward -1, values 0.2 0.4, padding after
    # delta1 = -1 - 0.4 = -1.4                           A1 = -1.4
    # delta0 = 0 + 0.9*0.4 - 0.2 = 0.16                  A0 = 0.16 + 0.72*(-1.4) = -0.848
    mask = torch.tensor([[1.0, 1, 1], [1, 1, 0]])
    rewards = token_rewards(torch.tensor([1.0, -1.0]), mask)
    assert_close(rewards, torch.tensor([[0.0, 0, 1], [0, -1, 0]]))
    values = torch.tensor([[0.5, 0.6, 0.7], [0.2, 0.4, 9.0]])  # 9.0 on padding must not leak
    advantages, returns = gae_advantages(rewards, values, mask, gamma=0.9, lam=0.8)
    assert_close(advantages, torch.tensor([[0.21712, 0.246, 0.3], [-0.848, -1.4, 0.0]]))
    assert_close(returns, advantages + values * mask)


def test_gamma_and_lambda_one_give_the_score_minus_the_value():
    mask = torch.tensor([[1.0, 1, 1, 1]])
    values = torch.tensor([[0.1, 0.2, 0.3, 0.4]])
    advantages, returns = gae_advantages(token_rewards(torch.tensor([2.0]), mask), values, mask, gamma=1.0, lam=1.0)
    assert_close(advantages, 2.0 - values)
    assert_close(returns, torch.full((1, 4), 2.0))


def test_a_padded_batch_equals_its_rows_alone():
    g = torch.Generator().manual_seed(0)
    lengths = [5, 2, 4]
    mask = torch.tensor([[1.0] * n + [0.0] * (5 - n) for n in lengths])
    values = torch.randn(3, 5, generator=g)
    rewards = token_rewards(torch.randn(3, generator=g), mask, kl_BT=torch.rand(3, 5, generator=g), kl_coef=0.1)
    advantages, returns = gae_advantages(rewards, values, mask, gamma=0.95, lam=0.9)
    for j, n in enumerate(lengths):
        one_a, one_r = gae_advantages(
            rewards[j : j + 1, :n], values[j : j + 1, :n], mask[j : j + 1, :n], gamma=0.95, lam=0.9
        )
        assert_close(advantages[j : j + 1, :n], one_a)
        assert_close(returns[j : j + 1, :n], one_r)
        assert not advantages[j, n:].any() and not returns[j, n:].any()


def test_token_rewards_put_the_score_last_and_the_kl_on_real_tokens():
    mask = torch.tensor([[1.0, 1, 0], [1, 1, 1], [0, 0, 0]])
    kl = torch.full((3, 3), 0.5)
    got = token_rewards(torch.tensor([1.0, 2.0, 3.0]), mask, kl_BT=kl, kl_coef=0.2)
    assert_close(got, torch.tensor([[-0.1, 0.9, 0.0], [-0.1, -0.1, 1.9], [0.0, 0.0, 0.0]]))


def test_masked_whiten_over_real_tokens_only():
    mask = torch.tensor([[1.0, 1, 1, 0], [1, 1, 0, 0]])
    x = torch.tensor([[1.0, 2, 3, 100], [4, 5, -100, 7]])
    out = masked_whiten(x, mask)
    real = out[mask.bool()]
    assert float(real.mean()) == pytest.approx(0.0, abs=1e-6)
    assert float(real.var(unbiased=True)) == pytest.approx(1.0, rel=1e-5)
    assert not out[~mask.bool()].any()
    kept = masked_whiten(x, mask, shift_mean=False)[mask.bool()]
    assert float(kept.mean()) == pytest.approx(3.0, rel=1e-5)  # the mean of 1..5 put back
    assert_close(masked_whiten(torch.tensor([[4.0, 0]]), torch.tensor([[1.0, 0]])), torch.zeros(1, 2))  # no NaN


def test_value_loss_unclipped_is_half_the_squared_error():
    mask = torch.tensor([[1.0, 1, 0]])
    values = torch.tensor([[0.5, 1.0, 3.0]], requires_grad=True)
    returns = torch.tensor([[1.0, 0.0, 0.0]])
    loss, m = value_loss(values, values.detach(), returns, mask, value_clip=None, aggregation="token-mean")
    assert float(loss.detach()) == pytest.approx(0.5 * (0.25 + 1.0) / 2)
    assert float(m["value_clip_fraction"]) == 0.0 and float(m["value_mean"]) == pytest.approx(0.75)
    loss.backward()
    assert_close(values.grad, torch.tensor([[-0.25, 0.5, 0.0]]))  # (v - R) / 2 tokens; none on padding


def test_value_loss_clip_by_hand():
    # token 0: v moved 0 -> 1 (clip 0.2 keeps 0.2), R = 1: unclipped error 0, clipped 0.64 -> 0.5 * 0.64, clip acts
    # token 1: v moved 0 -> 0.1 (inside the clip), R = 0: both errors 0.01 -> 0.5 * 0.01, clip does not act
    mask = torch.ones(1, 2)
    values = torch.tensor([[1.0, 0.1]], requires_grad=True)
    loss, m = value_loss(
        values, torch.zeros(1, 2), torch.tensor([[1.0, 0.0]]), mask, value_clip=0.2, aggregation="token-mean"
    )
    assert float(loss.detach()) == pytest.approx(0.5 * (0.64 + 0.01) / 2)
    assert float(m["value_clip_fraction"]) == pytest.approx(0.5)
    loss.backward()
    assert values.grad is not None and float(values.grad[0, 0]) == 0.0  # the clipped term has no gradient


def test_explained_variance():
    mask = torch.tensor([[1.0, 1, 1, 0]])
    returns = torch.tensor([[1.0, 2.0, 3.0, 50.0]])
    assert float(explained_variance(returns, returns, mask)) == pytest.approx(1.0)
    assert float(explained_variance(torch.full((1, 4), 2.0), returns, mask)) == pytest.approx(0.0, abs=1e-6)
    assert float(explained_variance(torch.zeros(1, 4), torch.ones(1, 4), torch.ones(1, 4))) == 0.0  # no NaN


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: gae_advantages(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2), gamma=1.5, lam=1.0), "gamma"),
        (lambda: gae_advantages(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2), gamma=1.0, lam=-0.1), "lam"),
        (lambda: gae_advantages(torch.zeros(1, 3), torch.zeros(1, 2), torch.ones(1, 2), gamma=1.0, lam=1.0), "shape"),
        (
            lambda: value_loss(
                torch.zeros(1, 2),
                torch.zeros(1, 2),
                torch.zeros(1, 2),
                torch.ones(1, 2),
                value_clip=0,
                aggregation="token-mean",
            ),
            "value_clip",
        ),
        (lambda: token_rewards(torch.zeros(2), torch.ones(1, 2)), "scores_B"),
    ],
)
def test_bad_arguments_are_refused(call, message):
    with pytest.raises(ValueError, match=message):
        call()
