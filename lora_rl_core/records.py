"""Typed records of the data that crosses step phases, and of what each phase reports.

The step DAG (docs/DESIGN.md, docs/ARCHITECTURE.md) passes these between phases:

    rollout  -> `RolloutBatch` (rows of `Rollout`)        -> `<store>/<run>/rollouts/step-NNNNNN.json`
    score    -> `ScoredBatch` (rows of `ScoredRollout`)   -> `<store>/<run>/scored/step-NNNNNN.json`
    train    -> `TrainBatch.from_scored(...)` -> the trainer
    publish  -> `AdapterRef` (lora_rl_core.store)
    sync     -> `SyncStats`

Phase files are pydantic models, so a truncated or hand-edited file read back from the store fails with
the field that is wrong (`LoraRLError` from `RunDir.read_phase`). Every phase also returns a small stats
record (`RolloutStats`, `ScoreStats`, `TrainStats`, `SyncStats`) that Prefect persists as the task's
result; `metrics()` flattens it into the per-step metrics line of the run log and report.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

FinishReason = Literal["stop", "eos", "length", "abort"]
"""Why a completion ended: `eos`, the model's end-of-sequence token; `stop`, a stop sequence
(`SamplingParams.stop`: a string, or `stop_token_ids`: a token id); `length`, `max_new_tokens` reached; `abort`,
ended early with no tokens kept (`ABORT_REASONS`). SGLang reports `eos` and `stop` alike as `{"type": "stop",
"matched": ...}`; the HTTP client tells them apart by what `matched` is (docs/SGLANG.md, "Stop sequences")."""


class Record(BaseModel):
    """Base of the phase records: unknown fields are errors, instances are immutable."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class Rollout(Record):
    """One sampled completion of one prompt, as the engine returned it."""

    group: int
    """Index of the prompt's group in the step, `0 .. prompts_per_step - 1` (GRPO's group of G samples)."""
    problem_id: str
    """Stable id of the problem, e.g. `arith-add-2d-s0-5`."""
    answer: str | None
    """Gold final answer as text, for the reward functions; None when the dataset has no answer column."""
    prompt_ids: list[int]
    """Prompt token ids `[prompt_len]` (chat template applied)."""
    completion_ids: list[int]
    """Sampled token ids `[completion_len]`, the EOS token or the stop sequence's tokens included when one ended it."""
    logprobs: list[float]
    """Inference logprobs `[completion_len]`: log-probability (nats) of each sampled token under the sampling
    temperature, as the engine computed it (used for truncated importance sampling, not as old logprobs)."""
    finish_reason: FinishReason
    """`eos` (the model's end-of-sequence token), `stop` (a stop sequence: `rollout.stop` or
    `rollout.stop_token_ids`), `length` (hit max_new_tokens) or `abort` (`lora_rl_core.engines.FinishReason`). A
    record written before `eos` existed says `stop` for an end-of-sequence."""
    adapter: str | None
    """Versioned adapter name that produced the completion (`<run>-v<NNNNNN>`); None = the base model."""
    adapter_version: int | None
    """Policy version of `adapter` (the training step that published it); None for the base model."""


class ScoredRollout(Rollout):
    """A `Rollout` with its reward and group-relative advantage."""

    reward: float
    """Weighted sum of the values the reward functions gave (0.0 when `skipped`)."""
    rewards: dict[str, float | None]
    """Each reward function's unweighted value, by name (None: it did not apply to this completion)."""
    skipped: bool = False
    """No reward function gave this completion a value: it is not trained on, and its group's advantages are
    computed without it."""
    advantage: float
    """Group-relative advantage of this completion (`algorithm.advantage`), broadcast over its tokens."""
    has_signal: bool
    """True when the rewards of its group are not all equal (the group carries a learning signal)."""


class RolloutBatch(Record):
    """Output of the rollout phase for one step (`rollouts/step-NNNNNN.json`)."""

    step: int
    """Training step the rollouts are for (sampled by the policy version `step - 1`)."""
    sampler: dict[str, int]
    """Prompt-sampler cursor after drawing this step's prompts (`{"epoch", "index", "seed"}`), for inspection;
    the cursor of a step is a function of the step, so resume does not need it."""
    rows: list[Rollout]
    """`prompts_per_step * group_size` rows, group by group."""


class ScoredBatch(Record):
    """Output of the score phase for one step (`scored/step-NNNNNN.json`)."""

    step: int
    rows: list[ScoredRollout]
    """The rollout rows in the same order, with rewards and advantages."""


@dataclass(frozen=True)
class BatchRules:
    """Which scored rows a train step uses (`TrainBatch.from_scored`): the `algorithm` section's rules, made once
    by the run's plan (`RunPlan.batch`), so the train phase reads these and not the section. No defaults: the
    config's are the only ones.

    Attributes:
        max_staleness: the most versions a row's policy may lag the trainer's (`algorithm.max_staleness`).
        skip_uniform: leave out groups whose rewards are all equal (`algorithm.skip_uniform_groups`).
        mask_truncated: completions cut at the token limit add no policy loss (`algorithm.truncation: mask`).
        critic_sees_truncated: such completions stay in the batch for the critic (`algorithm.advantage: gae`).
    """

    max_staleness: int
    skip_uniform: bool
    mask_truncated: bool
    critic_sees_truncated: bool


@dataclass
class TrainBatch:
    """Sequences to train on, one row per completion (what the trainer and its FSDP workers receive).

    Attributes:
        prompt_ids / completion_ids: token ids per row (lists of different lengths).
        advantages: one float per row (broadcast over its completion tokens).
        inference_logprobs: the engine's per-token logprobs of each completion, nats.
        stale_rejected: scored rows left out because their policy version was too old (`from_scored`).
        uniform_skipped: scored rows left out because their group had no reward signal (`from_scored`).
        reward_skipped: scored rows left out because no reward function scored them (`ScoredRollout.skipped`).
        truncated_masked: scored rows cut at the token limit (`algorithm.truncation: mask`), which add no policy
            loss; their rewards still counted in their groups' advantages. Left out of the batch, or, for the
            critic (`advantage: gae`), kept as `value_only` rows.
        version_lag: histogram of the scored rows' version lag (`step - 1 - adapter_version`), rejected rows
            included: `{lag: rows}`.
        rewards: each row's reward (the task's score), for the critic's per-token advantages (`advantage: gae`);
            empty in a batch made without them.
        value_only: per row, True where only the critic trains on it (a completion cut at the token limit under
            `truncation: mask` with `advantage: gae`); empty = the policy trains on every row.
    """

    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    advantages: list[float]
    inference_logprobs: list[list[float]]
    stale_rejected: int = 0
    uniform_skipped: int = 0
    reward_skipped: int = 0
    truncated_masked: int = 0
    version_lag: dict[int, int] = field(default_factory=dict)
    rewards: list[float] = field(default_factory=list)
    value_only: list[bool] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.completion_ids)

    def row_lengths(self) -> list[int]:
        """Each row's length in tokens (prompt + completion): what a forward over the row computes."""
        return [len(p) + len(c) for p, c in zip(self.prompt_ids, self.completion_ids, strict=True)]

    def trains_policy(self, row: int) -> bool:
        """Whether the policy's loss covers row `row` (every row but a `value_only` one)."""
        return not (self.value_only and self.value_only[row])

    def policy_rows(self) -> int:
        """How many rows the policy's loss covers."""
        return len(self) - sum(self.value_only)

    def select(self, rows: list[int]) -> TrainBatch:
        """The sub-batch of the given row indices."""
        return TrainBatch(
            [self.prompt_ids[i] for i in rows],
            [self.completion_ids[i] for i in rows],
            [self.advantages[i] for i in rows],
            [self.inference_logprobs[i] for i in rows],
            rewards=[self.rewards[i] for i in rows] if self.rewards else [],
            value_only=[self.value_only[i] for i in rows] if self.value_only else [],
        )

    @classmethod
    def from_scored(cls, rows: list[ScoredRollout], *, step: int, rules: BatchRules) -> TrainBatch:
        """The rows of step `step` that the update may use, by `rules` (its fields are named below).

        The trainer holds version `step - 1` when it trains step `step`. A row is stale, and rejected, when its
        policy version is more than `max_staleness` behind that (`step - 1 - adapter_version > max_staleness`),
        or when it came from the base model (no version). With `skip_uniform`, rows of groups whose rewards are
        all equal are left out: their advantages are zero, they would only dilute a token-mean loss
        (DAPO's dynamic sampling, Yu et al. 2025, filters them the same way). With `mask_truncated`
        (`algorithm.truncation: mask`), rows cut at the token limit add no loss and are left out too: a
        token-mean loss then averages over the other rows' tokens alone (TRL `mask_truncated_completions`); their
        advantages, and those of their groups, were computed with them. With `critic_sees_truncated` as well
        (`advantage: gae`), they stay in the batch as `value_only` rows: the critic's values and the whitened
        advantages are made with them, as a group's are, so that a baseline learned only from completions that
        ended would not hide that ending is worth more than being cut (docs/DESIGN.md, "PPO").
        """
        lagged = [(r, step - 1 - r.adapter_version) for r in rows if r.adapter_version is not None]
        fresh = [r for r, lag in lagged if lag <= rules.max_staleness]
        signal = [r for r in fresh if not r.skipped and (r.has_signal or not rules.skip_uniform)]
        cut = [rules.mask_truncated and r.finish_reason == "length" for r in signal]
        used = [r for r, c in zip(signal, cut, strict=True) if rules.critic_sees_truncated or not c]
        lags = Counter(lag for _, lag in lagged)
        return cls(
            [r.prompt_ids for r in used],
            [r.completion_ids for r in used],
            [r.advantage for r in used],
            [r.logprobs for r in used],
            stale_rejected=len(rows) - len(fresh),
            uniform_skipped=sum(1 for r in fresh if not r.skipped) - len(signal),
            reward_skipped=sum(1 for r in fresh if r.skipped),
            truncated_masked=sum(cut),
            version_lag=dict(sorted(lags.items())),
            rewards=[r.reward for r in used],
            value_only=cut if rules.critic_sees_truncated and any(cut) else [],
        )


class Stats(Record):
    """Base of the per-phase stats: `metrics()` is the flat dict for the step's metrics line."""

    def metrics(self) -> dict[str, Any]:
        """The record as a flat `{name: value}` dict."""
        return self.model_dump()


class RolloutStats(Stats):
    """What the rollout phase measured."""

    completions: int
    completion_tokens: int
    rollout_seconds: float
    """Wall time of the phase, seconds."""
    completions_per_second: float
    completion_length: float
    """Mean completion length, tokens."""
    truncated_fraction: float
    """Fraction of completions that hit `rollout.max_new_tokens`."""
    ended_fraction: float = 0.0
    """Share of completions that ended with end-of-sequence or a stop sequence (`finish_reason` `eos` or
    `stop`); 0.0 in a record persisted before it existed."""
    finish_reasons: dict[str, int] = {}
    """Completions by how they ended, `{"eos": n, "stop": n, "length": n}`; empty in an older record."""


class ScoreStats(Stats):
    """What the score phase measured."""

    reward_mean: float
    """Mean reward of the step's completions that a reward function scored."""
    reward_std: float
    """Population standard deviation of those rewards."""
    accuracy: float
    """Fraction of completions whose summed reward reaches `eval.pass_threshold`."""
    reward_terms: dict[str, float] = {}
    """Each reward function's mean over the completions it scored, by name (`rewards/<name>/mean`)."""
    skipped: int = 0
    """Completions no reward function scored."""
    groups_with_signal: float
    """Fraction of groups whose rewards differ."""
    score_seconds: float

    def metrics(self) -> dict[str, Any]:
        """The stats, each reward function's mean as `rewards/<name>/mean` (TRL's metric names)."""
        stats = self.model_dump()  # also for a record persisted before `reward_terms` existed (a resumed run)
        terms = stats.pop("reward_terms", None) or {}
        return {**stats, **{f"rewards/{name}/mean": value for name, value in terms.items()}}


class TrainStats(Stats):
    """What the update measured: the trainer's metrics plus the batch selection."""

    trainer: dict[str, float]
    """The trainer's metrics (loss, pg_loss, kl, entropy, clip_fraction, grad_norm, lr, ...)."""
    trained_rows: int
    stale_rejected: int
    uniform_skipped: int
    checkpointed: bool
    """True when this step saved a checkpoint (`trainer.checkpoint_every`)."""
    reward_skipped: int = 0
    """Rows no reward function scored (left out)."""
    truncated_masked: int = 0
    """Rows cut at the token limit and left out of the loss (`algorithm.truncation: mask`)."""
    version_lag: dict[int, int] = {}
    """Histogram of the step's completions by version lag, `{lag: completions}`: 0 = sampled by the version
    the trainer held (on-policy), 1 = one version older, ... (stale ones, dropped, included)."""
    update_seconds: float = 0.0
    """Wall seconds of the update as this process saw it: the trainer's own `train_seconds` plus, for trainer
    ranks, the batch going to them and their answers coming back."""
    snapshot_seconds: float = 0.0
    """Wall seconds taking the step's checkpoint (copies of the LoRA weights, AdamW state and RNG states from the
    trainer or its rank 0) before the writer stores it in the background; 0 without a checkpoint."""

    def metrics(self) -> dict[str, Any]:
        """The trainer's metrics at the top level, with the selection counts."""
        return {**self.trainer, **self.model_dump(exclude={"trainer"})}


class SyncStats(Stats):
    """What syncing a version to the engines did."""

    adapter: str
    """The adapter rollouts use after the sync (the new version, or the previous one if the new one failed)."""
    retired: list[str] = []
    """Older versions unloaded from the engines."""
    sync_seconds: float = 0.0
    sync_path: str | None = None
    """`tensor` (in-memory tensors) or `store` (engines read the verified version from the store)."""
    skipped: str | None = None
    """A version that failed to load and was skipped (the previous one keeps serving)."""
    error: str | None = None
    """Why `skipped` failed."""
    skipped_older: bool = False
    """True when the version was older than the one already serving (a replayed sync), so nothing changed."""


class ResumeInfo(Record):
    """Where a run starts in this process (`lora_rl_core.run.resume.restore`)."""

    run_id: str
    restored_step: int
    """Step of the checkpoint the trainer was restored from; 0 when starting fresh."""
    policy_version: int | None
    """Adapter version the engines serve after restoring; None before version 0 is published."""
    runtime: dict[str, Any]
    """Device, dtype and why, CPU threads (the run plan's summary, `lora_rl_core.plan.RunPlan.summary`)."""
    store_uri: str
    """The adapter store's root as an absolute URI, where the run's versions are published."""
    rollouts_ahead: int = 0
    """Steps ahead of the training step that rollouts run (`RunPlan.rollouts_ahead`: `rollout.mode` resolved)."""
