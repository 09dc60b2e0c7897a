"""The phases of one training step, as functions over a run's components.

    rollout(run, k) -> RolloutStats    sample G completions per prompt with policy version k - 1
    score(run, k)   -> ScoreStats      rewards and group advantages
    train(run, k)   -> TrainStats      one policy update; its record and (every `checkpoint_every` steps) a
                                       checkpoint go to the run's store writer

Publishing and syncing the resulting adapter version are `lora_rl_core.run.versions`. Each phase reads its
input from and writes its output to the run's files in the store (`RunDir`: `rollouts/`, `scored/`,
`trained/`), so a phase can be re-run, on any machine, from what the previous one left (docs/DESIGN.md, "One
training step").
"""

from __future__ import annotations

import functools
import logging
import time
from typing import Any

import torch

from lora_rl_core.adapters import adapter_name
from lora_rl_core.algorithm import ADVANTAGE_ESTIMATORS, group_has_signal, masked_group_advantages
from lora_rl_core.data import prompt_instruction, render_prompt, stable_seed
from lora_rl_core.engines import GenerationRequest, SamplingParams
from lora_rl_core.errors import EngineError, LoraRLError
from lora_rl_core.evaluation import evaluate_run_policy
from lora_rl_core.faults import maybe_fail
from lora_rl_core.records import (
    Rollout,
    RolloutBatch,
    RolloutStats,
    ScoredBatch,
    ScoredRollout,
    ScoreStats,
    TrainBatch,
    TrainStats,
)
from lora_rl_core.rewards import RewardBatch
from lora_rl_core.run.components import RunComponents
from lora_rl_core.run.resume import checkpoint_state, write_checkpoint

log = logging.getLogger(__name__)


def rollout(run: RunComponents, step: int) -> RolloutStats:
    """Sample `group_size` completions for each of `prompts_per_step` prompts with the current policy adapter;
    writes `rollouts/step-N.json`. Safe to run for several steps at once (`rollout.mode: async`): the prompts
    are a function of the step, and the version used is held against retirement until the completions return.

    Raises:
        EngineError: a request was aborted (a group with missing samples would skew its advantages, so the
            phase fails and a retry redoes it).
    """
    maybe_fail("rollout", step, run.run_dir)
    start = time.perf_counter()
    r = run.cfg.rollout
    # The batch is a function of the step (cursor = (step - 1) * prompts), so a resumed run draws the same prompts.
    problems, cursor = run.sampler.batch_at((step - 1) * r.prompts_per_step, r.prompts_per_step)
    params = SamplingParams(
        max_new_tokens=r.max_new_tokens,
        temperature=r.temperature,
        top_p=r.top_p,
        top_k=r.top_k,
        seed=stable_seed(run.cfg.run.seed, "rollout", step),
    )
    instruction = prompt_instruction(run.cfg.data, r)
    prompts = [
        render_prompt(run.tokenizer, p, system_prompt=r.system_prompt, instruction=instruction) for p in problems
    ]
    # The version current now (async mode: maybe older than the trainer's by the time it trains), held until
    # the completions are back so that a sync meanwhile does not retire it.
    with run.policy.hold() as version:
        adapter = adapter_name(run.run_id, version)
        requests = [GenerationRequest(ids, adapter, params) for ids in prompts for _ in range(r.group_size)]
        completions = run.engine.generate(requests, inline=True)  # an embedded engine computes on this thread
    aborted = [c for c in completions if c.finish_reason == "abort"]
    if aborted:
        raise EngineError(f"{len(aborted)} of {len(completions)} rollout requests aborted ({aborted[0].abort_reason})")
    rows = [
        Rollout(
            group=i // r.group_size,
            problem_id=problems[i // r.group_size].id,
            answer=problems[i // r.group_size].answer,
            prompt_ids=c.prompt_ids,
            completion_ids=c.completion_ids,
            logprobs=c.logprobs,
            finish_reason=c.finish_reason,
            adapter=c.adapter,
            adapter_version=c.adapter_version,
        )
        for i, c in enumerate(completions)
    ]
    run.run_dir.write_phase("rollouts", step, RolloutBatch(step=step, sampler=cursor, rows=rows))
    seconds = time.perf_counter() - start
    tokens = sum(len(row.completion_ids) for row in rows)
    return RolloutStats(
        completions=len(rows),
        completion_tokens=tokens,
        rollout_seconds=seconds,
        completions_per_second=len(rows) / seconds,
        completion_length=tokens / len(rows),
        truncated_fraction=sum(row.finish_reason == "length" for row in rows) / len(rows),
    )


def score(run: RunComponents, step: int) -> ScoreStats:
    """Reward every completion of step `step` with the run's reward functions (TRL's signature, every dataset
    column by name) and compute group advantages (`algorithm.advantage`); reads `rollouts/step-N.json`, writes
    `scored/step-N.json`. A completion no function scored is `skipped`: its group's advantages are computed
    over the group's scored completions alone, its own advantage is 0, and it is not trained on.

    Raises:
        RewardError: a reward function raised, timed out or returned bad values (naming it and the rows).
    """
    maybe_fail("score", step, run.run_dir)
    start = time.perf_counter()
    rows = run.run_dir.read_phase("rollouts", step, RolloutBatch).rows
    texts = run.tokenizer.batch_decode([row.completion_ids for row in rows], skip_special_tokens=True)
    problems = [run.problem(row.problem_id) for row in rows]
    scored = run.rewards.score(RewardBatch.from_problems(problems, texts, [row.completion_ids for row in rows]))
    group_size = run.cfg.rollout.group_size
    rewards_NG = torch.tensor(scored.totals, dtype=torch.float32).view(-1, group_size)  # [N, G]
    skipped_NG = torch.tensor(scored.skipped, dtype=torch.bool).view(-1, group_size)  # [N, G]
    estimator = ADVANTAGE_ESTIMATORS[run.cfg.algorithm.advantage]
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
    run.run_dir.write_phase("scored", step, ScoredBatch(step=step, rows=out))
    kept = [t for t, skip in zip(scored.totals, scored.skipped, strict=True) if not skip] or [0.0]
    kept_t = torch.tensor(kept, dtype=torch.float32)
    return ScoreStats(
        reward_mean=float(kept_t.mean()),
        reward_std=float(kept_t.std(unbiased=False)),
        accuracy=sum(1.0 for t in kept if t >= run.cfg.eval.pass_threshold) / len(rows),
        groups_with_signal=float(signal_N.float().mean()),
        reward_terms=scored.term_means(),
        skipped=sum(scored.skipped),
        score_seconds=time.perf_counter() - start,
    )


def train(run: RunComponents, step: int) -> TrainStats:
    """One policy update on the scored rollouts of `step` (`TrainBatch.from_scored`: stale rows rejected,
    uniform groups skipped with `skip_uniform_groups`). Its stats (`trained/step-N.json`) and, every
    `checkpoint_every` steps, a checkpoint go to the run's `StoreWriter` (snapshots taken here, written in the
    background with `trainer.background_publish`). Where the memory plan put SGLang's memory saver on, its KV
    cache is released for the update (`RunComponents.engine_memory_released`).

    A step the restored checkpoint already holds (`run.restored.step`, a resumed run) is not trained again:
    its recorded stats are returned.

    Raises:
        BackgroundWriteError: an earlier background write failed.
    """
    if step <= run.restored.step:
        return _recorded_train(run, step)
    run.writer.check()  # a failed write fails the run before another update is computed
    maybe_fail("train_step", step, run.run_dir)
    algo = run.cfg.algorithm
    rows = run.run_dir.read_phase("scored", step, ScoredBatch).rows
    batch = TrainBatch.from_scored(
        rows, step=step, max_staleness=algo.max_staleness, skip_uniform=algo.skip_uniform_groups
    )
    with run.engine_memory_released():  # a colocated SGLang's KV cache is free while the trainer trains
        metrics = run.trainer.train_step(batch)
    checkpointed = step % run.cfg.trainer.checkpoint_every == 0
    stats = TrainStats(
        trainer=metrics,
        trained_rows=len(batch),
        stale_rejected=batch.stale_rejected,
        uniform_skipped=batch.uniform_skipped,
        reward_skipped=batch.reward_skipped,
        checkpointed=checkpointed,
        version_lag=batch.version_lag,
    )
    record_train(run, step, stats)
    return stats


def record_train(run: RunComponents, step: int, stats: TrainStats) -> None:
    """Hand step `step`'s stats and, when `stats.checkpointed`, a snapshot of the checkpoint (taken now) to the
    run's writer, which writes the stats first, then the checkpoint.

    Raises:
        BackgroundWriteError: an earlier background write failed.
    """
    state = checkpoint_state(run, step) if stats.checkpointed else None
    label = f"the checkpoint of step {step}" if state is not None else f"the train record of step {step}"
    run.writer.submit(f"{label} of run {run.run_id}", functools.partial(_write_trained, run, step, stats, state))


def _write_trained(run: RunComponents, step: int, stats: TrainStats, state: dict[str, Any] | None) -> None:
    """The step's stats, then its checkpoint (so every step up to a complete checkpoint has its record)."""
    run.run_dir.write_phase("trained", step, stats)
    if state is not None:
        write_checkpoint(run, step, state)


def _recorded_train(run: RunComponents, step: int) -> TrainStats:
    """The stats step `step` recorded when it trained (runs checkpointed before records existed: zeros)."""
    try:
        return run.run_dir.read_phase("trained", step, TrainStats)
    except LoraRLError as exc:
        log.warning("step %d is in the restored checkpoint but its train record is unreadable (%s)", step, exc)
        return TrainStats(trainer={}, trained_rows=0, stale_rejected=0, uniform_skipped=0, checkpointed=False)


def evaluate(run: RunComponents, adapter: str | None) -> dict[str, Any]:
    """Held-out evaluation of `adapter` (None = the base model) with the run's fixed grader, never its reward
    terms: greedy accuracy per grader metric (strict and flexible), and pass@k / mean@n with
    `eval.samples_per_prompt` samples (`lora_rl_core.evaluation`)."""
    return evaluate_run_policy(run.engine, run.tokenizer, run.test_problems, run.grader, run.cfg, adapter=adapter)
