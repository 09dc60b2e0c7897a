"""`algorithm.truncation`: what a completion cut at the token limit does to the rewards, the advantages and the
loss, with numbers (`keep`, `mask`, `overlong-penalty`), and the config's refusals."""

from __future__ import annotations

import math

import pytest
import torch

from lora_rl_core.algorithm import grpo_advantages, ppo_clip_loss
from lora_rl_core.algorithm.truncation import overlong_penalty
from lora_rl_core.config import AlgorithmConfig, RunConfig
from lora_rl_core.config.algorithm import KeepTruncated, MaskTruncated, OverlongPenalty
from lora_rl_core.data import Problem
from lora_rl_core.records import BatchRules, Rollout, RolloutBatch, TrainBatch
from lora_rl_core.rewards import RewardSet
from lora_rl_core.rewards.score import RewardTerm
from lora_rl_core.rewards.verify import MathVerifier
from lora_rl_core.run.step import OVERLONG_TERM, score_batch, score_stats
from lora_rl_testing.plans import loss_kwargs

LIMIT = 48


def test_overlong_penalty_is_dapo_eq13():
    # L = 48, L_cache = 16: nothing up to 32 tokens, then linear to -penalty at 48 (and clamped past it)
    lengths = torch.tensor([0, 20, 32, 33, 40, 48, 60])
    got = overlong_penalty(lengths, max_new_tokens=LIMIT, buffer=16, penalty=1.0)
    assert got.tolist() == pytest.approx([0.0, 0.0, 0.0, -1 / 16, -0.5, -1.0, -1.0])
    assert overlong_penalty(lengths, max_new_tokens=LIMIT, buffer=16, penalty=2.0)[4].item() == pytest.approx(-1.0)
    assert overlong_penalty(torch.tensor([47, 48]), max_new_tokens=LIMIT, buffer=1, penalty=0.5).tolist() == [0, -0.5]
    with pytest.raises(ValueError, match="buffer"):
        overlong_penalty(lengths, max_new_tokens=LIMIT, buffer=49, penalty=1.0)
    with pytest.raises(ValueError, match="penalty"):
        overlong_penalty(lengths, max_new_tokens=LIMIT, buffer=8, penalty=0.0)


# One group of four: right and cut at the limit, right and short, wrong and long (40 tokens, ended), wrong and short.
REWARDS = [1.0, 1.0, 0.0, 0.0]
LENGTHS = [LIMIT, 20, 40, 10]
FINISH = ["length", "eos", "eos", "stop"]


def _rollouts() -> RolloutBatch:
    rows = [
        Rollout(
            group=0,
            problem_id="p0",
            answer="3",
            prompt_ids=[1, 2],
            completion_ids=[5] * n,
            logprobs=[-0.5] * n,
            finish_reason=reason,  # type: ignore[arg-type]
            adapter="run-v000001",
            adapter_version=1,
        )
        for n, reason in zip(LENGTHS, FINISH, strict=True)
    ]
    return RolloutBatch(step=2, sampler={}, rows=rows)


def _score(truncation):  # noqa: ANN001, ANN202
    seen: dict[str, list] = {}

    def fixed(prompts, completions, completion_ids=None, finish_reason=None, **columns):  # noqa: ANN001, ANN202
        seen["finish_reason"] = finish_reason
        return list(REWARDS)

    problem = Problem(prompt="q", answer="3", id="p0")
    with RewardSet([RewardTerm("fixed", fixed, 1.0)], MathVerifier(), timeout_s=5.0) as rewards:
        scored = score_batch(
            _rollouts(),
            ["x"] * 4,
            [problem] * 4,
            rewards,
            grpo_advantages,
            4,
            truncation=truncation,
            max_new_tokens=LIMIT,
        )
    assert seen["finish_reason"] == FINISH  # reward functions get why each completion ended, as a column
    return scored


def _loss(batch: TrainBatch) -> float:
    """The token-mean PPO loss of `batch` on-policy (ratio 1): `-sum(A_i * n_i) / sum(n_i)`."""
    width = max(len(c) for c in batch.completion_ids)
    mask = torch.tensor([[1.0] * len(c) + [0.0] * (width - len(c)) for c in batch.completion_ids])
    logprobs = torch.full(mask.shape, -0.5)
    algo = AlgorithmConfig()  # on-policy, ratio 1: the clip range does not matter
    advantages = torch.tensor(batch.advantages)
    loss, _ = ppo_clip_loss(logprobs, logprobs, advantages, mask, **loss_kwargs(algo))
    return float(loss)


def test_keep_trains_on_every_row_with_its_reward():
    scored = _score(KeepTruncated())
    a = 1 / math.sqrt(1 / 3)  # GRPO of [1, 1, 0, 0]: mean 0.5, unbiased std sqrt(1/3)
    assert [r.advantage for r in scored.rows] == pytest.approx([a / 2, a / 2, -a / 2, -a / 2], rel=1e-5)
    batch = TrainBatch.from_scored(
        scored.rows,
        step=2,
        rules=BatchRules(max_staleness=1, skip_uniform=True, mask_truncated=False, critic_sees_truncated=False),
    )
    assert len(batch) == 4 and batch.truncated_masked == 0
    # token-mean: the cut row's 48 tokens dominate: -(0.866 * 48 + 0.866 * 20 - 0.866 * 40 - 0.866 * 10) / 118
    assert _loss(batch) == pytest.approx(-(a / 2) * (48 + 20 - 40 - 10) / 118, rel=1e-5)


def test_mask_keeps_the_cut_row_in_its_group_statistics_and_out_of_the_loss():
    scored = _score(MaskTruncated())
    a = 1 / math.sqrt(1 / 3)
    # advantages first, over the whole group (TRL): the same numbers as `keep`, the cut row included
    assert [r.advantage for r in scored.rows] == pytest.approx([a / 2, a / 2, -a / 2, -a / 2], rel=1e-5)
    batch = TrainBatch.from_scored(
        scored.rows,
        step=2,
        rules=BatchRules(max_staleness=1, skip_uniform=True, mask_truncated=True, critic_sees_truncated=False),
    )
    assert batch.truncated_masked == 1 and [len(c) for c in batch.completion_ids] == [20, 40, 10]
    # the token mean runs over the other rows' 70 tokens alone
    assert _loss(batch) == pytest.approx(-(a / 2) * (20 - 40 - 10) / 70, rel=1e-5)
    # a truncated row of a group without signal is counted as uniform, not as masked
    flat = [r.model_copy(update={"has_signal": False}) for r in scored.rows]
    none = TrainBatch.from_scored(
        flat,
        step=2,
        rules=BatchRules(max_staleness=1, skip_uniform=True, mask_truncated=True, critic_sees_truncated=False),
    )
    assert len(none) == 0 and none.uniform_skipped == 4 and none.truncated_masked == 0


def test_under_gae_the_cut_row_stays_for_the_critic_alone():
    scored = _score(MaskTruncated())
    batch = TrainBatch.from_scored(
        scored.rows,
        step=2,
        rules=BatchRules(max_staleness=1, skip_uniform=True, mask_truncated=True, critic_sees_truncated=True),
    )
    assert [len(c) for c in batch.completion_ids] == [48, 20, 40, 10] and batch.value_only == [True] + [False] * 3
    assert batch.truncated_masked == 1 and batch.policy_rows() == 3 and not batch.trains_policy(0)
    assert batch.select([2, 0]).value_only == [False, True]
    kept = TrainBatch.from_scored(
        scored.rows,
        step=2,
        rules=BatchRules(max_staleness=1, skip_uniform=True, critic_sees_truncated=True, mask_truncated=False),
    )
    assert kept.value_only == [] and kept.policy_rows() == 4  # `keep`: nothing is the critic's alone


def test_overlong_penalty_moves_rewards_and_advantages():
    scored = _score(OverlongPenalty(buffer=16, penalty=1.0))
    # 48 tokens: -1; 40 tokens: -0.5; 20 and 10 tokens: 0
    assert [r.rewards[OVERLONG_TERM] for r in scored.rows] == pytest.approx([-1.0, 0.0, -0.5, 0.0])
    assert [r.reward for r in scored.rows] == pytest.approx([0.0, 1.0, -0.5, 0.0])
    expected = grpo_advantages(torch.tensor([[0.0, 1.0, -0.5, 0.0]]))[0].tolist()
    assert [r.advantage for r in scored.rows] == pytest.approx(expected, rel=1e-5)
    # the right answer cut at the limit now ranks below the right short one, level with the wrong short one
    assert scored.rows[0].advantage < scored.rows[1].advantage
    assert scored.rows[0].advantage == pytest.approx(scored.rows[3].advantage)
    # every row is still trained on; the rollout accuracy grades the task, not the length
    batch = TrainBatch.from_scored(
        scored.rows,
        step=2,
        rules=BatchRules(max_staleness=1, skip_uniform=True, mask_truncated=False, critic_sees_truncated=False),
    )
    assert len(batch) == 4
    stats = score_stats(scored, 1.0, 0.0)
    assert stats.accuracy == 0.5 and stats.reward_terms[OVERLONG_TERM] == pytest.approx(-0.375)


@pytest.mark.parametrize(
    ("truncation", "message"),
    [
        ("drop", "does not match any of the expected tags: 'keep', 'mask', 'overlong-penalty'"),
        ({"type": "overlong-penalty", "buffer": 64}, "longer than rollout.max_new_tokens"),
        ({"type": "overlong-penalty", "buffer": 0}, "greater than or equal to 1"),
        ({"type": "mask", "buffer": 8}, "buffer"),
    ],
)
def test_bad_truncation_is_refused(truncation, message):
    with pytest.raises(ValueError, match=message):
        RunConfig.model_validate({"algorithm": {"truncation": truncation}, "rollout": {"max_new_tokens": LIMIT}})


def test_truncation_config_forms():
    assert RunConfig().algorithm.truncation == MaskTruncated()  # the default, by measurement
    assert RunConfig.model_validate({"algorithm": {"truncation": "keep"}}).algorithm.truncation == KeepTruncated()
    assert RunConfig.model_validate({"algorithm": {"truncation": "mask"}}).algorithm.truncation == MaskTruncated()
    t = RunConfig.model_validate({"algorithm": {"truncation": {"type": "overlong-penalty", "buffer": 8}}})
    assert t.algorithm.truncation == OverlongPenalty(buffer=8, penalty=1.0)
