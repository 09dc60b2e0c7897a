"""One training step as pure functions over records: no store, no clock, no engine state. The phases
(`lora_rl_core.run.phases`) are thin wrappers that read their input from the run's files, call these, and
write their output, so retries and resumes work on what the store holds.

    requests   = rollout_requests(prompts, adapter, params, group_size)
    completions = engine.generate(requests)
    rollouts   = rollout_batch(step, problems, completions, group_size, cursor)        -> RolloutBatch
    scored     = score_batch(rollouts, texts, problems, rewards, estimator)            -> ScoredBatch
    batch      = TrainBatch.from_scored(scored.rows, step, plan.batch)                 -> TrainBatch
    metrics    = trainer.train_step(batch)                                            -> PPO-clip update
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lora_rl_core.algorithm import group_has_signal, masked_group_advantages
from lora_rl_core.algorithm.advantages import AdvantageEstimator
from lora_rl_core.algorithm.truncation import overlong_penalty
from lora_rl_core.config.algorithm import OverlongPenalty, TruncationConfig
from lora_rl_core.data import Problem
from lora_rl_core.engines import Completion, GenerationRequest, SamplingParams
from lora_rl_core.errors import EngineError
from lora_rl_core.records import Rollout, RolloutBatch, RolloutStats, ScoredBatch, ScoredRollout, ScoreStats
from lora_rl_core.rewards import RewardBatch, RewardSet
from lora_rl_core.rewards.score import ScoredRewards


def rollout_requests(
    prompts: Sequence[list[int]], adapter: str | None, params: SamplingParams, group_size: int
) -> list[GenerationRequest]:
    """`group_size` requests per prompt (`[prompts * group_size]`, group by group), each naming `adapter`."""
    return [GenerationRequest(list(ids), adapter, params) for ids in prompts for _ in range(group_size)]


def rollout_batch(
    step: int,
    problems: Sequence[Problem],
    completions: Sequence[Completion],
    group_size: int,
    cursor: dict[str, int],
) -> RolloutBatch:
    """The step's rollouts: completion `i` belongs to group `i // group_size`, the problem of that index.

    Raises:
        EngineError: a request was aborted (a group with missing samples would skew its advantages, so the
            phase fails and a retry redoes it).
    """
    aborted = [c for c in completions if c.finish_reason == "abort"]
    if aborted:
        raise EngineError(f"{len(aborted)} of {len(completions)} rollout requests aborted ({aborted[0].abort_reason})")
    rows = [
        Rollout(
            group=i // group_size,
            problem_id=problems[i // group_size].id,
            answer=problems[i // group_size].answer,
            prompt_ids=c.prompt_ids,
            completion_ids=c.completion_ids,
            logprobs=c.logprobs,
            finish_reason=c.finish_reason,
            adapter=c.adapter,
            adapter_version=c.adapter_version,
        )
        for i, c in enumerate(completions)
    ]
    return RolloutBatch(step=step, sampler=cursor, rows=rows)


def rollout_stats(batch: RolloutBatch, seconds: float) -> RolloutStats:
    """Completions, tokens, throughput (`seconds` of wall time), the share cut at the token limit, the share
    that ended (end-of-sequence or a stop sequence) and the count of each finish reason."""
    rows = batch.rows
    tokens = sum(len(row.completion_ids) for row in rows)
    reasons = {reason: sum(row.finish_reason == reason for row in rows) for reason in ("eos", "stop", "length")}
    return RolloutStats(
        completions=len(rows),
        completion_tokens=tokens,
        rollout_seconds=seconds,
        completions_per_second=len(rows) / seconds,
        completion_length=tokens / len(rows),
        truncated_fraction=reasons["length"] / len(rows),
        ended_fraction=(reasons["eos"] + reasons["stop"]) / len(rows),
        finish_reasons=reasons,  # no `abort`: an aborted request fails the phase (`rollout_batch`)
    )


def score_batch(
    batch: RolloutBatch,
    texts: Sequence[str],
    problems: Sequence[Problem],
    rewards: RewardSet,
    estimator: AdvantageEstimator,
    group_size: int,
    *,
    truncation: TruncationConfig,
    max_new_tokens: int,
) -> ScoredBatch:
    """Reward every completion (TRL's signature, every dataset column by name, `finish_reason` among them) and
    compute group advantages (`estimator`, `algorithm.advantage`). A completion no function scored is
    `skipped`: its group's advantages are computed over the group's scored completions alone, its own
    advantage is 0. With `truncation: overlong-penalty`, DAPO's length penalty (`algorithm.overlong_penalty`)
    is added to each scored completion's reward before the advantages, and recorded as the term
    `OVERLONG_TERM`.

    Args:
        batch: the step's rollouts, `[N * G]` rows group by group.
        texts / problems: each row's decoded completion and its problem, in row order.
        group_size: G.
        truncation: `algorithm.truncation`; max_new_tokens: `rollout.max_new_tokens`, the penalty's limit.

    Raises:
        RewardError: a reward function raised, timed out or returned bad values (naming it and the rows).
    """
    rows = batch.rows
    scored = rewards.score(
        RewardBatch.from_problems(
            list(problems), list(texts), [r.completion_ids for r in rows], [r.finish_reason for r in rows]
        )
    )
    if isinstance(truncation, OverlongPenalty):
        scored = _with_overlong_penalty(scored, rows, truncation, max_new_tokens)
    rewards_NG = torch.tensor(scored.totals, dtype=torch.float32).view(-1, group_size)  # [N, G]
    skipped_NG = torch.tensor(scored.skipped, dtype=torch.bool).view(-1, group_size)  # [N, G]
    advantages_NG = masked_group_advantages(rewards_NG, skipped_NG, estimator)  # [N, G]
    signal_N = group_has_signal(rewards_NG, skipped_NG=skipped_NG)  # [N] bool: its scored rewards differ
    out = [
        ScoredRollout(
            **row.model_dump(),
            reward=scored.totals[i],
            rewards={name: values[i] for name, values in scored.terms.items()},
            skipped=scored.skipped[i],
            advantage=float(advantages_NG.view(-1)[i]),
            has_signal=bool(signal_N[row.group]),
        )
        for i, row in enumerate(rows)
    ]
    return ScoredBatch(step=batch.step, rows=out)


OVERLONG_TERM = "overlong_penalty"
"""The reward term `truncation: overlong-penalty` adds (`rewards/overlong_penalty/mean` in the step metrics)."""


def _with_overlong_penalty(
    scored: ScoredRewards, rows: Sequence[Rollout], truncation: OverlongPenalty, max_new_tokens: int
) -> ScoredRewards:
    """`scored` with DAPO's length penalty added to the totals of the scored rows, as the term `OVERLONG_TERM`
    (None where the row is skipped: a completion nothing scored stays unscored)."""
    lengths_B = torch.tensor([len(r.completion_ids) for r in rows])
    penalties = overlong_penalty(
        lengths_B, max_new_tokens=max_new_tokens, buffer=truncation.buffer, penalty=truncation.penalty
    ).tolist()
    values: list[float | None] = [None if skip else p for p, skip in zip(penalties, scored.skipped, strict=True)]
    totals = [t + (v or 0.0) for t, v in zip(scored.totals, values, strict=True)]
    return ScoredRewards(totals, {**scored.terms, OVERLONG_TERM: values}, scored.skipped)


def score_stats(scored: ScoredBatch, pass_threshold: float, seconds: float) -> ScoreStats:
    """The step's reward statistics over the scored (not skipped) completions: mean, std, the share at or above
    `pass_threshold` (of all rows; the reward terms' sum without the overlong penalty, which grades length, not
    the task), groups with signal, each term's mean over the rows it scored."""
    rows = scored.rows
    kept = [r.reward for r in rows if not r.skipped] or [0.0]
    task = [r.reward - (r.rewards.get(OVERLONG_TERM) or 0.0) for r in rows if not r.skipped]  # the tasks' own
    kept_t = torch.tensor(kept, dtype=torch.float32)
    groups: dict[int, bool] = {r.group: r.has_signal for r in rows}
    terms = {name: [r.rewards.get(name) for r in rows] for name in (rows[0].rewards if rows else {})}
    values = ScoredRewards(totals=[r.reward for r in rows], terms=terms, skipped=[r.skipped for r in rows])
    return ScoreStats(
        reward_mean=float(kept_t.mean()),
        reward_std=float(kept_t.std(unbiased=False)),
        accuracy=sum(1.0 for t in task if t >= pass_threshold) / len(rows),
        groups_with_signal=sum(groups.values()) / max(1, len(groups)),
        reward_terms=values.term_means(),
        skipped=sum(r.skipped for r in rows),
        score_seconds=seconds,
    )
