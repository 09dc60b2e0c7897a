"""Typed phase records and the run's files: the staleness and uniform-group rules of `TrainBatch.from_scored`,
and `RunDir` reading back (and refusing) phase files through retried store I/O."""

from __future__ import annotations

import fsspec
import pytest

from lora_rl_core.errors import LoraRLError, StoreError
from lora_rl_core.faults import maybe_fail
from lora_rl_core.records import BatchRules, Rollout, RolloutBatch, ScoredBatch, ScoredRollout, TrainBatch
from lora_rl_core.run.rundir import RunDir
from tests.unit.test_store_faults import FAST, FlakyFS


def scored(version: int | None, *, group: int = 0, advantage: float = 0.5, signal: bool = True) -> ScoredRollout:
    """A scored row sampled by adapter `version` (None = the base model)."""
    return ScoredRollout(
        group=group,
        problem_id=f"p{group}",
        answer="3",
        prompt_ids=[1, 2],
        completion_ids=[3, 4, version or 0],
        logprobs=[-0.1, -0.2, -0.3],
        finish_reason="stop",
        adapter=None if version is None else f"run-v{version:06d}",
        adapter_version=version,
        reward=1.0,
        rewards={"math": 1.0},
        advantage=advantage,
        has_signal=signal,
    )


def test_from_scored_rejects_rows_more_than_max_staleness_behind():
    # step 5: the trainer holds version 4; max_staleness 1 keeps versions 3 and 4
    rows = [scored(4), scored(3), scored(2), scored(None), scored(5)]
    batch = TrainBatch.from_scored(
        rows,
        step=5,
        rules=BatchRules(max_staleness=1, skip_uniform=False, mask_truncated=False, critic_sees_truncated=False),
    )
    assert [c[-1] for c in batch.completion_ids] == [4, 3, 5]  # 5 is newer than the trainer: not stale
    assert batch.stale_rejected == 2 and batch.uniform_skipped == 0
    strict = TrainBatch.from_scored(
        rows,
        step=5,
        rules=BatchRules(max_staleness=0, skip_uniform=False, mask_truncated=False, critic_sees_truncated=False),
    )
    assert [c[-1] for c in strict.completion_ids] == [4, 5] and strict.stale_rejected == 3
    # the lag histogram counts every versioned row, the rejected ones too (base-model rows have no version)
    assert batch.version_lag == {-1: 1, 0: 1, 1: 1, 2: 1}


def test_from_scored_skips_groups_without_signal_only_when_asked():
    rows = [scored(1, group=0, advantage=1.0), scored(1, group=1, advantage=0.0, signal=False)]
    kept = TrainBatch.from_scored(
        rows,
        step=2,
        rules=BatchRules(max_staleness=1, skip_uniform=True, mask_truncated=False, critic_sees_truncated=False),
    )
    assert kept.advantages == [1.0] and kept.uniform_skipped == 1 and kept.stale_rejected == 0
    everything = TrainBatch.from_scored(
        rows,
        step=2,
        rules=BatchRules(max_staleness=1, skip_uniform=False, mask_truncated=False, critic_sees_truncated=False),
    )
    assert everything.advantages == [1.0, 0.0] and everything.uniform_skipped == 0
    assert everything.prompt_ids == [[1, 2], [1, 2]] and everything.inference_logprobs[0] == [-0.1, -0.2, -0.3]


def test_from_scored_counts_stale_before_uniform():
    rows = [scored(0, signal=False), scored(3, signal=False), scored(3)]
    batch = TrainBatch.from_scored(
        rows,
        step=4,
        rules=BatchRules(max_staleness=1, skip_uniform=True, mask_truncated=False, critic_sees_truncated=False),
    )
    assert len(batch) == 1 and batch.stale_rejected == 1 and batch.uniform_skipped == 1


def test_phase_round_trip_and_missing_phase(memory_root):
    run_dir = RunDir(memory_root, "r1")
    rows = [Rollout(**scored(2).model_dump(include=set(Rollout.model_fields)))]
    run_dir.write_phase("rollouts", 3, RolloutBatch(step=3, sampler={"epoch": 0, "index": 8, "seed": 0}, rows=rows))
    back = run_dir.read_phase("rollouts", 3, RolloutBatch)
    assert back.rows == rows and back.step == 3
    with pytest.raises(LoraRLError, match=r"scored output of step 3 not found at memory://.*/r1/scored/step-000003"):
        run_dir.read_phase("scored", 3, ScoredBatch)


def test_a_damaged_phase_file_names_the_field_and_the_fix(memory_root):
    run_dir = RunDir(memory_root, "r1")
    fs, path = fsspec.core.url_to_fs(f"{memory_root}/r1/scored/step-000002.json")
    fs.pipe_file(path, b'{"step": 2, "rows": [{"group": 0}]}')
    with pytest.raises(LoraRLError, match=r"step-000002.json is not a valid ScoredBatch \(rows.0.problem_id: Field "):
        run_dir.read_phase("scored", 2, ScoredBatch)
    fs.pipe_file(path, b"{truncated")
    with pytest.raises(LoraRLError, match="delete it and re-run the scored phase of step 2"):
        run_dir.read_phase("scored", 2, ScoredBatch)


def test_phase_writes_are_retried_on_transient_store_errors(memory_root):
    flaky = FlakyFS(fsspec.filesystem("memory"), methods={"pipe_file"}, failures=2, error=lambda: TimeoutError("slow"))
    run_dir = RunDir(memory_root, "r1", retry=FAST, fs=flaky)
    run_dir.write_phase("scored", 1, ScoredBatch(step=1, rows=[scored(0)]))
    assert len(flaky.injected) == 2
    assert RunDir(memory_root, "r1").read_phase("scored", 1, ScoredBatch).rows == [scored(0)]


def test_config_snapshot_round_trip(memory_root):
    run_dir = RunDir(memory_root, "r1")
    assert run_dir.read_config() is None
    run_dir.write_config({"lr": 1e-4, "tags": {"b", "a"}, "betas": (0.9, 0.99)})
    assert run_dir.read_config() == {"lr": 1e-4, "tags": ["a", "b"], "betas": [0.9, 0.99]}
    with pytest.raises(StoreError, match="cannot write run.json of run r1 as JSON"):
        run_dir.write_config({"bad": object()})


def test_fault_markers_fire_once_per_run(memory_root, monkeypatch):
    monkeypatch.setenv("LORA_RL_FAULT", "score:2")
    run_dir = RunDir(memory_root, "r1")
    maybe_fail("score", 1, run_dir)  # not this step
    with pytest.raises(RuntimeError, match="injected fault at score step 2"):
        maybe_fail("score", 2, run_dir)
    maybe_fail("score", 2, run_dir)  # a retried flow run goes past it
    assert run_dir.mark("faults/score-000002") is False


def test_score_stats_persisted_before_reward_terms_still_give_their_metrics():
    """A resumed run reads back (from Prefect's cache) a ScoreStats written before `reward_terms` existed."""
    from lora_rl_core.records import ScoreStats

    old = ScoreStats.model_construct(
        reward_mean=0.5, reward_std=0.1, accuracy=0.25, groups_with_signal=1.0, score_seconds=0.2
    )
    old.__dict__.pop("reward_terms", None)
    metrics = old.metrics()
    assert metrics["reward_mean"] == 0.5 and not any(k.startswith("rewards/") for k in metrics)
    new = ScoreStats(**{**metrics, "reward_terms": {"math": 0.25}})
    assert new.metrics()["rewards/math/mean"] == 0.25


def test_rollout_stats_count_how_completions_ended():
    """`eos` and `stop` ended, `length` was cut: the shares and the count of each on hand-counted rows."""
    from lora_rl_core.run.step import rollout_stats

    def row(reason: str, tokens: int) -> Rollout:
        return Rollout(
            group=0, problem_id="p0", answer="3", prompt_ids=[1], completion_ids=[7] * tokens,
            logprobs=[-0.1] * tokens, finish_reason=reason, adapter="run-v000000", adapter_version=0,
        )  # fmt: skip

    rows = [row("eos", 2), row("eos", 4), row("stop", 6), row("length", 8), row("length", 8)]
    stats = rollout_stats(RolloutBatch(step=1, sampler={}, rows=rows), seconds=2.0)
    assert stats.finish_reasons == {"eos": 2, "stop": 1, "length": 2}
    assert (stats.ended_fraction, stats.truncated_fraction) == (pytest.approx(0.6), pytest.approx(0.4))
    assert (stats.completion_length, stats.completions_per_second) == (pytest.approx(5.6), pytest.approx(2.5))


def test_rollout_stats_persisted_before_the_finish_reasons_still_load():
    """A resumed run reads back a RolloutStats written before `ended_fraction` and `finish_reasons` existed."""
    from lora_rl_core.records import RolloutStats

    fields = {"completions": 4, "completion_tokens": 8, "rollout_seconds": 1.0, "completions_per_second": 4.0,
              "completion_length": 2.0, "truncated_fraction": 0.25}  # fmt: skip
    stats = RolloutStats.model_validate(fields)
    assert (stats.ended_fraction, stats.finish_reasons) == (0.0, {})
    old = RolloutStats.model_construct(**fields)
    old.__dict__.pop("ended_fraction"), old.__dict__.pop("finish_reasons")
    assert old.metrics() == fields
