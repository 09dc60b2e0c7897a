"""The phases of one training step, as functions over a run's components: each reads its input from the run's
files, calls the step's pure functions (`lora_rl_core.run.step`) and writes its output.

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

from lora_rl_core.adapters import adapter_name
from lora_rl_core.algorithm import ADVANTAGE_ESTIMATORS
from lora_rl_core.data import stable_seed
from lora_rl_core.engines import SamplingParams
from lora_rl_core.errors import LoraRLError
from lora_rl_core.evaluation import evaluate_run_policy
from lora_rl_core.faults import maybe_fail
from lora_rl_core.records import RolloutBatch, RolloutStats, ScoredBatch, ScoreStats, TrainBatch, TrainStats
from lora_rl_core.rewards.score import trim_stops
from lora_rl_core.run.checkpoints import commit_checkpoints, start_checkpoint
from lora_rl_core.run.components import RunComponents
from lora_rl_core.run.step import (
    rollout_batch,
    rollout_requests,
    rollout_stats,
    score_batch,
    score_stats,
)

log = logging.getLogger(__name__)


def rollout(run: RunComponents, step: int) -> RolloutStats:
    """Sample `group_size` completions for each of `prompts_per_step` prompts with the current policy adapter;
    writes `rollouts/step-N.json`. Safe to run for several steps at once (`rollout.mode: async`): the prompts
    are a function of the step, and the version used is held against retirement until the completions return.

    Raises:
        EngineError: a request was aborted (`step.rollout_batch`).
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
        stop=tuple(r.stop),
        stop_token_ids=tuple(r.stop_token_ids),
    )
    prompts = [run.prompt.render(run.inputs.tokenizer, p) for p in problems]
    # The version current now (async mode: maybe older than the trainer's by the time it trains), held until
    # the completions are back so that a sync meanwhile does not retire it.
    with run.policy.hold() as version:
        requests = rollout_requests(prompts, adapter_name(run.run_id, version), params, r.group_size)
        completions = run.engine.generate(requests, inline=True)  # an embedded engine computes on this thread
    batch = rollout_batch(step, problems, completions, r.group_size, cursor)
    run.run_dir.write_phase("rollouts", step, batch)
    return rollout_stats(batch, time.perf_counter() - start)


def score(run: RunComponents, step: int) -> ScoreStats:
    """Reward every completion of step `step` and compute group advantages (`step.score_batch`); reads
    `rollouts/step-N.json`, writes `scored/step-N.json`.

    Raises:
        RewardError: a reward function raised, timed out or returned bad values (naming it and the rows).
    """
    maybe_fail("score", step, run.run_dir)
    start = time.perf_counter()
    batch = run.run_dir.read_phase("rollouts", step, RolloutBatch)
    cfg = run.cfg
    texts = run.inputs.tokenizer.batch_decode([row.completion_ids for row in batch.rows], skip_special_tokens=True)
    texts = trim_stops(texts, [row.finish_reason for row in batch.rows], cfg.rollout.stop)
    problems = [run.inputs.problem(row.problem_id) for row in batch.rows]
    estimator = ADVANTAGE_ESTIMATORS[cfg.algorithm.advantage]
    scored = score_batch(
        batch,
        texts,
        problems,
        run.rewards,
        estimator,
        cfg.rollout.group_size,
        truncation=cfg.algorithm.truncation,
        max_new_tokens=cfg.rollout.max_new_tokens,
    )
    run.run_dir.write_phase("scored", step, scored)
    return score_stats(scored, run.cfg.eval.pass_threshold, time.perf_counter() - start)


def train(run: RunComponents, step: int) -> TrainStats:
    """One policy update on the scored rollouts of `step`, the rows kept by the plan's rules (`run.plan.batch`,
    `TrainBatch.from_scored`: stale rows rejected, uniform groups skipped, cut completions out of the policy's
    loss under `truncation: mask`). Its stats (`trained/step-N.json`) and, every
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
    commit_checkpoints(run)  # the checkpoints whose ranks are done: their manifests go to the writer
    maybe_fail("train", step, run.run_dir)
    rows = run.run_dir.read_phase("scored", step, ScoredBatch).rows
    batch = TrainBatch.from_scored(rows, step=step, rules=run.plan.batch)
    if batch.truncated_masked and not batch.policy_rows():  # a policy that never ends in time would otherwise not learn
        log.warning(
            "step %d trains on nothing: all %d completions with a learning signal were cut at "
            "rollout.max_new_tokens=%d and algorithm.truncation=mask leaves them out of the loss; raise "
            "rollout.max_new_tokens or set algorithm.truncation=keep",
            step,
            batch.truncated_masked,
            run.cfg.rollout.max_new_tokens,
        )
    start = time.perf_counter()
    with run.engine_memory_released():  # a colocated SGLang's KV cache is free while the trainer trains
        metrics = run.trainer.train_step(batch)
    checkpointed = step % run.cfg.trainer.checkpoint_every == 0
    stats = TrainStats(
        trainer=metrics,
        trained_rows=batch.policy_rows(),
        stale_rejected=batch.stale_rejected,
        uniform_skipped=batch.uniform_skipped,
        reward_skipped=batch.reward_skipped,
        truncated_masked=batch.truncated_masked,
        checkpointed=checkpointed,
        version_lag=batch.version_lag,
        update_seconds=time.perf_counter() - start,
    )
    return record_train(run, step, stats)


def record_train(run: RunComponents, step: int, stats: TrainStats) -> TrainStats:
    """Hand step `step`'s stats to the run's writer and, when `stats.checkpointed`, start the checkpoint (the
    trainer's ranks snapshot and write their parts now: `start_checkpoint`; its manifest follows the stats).

    Returns:
        `stats` with `snapshot_seconds` (the ranks' snapshot), as recorded.

    Raises:
        BackgroundWriteError: an earlier background write failed.
    """
    start = time.perf_counter()
    if stats.checkpointed:
        start_checkpoint(run, step)
    seconds = time.perf_counter() - start if stats.checkpointed else 0.0
    stats = stats.model_copy(update={"snapshot_seconds": seconds})
    run.writer.submit(
        f"the train record of step {step} of run {run.run_id}",
        functools.partial(run.run_dir.write_phase, "trained", step, stats),
    )
    if stats.checkpointed and not run.cfg.trainer.background_publish:
        commit_checkpoints(run, wait=True)  # complete before the step's version, as every write here
    return stats


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
    return evaluate_run_policy(
        run.engine,
        run.inputs.tokenizer,
        run.inputs.test,
        run.inputs.grader,
        run.cfg,
        adapter=adapter,
        prompt=run.prompt,
    )
