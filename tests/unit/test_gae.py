"""PPO's critic-side functions (``lora_rl_core.algorithm.gae``) against hand-computed numbers."""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from lora_rl_core.algorithm.gae import explained_variance, gae_advantages, masked_whiten, token_rewards, value_loss
from lora_rl_core.algorithm.losses import LOSS_AGGREGATIONS, aggregate

NAN = float("nan")


# --- token_rewards -----------------------------------------------------------


def test_token_rewards_put_the_score_at_each_rows_last_real_token():
    mask_BT = torch.tensor([[1.0, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0], [0, 0, 0, 0]])
    rewards_BT = token_rewards(torch.tensor([1.0, 2.0, 3.0, 4.0]), mask_BT)
    assert rewards_BT.dtype == torch.float32
    expected_BT = torch.tensor([[0.0, 1, 0, 0], [0, 0, 0, 2], [3, 0, 0, 0], [0, 0, 0, 0]])  # no token: no score
    assert_close(rewards_BT, expected_BT)
    # a bool mask and integer scores give the same float32 rewards
    assert_close(token_rewards(torch.tensor([1, 2, 3, 4]), mask_BT.bool()), expected_BT)


def test_token_rewards_subtract_the_kl_on_real_tokens_only():
    mask_BT = torch.tensor([[1.0, 1, 0], [1, 1, 1], [0, 0, 0]])
    kl_BT = torch.tensor([[0.5, 1.0, NAN], [0.5, -0.5, 2.0], [9.0, 9.0, 9.0]])  # padding: NaN and 9 never leak
    rewards_BT = token_rewards(torch.tensor([1.0, 2.0, 3.0]), mask_BT, kl_BT=kl_BT, kl_coef=0.2)
    # row 0: [-0.2 * 0.5, 1 - 0.2 * 1.0, 0]; row 1: [-0.1, +0.1, 2 - 0.4]; row 2: nothing
    assert_close(rewards_BT, torch.tensor([[-0.1, 0.8, 0.0], [-0.1, 0.1, 1.6], [0.0, 0.0, 0.0]]))
    # kl_coef 0 (the default): the KL is ignored
    assert_close(
        token_rewards(torch.tensor([1.0, 2.0, 3.0]), mask_BT, kl_BT=kl_BT),
        token_rewards(torch.tensor([1.0, 2.0, 3.0]), mask_BT),
    )


# --- gae_advantages ----------------------------------------------------------


def test_gae_against_a_hand_computed_case():
    # gamma 0.9, lam 0.8 (gamma * lam = 0.72); V and A after a row's last real token are 0 (no bootstrap)
    # row 0: rewards [0, 0, 1], values [0.5, 0.6, 0.7]
    #   delta2 = 1 + 0.9 * 0   - 0.7 = 0.3      A2 = 0.3
    #   delta1 = 0 + 0.9 * 0.7 - 0.6 = 0.03     A1 = 0.03 + 0.72 * 0.3   = 0.246
    #   delta0 = 0 + 0.9 * 0.6 - 0.5 = 0.04     A0 = 0.04 + 0.72 * 0.246 = 0.21712
    #   returns = A + V = [0.71712, 0.846, 1.0]
    # row 1: 2 real tokens then padding, rewards [0, -1, pad], values [0.2, 0.4, pad = 9.0]
    #   delta1 = -1 + 0.9 * 0   - 0.4 = -1.4    A1 = -1.4
    #   delta0 =  0 + 0.9 * 0.4 - 0.2 = 0.16    A0 = 0.16 + 0.72 * (-1.4) = -0.848
    #   returns = [-0.648, -1.0, 0]
    mask_BT = torch.tensor([[1.0, 1, 1], [1, 1, 0]])
    rewards_BT = token_rewards(torch.tensor([1.0, -1.0]), mask_BT)
    assert_close(rewards_BT, torch.tensor([[0.0, 0, 1], [0, -1, 0]]))
    values_BT = torch.tensor([[0.5, 0.6, 0.7], [0.2, 0.4, 9.0]])
    advantages_BT, returns_BT = gae_advantages(rewards_BT, values_BT, mask_BT, gamma=0.9, lam=0.8)
    assert advantages_BT.dtype == returns_BT.dtype == torch.float32
    assert_close(advantages_BT, torch.tensor([[0.21712, 0.246, 0.3], [-0.848, -1.4, 0.0]]))
    assert_close(returns_BT, torch.tensor([[0.71712, 0.846, 1.0], [-0.648, -1.0, 0.0]]))


def test_padding_does_not_leak_even_when_it_is_nan():
    mask_BT = torch.tensor([[1.0, 1, 0, 0]])
    rewards_BT = torch.tensor([[0.0, 1.0, NAN, math.inf]])
    values_BT = torch.tensor([[0.2, 0.4, NAN, -math.inf]])
    advantages_BT, returns_BT = gae_advantages(rewards_BT, values_BT, mask_BT, gamma=0.9, lam=0.8)
    # delta1 = 1 - 0.4 = 0.6; A0 = (0.9 * 0.4 - 0.2) + 0.72 * 0.6 = 0.16 + 0.432 = 0.592
    assert_close(advantages_BT, torch.tensor([[0.592, 0.6, 0.0, 0.0]]))
    assert_close(returns_BT, torch.tensor([[0.792, 1.0, 0.0, 0.0]]))


def test_gamma_and_lambda_one_give_the_score_minus_the_value():
    mask_BT = torch.tensor([[1.0, 1, 1, 1], [1, 1, 0, 0]])
    values_BT = torch.tensor([[0.1, 0.2, 0.3, 0.4], [-0.5, 0.5, 7.0, 7.0]])
    scores_B = torch.tensor([2.0, -1.0])
    advantages_BT, returns_BT = gae_advantages(token_rewards(scores_B, mask_BT), values_BT, mask_BT, gamma=1.0, lam=1.0)
    assert_close(advantages_BT, (scores_B[:, None] - values_BT) * mask_BT)
    assert_close(returns_BT, scores_B[:, None] * mask_BT)  # the score at every real token


def test_lambda_zero_gives_one_step_td_errors():
    mask_BT = torch.ones(1, 3)
    rewards_BT = torch.tensor([[0.1, 0.2, 1.0]])
    values_BT = torch.tensor([[0.5, 0.6, 0.7]])
    advantages_BT, _ = gae_advantages(rewards_BT, values_BT, mask_BT, gamma=0.5, lam=0.0)
    # delta_t = r_t + 0.5 * V_{t+1} - V_t: [0.1 + 0.3 - 0.5, 0.2 + 0.35 - 0.6, 1.0 - 0.7]
    assert_close(advantages_BT, torch.tensor([[-0.1, -0.05, 0.3]]))


def test_a_padded_batch_equals_its_rows_alone():
    gen = torch.Generator().manual_seed(0)
    lengths = [6, 2, 0, 4, 1]
    width = max(lengths)
    mask_BT = torch.tensor([[1.0] * n + [0.0] * (width - n) for n in lengths])
    values_BT = torch.randn(len(lengths), width, generator=gen)
    kl_BT = torch.rand(len(lengths), width, generator=gen)
    rewards_BT = token_rewards(torch.randn(len(lengths), generator=gen), mask_BT, kl_BT=kl_BT, kl_coef=0.1)
    advantages_BT, returns_BT = gae_advantages(rewards_BT, values_BT, mask_BT, gamma=0.95, lam=0.9)
    for j, n in enumerate(lengths):
        alone_a, alone_r = gae_advantages(
            rewards_BT[j : j + 1, :n], values_BT[j : j + 1, :n], torch.ones(1, n), gamma=0.95, lam=0.9
        )
        assert_close(advantages_BT[j : j + 1, :n], alone_a)
        assert_close(returns_BT[j : j + 1, :n], alone_r)
        assert not advantages_BT[j, n:].any() and not returns_BT[j, n:].any()


def test_gae_carries_no_gradient():
    values_BT = torch.tensor([[0.5, 0.6]], requires_grad=True)
    advantages_BT, returns_BT = gae_advantages(torch.ones(1, 2), values_BT, torch.ones(1, 2), gamma=1.0, lam=1.0)
    assert not advantages_BT.requires_grad and not returns_BT.requires_grad


# --- masked_whiten -----------------------------------------------------------


def test_masked_whiten_over_real_tokens_only():
    mask_BT = torch.tensor([[1.0, 1, 1, 0], [1, 1, 0, 0]])
    x_BT = torch.tensor([[1.0, 2, 3, 100], [4, 5, NAN, 7]])
    out_BT = masked_whiten(x_BT, mask_BT)
    # real tokens 1..5: mean 3, unbiased variance 10 / 4 = 2.5
    scale = 1 / math.sqrt(2.5 + 1e-8)
    assert_close(out_BT, torch.tensor([[-2 * scale, -scale, 0, 0], [scale, 2 * scale, 0, 0]]))
    real = out_BT[mask_BT.bool()]
    assert float(real.mean()) == pytest.approx(0.0, abs=1e-6)
    assert float(real.var(correction=1)) == pytest.approx(1.0, rel=1e-5)
    assert not out_BT[~mask_BT.bool()].any()  # padding stays 0 (NaN included)


def test_masked_whiten_without_shifting_keeps_the_mean():
    mask_BT = torch.tensor([[1.0, 1, 1, 0], [1, 1, 0, 0]])
    x_BT = torch.tensor([[1.0, 2, 3, 100], [4, 5, -100, 7]])
    out_BT = masked_whiten(x_BT, mask_BT, shift_mean=False)
    real = out_BT[mask_BT.bool()]
    assert float(real.mean()) == pytest.approx(3.0, rel=1e-6)  # the mean of 1..5 put back
    assert float(real.var(correction=1)) == pytest.approx(1.0, rel=1e-5)
    assert not out_BT[~mask_BT.bool()].any()


def test_masked_whiten_with_fewer_than_two_tokens_centres_without_nan():
    one_BT = masked_whiten(torch.tensor([[4.0, 9.0]]), torch.tensor([[1.0, 0]]))
    assert_close(one_BT, torch.zeros(1, 2))  # centred: 4 - 4
    assert_close(
        masked_whiten(torch.tensor([[4.0, 9.0]]), torch.tensor([[1.0, 0]]), shift_mean=False),
        torch.tensor([[4.0, 0.0]]),
    )
    assert_close(masked_whiten(torch.tensor([[4.0, 9.0]]), torch.zeros(1, 2)), torch.zeros(1, 2))  # no real token
    constant_BT = masked_whiten(torch.full((2, 3), 5.0), torch.ones(2, 3), eps=0.0)  # no variance, no eps
    assert_close(constant_BT, torch.zeros(2, 3))


def test_masked_whiten_scales_by_the_scale_mask_about_every_real_token_mean():
    """The mean over every real token, the scale from the `scale_mask_BT` tokens' spread about it: one row of
    2 tokens at 1 among two rows of 3 tokens at 0 (the critic's cut rows) comes out at 1/sqrt(2), not 1.62."""
    mask_BT = torch.tensor([[1.0, 1, 0], [1, 1, 1], [1, 1, 1]])
    x_BT = torch.tensor([[1.0, 1, 50], [0, 0, 0], [0, 0, 0]])
    scale_BT = torch.tensor([[1.0, 1, 1], [0, 0, 0], [0, 0, 0]])  # its padding does not count
    out_BT = masked_whiten(x_BT, mask_BT, scale_mask_BT=scale_BT)
    # mean 2 / 8 = 0.25; the first row's spread about it: 2 x 0.75^2 / (2 - 1) = 1.125
    scale = 1 / math.sqrt(1.125 + 1e-8)
    assert_close(out_BT, torch.tensor([[0.75 * scale] * 2 + [0.0], [-0.25 * scale] * 3, [-0.25 * scale] * 3]))
    assert 0.75 * scale == pytest.approx(1 / math.sqrt(2), rel=1e-6)
    # over every token (no scale mask): variance (1.125 + 6 x 0.0625) / 7 = 3 / 14, the row at 0.75 / sqrt(3 / 14)
    assert float(masked_whiten(x_BT, mask_BT)[0, 0]) == pytest.approx(0.75 / math.sqrt(3 / 14), rel=1e-6)
    assert_close(masked_whiten(x_BT, mask_BT, scale_mask_BT=mask_BT), masked_whiten(x_BT, mask_BT))
    assert_close(  # fewer than 2 scale tokens: centred, not scaled
        masked_whiten(x_BT, mask_BT, scale_mask_BT=torch.tensor([[1.0, 0, 0], [0, 0, 0], [0, 0, 0]])),
        torch.where(mask_BT > 0, x_BT - 0.25, 0.0),
    )


# --- value_loss --------------------------------------------------------------


def test_value_loss_unclipped_is_half_the_mean_squared_error():
    mask_BT = torch.tensor([[1.0, 1, 0], [1, 0, 0]])
    values_BT = torch.tensor([[0.5, 1.0, NAN], [2.0, 3.0, 3.0]], requires_grad=True)
    returns_BT = torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    loss, metrics = value_loss(
        values_BT, torch.zeros(2, 3), returns_BT, mask_BT, value_clip=None, aggregation="token-mean"
    )
    # squared errors 0.25, 1, 4 on the 3 real tokens
    assert float(loss.detach()) == pytest.approx(0.5 * (0.25 + 1.0 + 4.0) / 3)
    assert float(metrics["value_loss"]) == pytest.approx(float(loss.detach()))
    assert float(metrics["value_clip_fraction"]) == 0.0
    assert float(metrics["value_mean"]) == pytest.approx((0.5 + 1.0 + 2.0) / 3)
    assert all(m.dim() == 0 and m.dtype == torch.float32 and not m.requires_grad for m in metrics.values())
    loss.backward()
    assert values_BT.grad is not None
    # d/dv 0.5 * (v - R)^2 / 3 = (v - R) / 3 on real tokens; exactly 0 on padding (its NaN included)
    assert_close(values_BT.grad, torch.tensor([[-0.5 / 3, 1.0 / 3, 0.0], [2.0 / 3, 0.0, 0.0]]))


@pytest.mark.parametrize("aggregation", LOSS_AGGREGATIONS)
def test_value_loss_reduces_with_the_policy_losss_aggregation(aggregation):
    gen = torch.Generator().manual_seed(1)
    mask_BT = torch.tensor([[1.0, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]])
    values_BT, returns_BT = torch.randn(3, 4, generator=gen), torch.randn(3, 4, generator=gen)
    loss, _ = value_loss(values_BT, values_BT, returns_BT, mask_BT, value_clip=None, aggregation=aggregation)
    assert_close(loss, aggregate(0.5 * (values_BT - returns_BT) ** 2, mask_BT, aggregation))


def test_value_loss_clip_by_hand():
    # old values 0, value_clip 0.2, so v_clipped = clamp(v, -0.2, 0.2)
    # token 0: v 1.0, R 1: error (1 - 1)^2 = 0, clipped (0.2 - 1)^2 = 0.64 -> max 0.64, the clip is active
    # token 1: v 0.1 (inside the clip), R 0: both 0.01 -> 0.01, not strictly larger: not active
    # token 2: v -1.0, R 1: error (-1 - 1)^2 = 4, clipped (-0.2 - 1)^2 = 1.44 -> 4, not active
    # loss = 0.5 * (0.64 + 0.01 + 4) / 3 = 0.775; clip fraction 1 / 3
    mask_BT = torch.tensor([[1.0, 1, 1, 0]])
    values_BT = torch.tensor([[1.0, 0.1, -1.0, 5.0]], requires_grad=True)
    returns_BT = torch.tensor([[1.0, 0.0, 1.0, 0.0]])
    loss, metrics = value_loss(
        values_BT, torch.zeros(1, 4), returns_BT, mask_BT, value_clip=0.2, aggregation="token-mean"
    )
    assert float(loss.detach()) == pytest.approx(0.775)
    assert float(metrics["value_clip_fraction"]) == pytest.approx(1 / 3)
    assert float(metrics["value_mean"]) == pytest.approx(0.1 / 3)
    loss.backward()
    # token 0: the clipped (constant) term wins, no gradient; tokens 1, 2: (v - R) / 3; padding: 0
    assert_close(values_BT.grad, torch.tensor([[0.0, 0.1 / 3, -2.0 / 3, 0.0]]))


def test_value_loss_bf16_values_give_a_float32_loss():
    values_BT = torch.tensor([[0.5, 1.5]], dtype=torch.bfloat16, requires_grad=True)
    loss, _ = value_loss(
        values_BT, values_BT.detach(), torch.ones(1, 2), torch.ones(1, 2), value_clip=0.2, aggregation="token-mean"
    )
    assert loss.dtype == torch.float32 and float(loss.detach()) == pytest.approx(0.5 * 0.25)
    loss.backward()
    assert values_BT.grad is not None and values_BT.grad.dtype == torch.bfloat16


# --- explained_variance ------------------------------------------------------


def test_explained_variance():
    mask_BT = torch.tensor([[1.0, 1, 1, 0]])
    returns_BT = torch.tensor([[1.0, 2.0, 3.0, 50.0]])
    perfect = explained_variance(returns_BT, returns_BT, mask_BT)
    assert perfect.dim() == 0 and perfect.dtype == torch.float32 and float(perfect) == pytest.approx(1.0)
    # the constant mean of the returns explains nothing: Var[R - 2] = Var[R]
    assert float(explained_variance(torch.full((1, 4), 2.0), returns_BT, mask_BT)) == pytest.approx(0.0, abs=1e-6)
    # by hand: R - V = [0, 0, 1], Var = 2/9; Var[R] = 2/3 -> 1 - 1/3 (padding's 50 and NaN ignored)
    values_BT = torch.tensor([[1.0, 2.0, 2.0, NAN]])
    assert float(explained_variance(values_BT, returns_BT, mask_BT)) == pytest.approx(2 / 3)


def test_explained_variance_of_constant_returns_is_zero_not_nan():
    assert float(explained_variance(torch.zeros(1, 4), torch.ones(1, 4), torch.ones(1, 4))) == 0.0
    assert float(explained_variance(torch.randn(2, 3), torch.full((2, 3), 0.7), torch.ones(2, 3))) == 0.0
    assert float(explained_variance(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 3))) == 0.0
    assert float(explained_variance(torch.zeros(1, 3), torch.ones(1, 3), torch.zeros(1, 3))) == 0.0  # no token


# --- refused arguments -------------------------------------------------------


def _zeros(*shape: int) -> torch.Tensor:
    return torch.zeros(*shape)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: gae_advantages(_zeros(1, 2), _zeros(1, 2), torch.ones(1, 2), gamma=1.5, lam=1.0), "gamma"),
        (lambda: gae_advantages(_zeros(1, 2), _zeros(1, 2), torch.ones(1, 2), gamma=1.0, lam=-0.1), "lam"),
        (lambda: gae_advantages(_zeros(1, 2), _zeros(1, 2), torch.ones(1, 2), gamma=NAN, lam=1.0), "gamma"),
        (lambda: gae_advantages(_zeros(1, 3), _zeros(1, 2), torch.ones(1, 2), gamma=1.0, lam=1.0), "rewards_BT"),
        (lambda: gae_advantages(_zeros(1, 2), _zeros(2, 2), torch.ones(1, 2), gamma=1.0, lam=1.0), "values_BT"),
        (lambda: gae_advantages(_zeros(2), _zeros(2), torch.ones(2), gamma=1.0, lam=1.0), "2-D"),
        (
            lambda: value_loss(
                _zeros(1, 2), _zeros(1, 2), _zeros(1, 2), torch.ones(1, 2), value_clip=0, aggregation="token-mean"
            ),
            "value_clip",
        ),
        (
            lambda: value_loss(
                _zeros(1, 2), _zeros(1, 2), _zeros(1, 2), torch.ones(1, 2), value_clip=-0.2, aggregation="token-mean"
            ),
            "value_clip",
        ),
        (
            lambda: value_loss(
                _zeros(1, 2), _zeros(1, 3), _zeros(1, 2), torch.ones(1, 2), value_clip=0.2, aggregation="token-mean"
            ),
            "old_values_BT",
        ),
        (
            lambda: value_loss(
                _zeros(1, 2), _zeros(1, 2), _zeros(1, 2), torch.ones(1, 2), value_clip=None, aggregation="sum"
            ),
            "aggregation",
        ),
        (lambda: token_rewards(_zeros(2), torch.ones(1, 2)), "scores_B"),
        (lambda: token_rewards(_zeros(1), torch.ones(1, 2), kl_BT=_zeros(1, 3), kl_coef=0.1), "kl_BT"),
        (lambda: token_rewards(_zeros(1), torch.ones(1, 2), kl_BT=_zeros(1, 2), kl_coef=-0.1), "kl_coef"),
        (lambda: masked_whiten(_zeros(1, 3), torch.ones(1, 2)), "values_BT"),
        (lambda: masked_whiten(_zeros(1, 2), torch.ones(1, 2), eps=-1.0), "eps"),
        (lambda: masked_whiten(_zeros(1, 2), torch.ones(1, 2), scale_mask_BT=torch.ones(1, 3)), "scale_mask_BT"),
        (lambda: explained_variance(_zeros(1, 2), _zeros(2, 2), torch.ones(1, 2)), "returns_BT"),
    ],
)
def test_bad_arguments_are_refused(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_explained_variance_of_returns_equal_up_to_rounding_is_zero():
    # zero rewards: returns A + V differ from 0 only by rounding; a GPU run reported -2.7e15 before the floor
    values = torch.tensor([[0.3, 0.7, 0.1]])
    returns = torch.tensor([[1e-9, -1e-9, 2e-9]])
    assert float(explained_variance(values, returns, torch.ones(1, 3))) == 0.0


def test_a_completion_that_starts_later_in_its_row_gets_the_same_advantages():
    """The trainer's packed frame puts each completion after its prompt (leading zeros in the mask): the
    masked recursion and the last-token reward give what the completion alone gives."""
    values = torch.tensor([[0.5, 0.6, 0.7]])
    alone_a, alone_r = gae_advantages(
        token_rewards(torch.tensor([1.0]), torch.ones(1, 3)), values, torch.ones(1, 3), gamma=0.9, lam=0.8
    )
    mask = torch.tensor([[0.0, 0.0, 1.0, 1.0, 1.0, 0.0]])
    shifted = torch.tensor([[9.0, 9.0, 0.5, 0.6, 0.7, 9.0]])
    a, r = gae_advantages(token_rewards(torch.tensor([1.0]), mask), shifted, mask, gamma=0.9, lam=0.8)
    torch.testing.assert_close(a[:, 2:5], alone_a)
    torch.testing.assert_close(r[:, 2:5], alone_r)
    assert not a[:, [0, 1, 5]].any() and not r[:, [0, 1, 5]].any()
