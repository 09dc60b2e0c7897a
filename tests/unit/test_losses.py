"""Losses against hand-computed numbers."""

from __future__ import annotations

import math

import pytest
import torch
from pydantic import ValidationError

from lora_rl_core.algorithm import (
    LOSS_AGGREGATIONS,
    aggregate,
    kl_k3,
    off_policy_weights,
    ppo_clip_loss,
    token_logprobs,
    token_logprobs_and_entropy,
)
from lora_rl_core.config import AlgorithmConfig

LOG_1_5 = math.log(1.5)
LOG_0_5 = math.log(0.5)
# symmetric, so the hand values read 0.8 and 1.2; token-mean, no KL unless a test says
CLIP = {"clip_eps_low": 0.2, "clip_eps_high": 0.2, "aggregation": "token-mean", "kl_coef": 0.0}


def _ppo(logprobs, old_logprobs, advantages, mask, **kwargs):
    return ppo_clip_loss(
        torch.tensor(logprobs),
        torch.tensor(old_logprobs),
        torch.tensor(advantages),
        torch.tensor(mask),
        **{**CLIP, **kwargs},
    )


# --- log-probs and entropy ---------------------------------------------------


def test_token_logprobs_hand_value():
    # softmax([0, ln 3]) = [0.25, 0.75]
    logits_BTV = torch.tensor([[[0.0, math.log(3.0)], [0.0, math.log(3.0)]]])
    logp_BT = token_logprobs(logits_BTV, torch.tensor([[1, 0]]))
    torch.testing.assert_close(logp_BT, torch.tensor([[-0.2876821, -1.3862944]]))


def test_token_logprobs_matches_log_softmax_gather():
    gen = torch.Generator().manual_seed(0)
    logits_BTV = torch.randn(3, 5, 11, generator=gen) * 4
    ids_BT = torch.randint(0, 11, (3, 5), generator=gen)
    expected_BT = torch.log_softmax(logits_BTV, dim=-1).gather(-1, ids_BT.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(token_logprobs(logits_BTV, ids_BT), expected_BT)
    # bf16 logits: float32 result, equal to the float32 computation on the same (rounded) logits
    bf16_BTV = logits_BTV.bfloat16()
    out_BT = token_logprobs(bf16_BTV, ids_BT)
    assert out_BT.dtype == torch.float32
    expected_bf16_BT = torch.log_softmax(bf16_BTV.float(), dim=-1).gather(-1, ids_BT.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(out_BT, expected_bf16_BT)


def test_token_logprobs_gradient_matches_log_softmax():
    logits_a = torch.randn(2, 3, 7, generator=torch.Generator().manual_seed(1), requires_grad=True)
    logits_b = logits_a.detach().clone().requires_grad_(True)
    ids_BT = torch.tensor([[0, 6, 3], [2, 2, 5]])
    token_logprobs(logits_a, ids_BT).sum().backward()
    torch.log_softmax(logits_b, -1).gather(-1, ids_BT.unsqueeze(-1)).sum().backward()
    torch.testing.assert_close(logits_a.grad, logits_b.grad)


def test_token_logprobs_bad_ids_shape():
    with pytest.raises(ValueError, match=r"token_ids_BT has shape \(2, 3\)"):
        token_logprobs(torch.zeros(1, 3, 4), torch.zeros(2, 3, dtype=torch.long))


def _entropy(logits_BTV: torch.Tensor) -> torch.Tensor:
    return token_logprobs_and_entropy(logits_BTV, torch.zeros(logits_BTV.shape[:2], dtype=torch.long))[1]


def test_entropy_uniform_and_two_point():
    entropy_BT = _entropy(torch.zeros(2, 3, 4, dtype=torch.bfloat16))
    assert entropy_BT.dtype == torch.float32
    torch.testing.assert_close(entropy_BT, torch.full((2, 3), 1.3862944))  # log 4
    # p = [0.25, 0.75]: -(0.25 ln 0.25 + 0.75 ln 0.75) = 0.5623351
    two_point = _entropy(torch.tensor([[[0.0, math.log(3.0)]]]))
    torch.testing.assert_close(two_point, torch.tensor([[0.5623351]]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_logprobs_and_gradient_match_autograd_of_log_softmax(dtype, temperature):
    """The written-out backward equals autograd through log_softmax / temperature, on float32 and bf16 logits,
    and leaves the logits as they were."""
    gen = torch.Generator().manual_seed(2)
    logits = (torch.randn(3, 5, 11, generator=gen) * 4).to(dtype)
    ids_BT = torch.randint(0, 11, (3, 5), generator=gen)
    weights_BT = torch.randn(3, 5, generator=gen)
    ours_in = logits.clone().requires_grad_(True)
    ref_in = logits.clone().requires_grad_(True)
    logprobs_BT, entropy_BT = token_logprobs_and_entropy(ours_in, ids_BT, temperature=temperature)
    (logprobs_BT * weights_BT).sum().backward()
    ref_logp_BTV = torch.log_softmax(ref_in.float() / temperature, dim=-1)
    ref_BT = ref_logp_BTV.gather(-1, ids_BT.unsqueeze(-1)).squeeze(-1)
    (ref_BT * weights_BT).sum().backward()
    torch.testing.assert_close(logprobs_BT, ref_BT.detach())
    torch.testing.assert_close(entropy_BT, -(ref_logp_BTV.exp() * ref_logp_BTV).sum(-1).detach())
    assert ours_in.grad is not None and ours_in.grad.dtype == dtype
    torch.testing.assert_close(ours_in.grad, ref_in.grad)
    torch.testing.assert_close(ours_in.detach(), logits, rtol=0, atol=0)  # not changed in place


# --- aggregation ---------------------------------------------------------------

# Sequence lengths 1 and 3; padding holds NaN / inf, which must not leak.
RAGGED_VALUES_BT = torch.tensor([[2.0, float("nan"), float("inf")], [1.0, 1.0, 7.0]])
RAGGED_MASK_BT = torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 1.0]])


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", 2.75),  # (2 + 1 + 1 + 7) / 4
        ("seq-mean-token-sum", 5.5),  # (2 + 9) / 2
        ("seq-mean-token-mean", 2.5),  # (2 / 1 + 9 / 3) / 2
    ],
)
def test_aggregate_ragged(mode, expected):
    assert aggregate(RAGGED_VALUES_BT, RAGGED_MASK_BT, mode).item() == pytest.approx(expected)


def test_aggregate_skips_all_padding_rows():
    values_BT = torch.tensor([[1.0, 3.0, 0.0], [5.0, 5.0, 5.0]])
    mask_BT = torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    assert aggregate(values_BT, mask_BT, "token-mean").item() == pytest.approx(2.0)
    assert aggregate(values_BT, mask_BT, "seq-mean-token-sum").item() == pytest.approx(4.0)
    assert aggregate(values_BT, mask_BT, "seq-mean-token-mean").item() == pytest.approx(2.0)


@pytest.mark.parametrize("mode", LOSS_AGGREGATIONS)
def test_aggregate_empty_mask_is_zero(mode):
    out = aggregate(torch.ones(2, 3), torch.zeros(2, 3), mode)
    assert out.item() == 0.0


def test_aggregate_unknown_mode_lists_valid_modes():
    # the modes aggregate takes are exactly the config's (LOSS_AGGREGATIONS, algorithm.loss_aggregation)
    with pytest.raises(ValueError, match=r"valid modes: token-mean, seq-mean-token-sum, seq-mean-token-mean$"):
        aggregate(torch.ones(1, 2), torch.ones(1, 2), "seq-mean-token-sum-norm")


def test_aggregate_shape_mismatch():
    with pytest.raises(ValueError, match=r"values_BT has shape \(2, 2\), expected \(2, 3\)"):
        aggregate(torch.ones(2, 2), torch.ones(2, 3), "token-mean")


# --- KL -------------------------------------------------------------------------


def test_kl_k3_hand_values():
    logprobs_BT = torch.tensor([[0.0, LOG_0_5, -1.0]])
    ref_BT = torch.tensor([[LOG_0_5, 0.0, -1.0]])
    # 0.5 - ln 0.5 - 1 = 0.1931472; 2 - ln 2 - 1 = 0.3068528; equal -> 0
    torch.testing.assert_close(kl_k3(logprobs_BT, ref_BT), torch.tensor([[0.1931472, 0.3068528, 0.0]]))


def test_kl_k3_stays_finite_for_huge_log_ratio():
    kl_BT = kl_k3(torch.tensor([[-200.0]]), torch.tensor([[0.0]]))
    assert torch.isfinite(kl_BT).all()


# --- PPO clip loss ----------------------------------------------------------------


def test_ratio_one_gives_minus_mean_advantage():
    # ratio = 1 everywhere; token-mean over 4 real tokens of -A: -(1 + 1 + 1 - 2) / 4
    logp = [[-1.0, -2.0, -0.5], [-0.3, -9.0, -9.0]]
    loss, metrics = _ppo(logp, logp, [1.0, -2.0], [[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    assert loss.item() == pytest.approx(-0.25)
    assert metrics == pytest.approx(
        {"clip_fraction": 0.0, "ratio_mean": 1.0, "ratio_max": 1.0, "kl": 0.0, "pg_loss": -0.25}
    )


def test_positive_advantage_clipped_above():
    # token 0: ratio 1.5 > 1.2, A = 1 -> -min(1.5, 1.2) = -1.2 (clipped); token 1: ratio 1 -> -1
    loss, metrics = _ppo([[LOG_1_5, 0.0]], [[0.0, 0.0]], [1.0], [[1.0, 1.0]])
    assert loss.item() == pytest.approx(-1.1)  # (-1.2 - 1.0) / 2
    assert metrics["clip_fraction"] == pytest.approx(0.5)
    assert metrics["ratio_mean"] == pytest.approx(1.25)
    assert metrics["ratio_max"] == pytest.approx(1.5)


def test_clip_higher_is_asymmetric():
    # clip_eps_high = 0.28: -min(1.5, 1.28) = -1.28
    loss, metrics = _ppo([[LOG_1_5]], [[0.0]], [1.0], [[1.0]], clip_eps_high=0.28)
    assert loss.item() == pytest.approx(-1.28)
    assert metrics["clip_fraction"] == 1.0


def test_negative_advantage_clipped_below():
    # ratio 0.5 < 0.8, A = -1: -min(-0.5, -0.8) = 0.8 (clipped)
    loss, metrics = _ppo([[LOG_0_5]], [[0.0]], [-1.0], [[1.0]])
    assert loss.item() == pytest.approx(0.8)
    assert metrics["clip_fraction"] == 1.0


def test_clip_is_pessimistic_only():
    # ratio 1.5, A = -1: -min(-1.5, -1.2) = 1.5; ratio 0.5, A = 1: -min(0.5, 0.8) = -0.5; neither clipped
    loss, metrics = _ppo([[LOG_1_5], [LOG_0_5]], [[0.0], [0.0]], [-1.0, 1.0], [[1.0], [1.0]])
    assert loss.item() == pytest.approx(0.5)  # (1.5 - 0.5) / 2
    assert metrics["clip_fraction"] == 0.0


def test_gradient_at_ratio_one_is_minus_advantage_over_num_tokens():
    logprobs_BT = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -9.0, -9.0]], requires_grad=True)
    old_BT = logprobs_BT.detach().clone().requires_grad_(True)
    advantages_B = torch.tensor([1.0, -2.0], requires_grad=True)
    mask_BT = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    loss, _ = ppo_clip_loss(logprobs_BT, old_BT, advantages_B, mask_BT, **CLIP)
    loss.backward()
    # -A * mask / 4 real tokens
    torch.testing.assert_close(logprobs_BT.grad, torch.tensor([[-0.25, -0.25, -0.25], [0.5, 0.0, 0.0]]))
    assert old_BT.grad is None and advantages_B.grad is None


def test_clipped_token_has_zero_gradient():
    logprobs_BT = torch.tensor([[LOG_1_5, 0.0]], requires_grad=True)
    loss, _ = ppo_clip_loss(logprobs_BT, torch.zeros(1, 2), torch.tensor([1.0]), torch.ones(1, 2), **CLIP)
    loss.backward()
    # clipped token: 0; unclipped: d(-ratio * A / 2)/dlogp = -1 * 1 / 2
    torch.testing.assert_close(logprobs_BT.grad, torch.tensor([[0.0, -0.5]]))


def test_padding_with_nonfinite_logprobs_does_not_leak():
    logprobs_BT = torch.tensor([[-1.0, 0.0]], requires_grad=True)
    old_BT = torch.tensor([[-1.0, float("-inf")]])
    loss, metrics = ppo_clip_loss(logprobs_BT, old_BT, torch.tensor([2.0]), torch.tensor([[1.0, 0.0]]), **CLIP)
    loss.backward()
    assert loss.item() == pytest.approx(-2.0)
    assert metrics["ratio_max"] == pytest.approx(1.0)
    torch.testing.assert_close(logprobs_BT.grad, torch.tensor([[-2.0, 0.0]]))


def test_kl_penalty_added_and_reported():
    # ratio 1, A = 0: pg = 0; k3(logp=0, ref=ln 0.5) = 0.1931472; loss = 0.1 * 0.1931472
    kwargs = {"ref_logprobs_BT": torch.tensor([[LOG_0_5]])}
    loss, metrics = _ppo([[0.0]], [[0.0]], [0.0], [[1.0]], kl_coef=0.1, **kwargs)
    assert loss.item() == pytest.approx(0.01931472)
    assert metrics["kl"] == pytest.approx(0.1931472)
    assert metrics["pg_loss"] == 0.0
    # kl_coef = 0: reported, not added
    loss, metrics = _ppo([[0.0]], [[0.0]], [0.0], [[1.0]], **kwargs)
    assert loss.item() == 0.0
    assert metrics["kl"] == pytest.approx(0.1931472)


def test_importance_weights_scale_pg_term():
    # ratio 1, A = 1: pg = -1 per token, weights 0.5 and 2 -> (-0.5 - 2) / 2
    loss, metrics = _ppo(
        [[0.0, 0.0]], [[0.0, 0.0]], [1.0], [[1.0, 1.0]], importance_weights_BT=torch.tensor([[0.5, 2.0]])
    )
    assert loss.item() == pytest.approx(-1.25)
    assert metrics["pg_loss"] == pytest.approx(-1.25)


def test_seq_mean_token_sum_aggregation_in_ppo():
    # ratio 1: pg = -A; rows of 1 and 3 tokens: (-1 + 3 * -2) / 2
    loss, _ = _ppo(
        [[0.0] * 3] * 2,
        [[0.0] * 3] * 2,
        [1.0, 2.0],
        [[1.0, 0.0, 0.0], [1.0, 1.0, 1.0]],
        aggregation="seq-mean-token-sum",
    )
    assert loss.item() == pytest.approx(-3.5)


def test_ppo_rejects_bad_shapes():
    with pytest.raises(ValueError, match=r"advantages_B has shape \(3,\), expected \(2,\)"):
        _ppo([[0.0], [0.0]], [[0.0], [0.0]], [1.0, 1.0, 1.0], [[1.0], [1.0]])
    with pytest.raises(ValueError, match=r"old_logprobs_BT has shape \(1, 2\)"):
        _ppo([[0.0]], [[0.0, 0.0]], [1.0], [[1.0]])


def test_ppo_takes_its_clip_ranges_from_the_config():
    # no default or range check of its own: AlgorithmConfig's fields are the one source of both
    with pytest.raises(TypeError, match="clip_eps_low"):
        ppo_clip_loss(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1), torch.ones(1, 1))
    for bad in ({"clip_eps_low": 0.0}, {"clip_eps_low": 1.0}, {"clip_eps_high": 0.0}, {"kl_coef": -1.0}):
        with pytest.raises(ValidationError):
            AlgorithmConfig(**bad)


# --- truncated importance weights -------------------------------------------------------


def test_token_truncate_weights_are_detached_and_zero_on_padding():
    old_BT = torch.tensor([[0.0, 0.0, 0.0, 0.0]], requires_grad=True)
    # exp(0 - 0) = 1; exp(0 - ln 2) = 0.5; exp(0 - ln 0.1) = 10 -> cap 2; padding -> 0
    inference_BT = torch.tensor([[0.0, math.log(2.0), math.log(0.1), -50.0]])
    mask_BT = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    weights_BT, _ = off_policy_weights(old_BT, inference_BT, mask_BT, mode="token-truncate", cap=2.0)
    torch.testing.assert_close(weights_BT, torch.tensor([[1.0, 0.5, 2.0, 0.0]]))
    assert not weights_BT.requires_grad
    with pytest.raises(ValueError, match="token-mask needs cap and floor"):  # no bounds of its own
        off_policy_weights(old_BT, inference_BT, mask_BT, mode="token-mask", cap=2.0)


# --- off-policy corrections ----------------------------------------------------------


def _off_policy(mode, **kwargs):
    # two sequences; trainer over engine ratios r_t: row 0 = [2, 0.5, 4], row 1 = [1.5, 1.5, padding]
    old_BT = torch.zeros(2, 3)
    inference_BT = -torch.log(torch.tensor([[2.0, 0.5, 4.0], [1.5, 1.5, 1.0]]))
    mask_BT = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    return off_policy_weights(old_BT, inference_BT, mask_BT, mode=mode, **kwargs)


def test_token_truncate_equals_tis():
    weights_BT, m = _off_policy("token-truncate", cap=2.0)
    torch.testing.assert_close(weights_BT, torch.tensor([[2.0, 0.5, 2.0], [1.5, 1.5, 0.0]]))
    assert m["is_masked_fraction"] == 0.0 and m["is_weight_max"] == 2.0
    assert m["is_weight_mean"] == pytest.approx((2 + 0.5 + 2 + 1.5 + 1.5) / 5)


def test_token_mask_zeroes_tokens_outside_the_range():  # IcePop: [floor, cap]
    weights_BT, m = _off_policy("token-mask", cap=3.0, floor=0.6)
    torch.testing.assert_close(weights_BT, torch.tensor([[2.0, 0.0, 0.0], [1.5, 1.5, 0.0]]))
    assert m["is_masked_fraction"] == pytest.approx(2 / 5)


def test_sequence_modes_use_the_product_of_the_ratios():
    # row 0: 2 * 0.5 * 4 = 4; row 1: 1.5 * 1.5 = 2.25
    truncated_BT, _ = _off_policy("sequence-truncate", cap=3.0)
    torch.testing.assert_close(truncated_BT, torch.tensor([[3.0, 3.0, 3.0], [2.25, 2.25, 0.0]]))
    masked_BT, m = _off_policy("sequence-mask", cap=3.0, floor=0.0)
    torch.testing.assert_close(masked_BT, torch.tensor([[0.0, 0.0, 0.0], [2.25, 2.25, 0.0]]))
    assert m["is_masked_fraction"] == pytest.approx(3 / 5) and m["is_weight_max"] == pytest.approx(2.25)


def test_geometric_mask_rejects_whole_sequences_without_reweighting():
    # geometric means: row 0 = 4 ** (1/3) = 1.587, row 1 = 1.5
    kept_BT, m = _off_policy("geometric-mask", geo_low=0.9, geo_high=1.55)
    torch.testing.assert_close(kept_BT, torch.tensor([[0.0, 0.0, 0.0], [1.0, 1.0, 0.0]]))
    assert m["is_masked_fraction"] == pytest.approx(3 / 5)
    both_BT, _ = _off_policy("geometric-mask", geo_low=0.9, geo_high=1.6)
    torch.testing.assert_close(both_BT, torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]]))


def test_off_policy_weights_refuse_unknown_modes_and_missing_bounds():
    with pytest.raises(ValueError, match="unknown off-policy correction 'icepop'"):
        _off_policy("icepop")
    with pytest.raises(ValueError, match="geometric-mask needs geo_low and geo_high"):
        _off_policy("geometric-mask", geo_low=0.9)


# --- M2PO -------------------------------------------------------------------------------------


def test_m2po_masks_the_largest_squared_log_ratios_until_the_rest_is_below_the_threshold():
    """Hand-computed (Zheng et al. 2025; AReaL's `_apply_m2po_masking`): squares 0, .01, .25, .09, 0, .0025."""
    from lora_rl_core.algorithm import m2po_keep_mask

    log_r = torch.tensor([0.0, 0.1, -0.5, 0.3, 0.0, 0.05])
    keep, m2 = m2po_keep_mask(log_r, 0.04)
    assert m2.item() == pytest.approx(0.3525 / 6)
    # masking -0.5 leaves (0.01 + 0.09 + 0.0025) / 5 = 0.0205 < 0.04
    assert keep.tolist() == [True, True, False, True, True, True]
    keep, _ = m2po_keep_mask(log_r, 0.01)  # 0.0205 is not below 0.01: 0.3 goes too, leaving 0.003125
    assert keep.tolist() == [True, True, False, False, True, True]
    keep, _ = m2po_keep_mask(torch.tensor([0.5, -0.4, 0.3]), 1e-6)  # no set is below: only the smallest stays
    assert keep.tolist() == [False, False, True]
    keep, m2 = m2po_keep_mask(torch.tensor([0.1, -0.1]), 0.04)  # already below: nothing masked
    assert keep.tolist() == [True, True] and m2.item() == pytest.approx(0.01)
    keep, m2 = m2po_keep_mask(torch.zeros(0), 0.04)
    assert keep.numel() == 0 and m2.item() == 0.0


def test_m2po_weights_are_the_ratio_on_kept_tokens_and_the_loss_is_unclipped():
    from lora_rl_core.algorithm import m2po_weights

    old_BT = torch.zeros(1, 3)
    inference_BT = -torch.log(torch.tensor([[2.0, 0.5, 4.0]]))  # ratios 2, 0.5, 4
    mask_BT = torch.ones(1, 3)
    weights_BT, m = m2po_weights(old_BT, inference_BT, torch.tensor([[1.0, 1.0, 0.0]]), mask_BT)
    torch.testing.assert_close(weights_BT, torch.tensor([[2.0, 0.5, 0.0]]))
    assert m["is_masked_fraction"].item() == pytest.approx(1 / 3) and m["is_weight_max"].item() == 2.0
    # no clip: a ratio of 1.5 with a positive advantage keeps its gradient (PPO's clip at 1.28 would drop it)
    logprobs_BT = torch.full((1, 3), math.log(1.5), requires_grad=True)
    loss, metrics = ppo_clip_loss(
        logprobs_BT, torch.zeros(1, 3), torch.tensor([1.0]), mask_BT,
        clip_eps_low=None, clip_eps_high=None, aggregation="token-mean", kl_coef=0.0,
    )  # fmt: skip
    assert loss.item() == pytest.approx(-1.5) and metrics["clip_fraction"].item() == 0.0
    loss.backward()
    torch.testing.assert_close(logprobs_BT.grad, torch.full((1, 3), -1.5 / 3))
