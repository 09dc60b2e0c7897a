"""`rollout.mode: async`: the next step's rollout is generated while a step trains, with the version current
when it starts; every completion keeps its version; the trainer corrects the lag; a crash during overlapped
steps resumes from the rollouts that ran ahead."""

from __future__ import annotations

import functools
import json
import threading

import pytest

from lora_rl_core.faults import InjectedFault
from lora_rl_core.run import phases
from lora_rl_core.store import AdapterStore
from tests.integration.tiny_run import write_tiny_config

pytestmark = pytest.mark.slow  # the flow under the Prefect test server


def _config(tmp_path, tiny_model_dir, run_id: str, **algorithm) -> str:
    return str(
        write_tiny_config(
            tmp_path,
            tiny_model_dir,
            run_id,
            run={"id": run_id, "eval_before_after": False},
            rollout={"max_new_tokens": 6, "mode": "async"},
            algorithm={"skip_uniform_groups": False, "max_staleness": 1, **algorithm},
            trainer={"steps": 4, "checkpoint_every": 1},
            data={"train_size": 32},
        )
    )


def _rows(tmp_path, run_id: str, step: int) -> list[dict]:
    path = tmp_path / "store" / run_id / "rollouts" / f"step-{step:06d}.json"
    return json.loads(path.read_text())["rows"]


@pytest.fixture
def traced(monkeypatch):
    """(phase, step, thread name, start s, end s) of every rollout and train phase that ran (not the train
    phases of a resumed run's restored steps, which replay their recorded stats)."""
    import time

    calls: list[tuple[str, int, str, float, float]] = []
    for phase, name in (("rollout", "rollout"), ("train", "train")):
        original = getattr(phases, phase)

        @functools.wraps(original)  # the flow's task of the same name runs it
        def wrapped(run, step, _original=original, _name=name):
            start = time.perf_counter()
            try:
                return _original(run, step)
            finally:
                if _name == "rollout" or step > run.restored.step:
                    calls.append((_name, step, threading.current_thread().name, start, time.perf_counter()))

        monkeypatch.setattr(phases, phase, wrapped)
    return calls


def test_async_rollouts_overlap_training_and_keep_their_versions(tmp_path, tiny_model_dir, traced):
    from flows.grpo_lora import train

    summary = train(config_path=_config(tmp_path, tiny_model_dir, "async"))

    assert AdapterStore(f"file://{tmp_path / 'store'}").versions("async") == [0, 1, 2, 3, 4]
    # Steps 1 and 2 were submitted together, before any update: both sample with version 0. Step k + 1 is
    # submitted when step k starts, so it samples with version k - 1 (or k if it starts after the sync).
    versions = {step: {r["adapter_version"] for r in _rows(tmp_path, "async", step)} for step in range(1, 5)}
    assert versions[1] == versions[2] == {0}
    for step in (3, 4):
        assert versions[step] <= {step - 2, step - 1}
    # Rollouts ran on the task runner's threads, and at least one of them while a step trained.
    rollouts = [c for c in traced if c[0] == "rollout"]
    trains = [c for c in traced if c[0] == "train"]
    assert len(rollouts) == 4 and all(c[2] != threading.main_thread().name for c in rollouts)
    assert any(r[3] < t[4] and t[3] < r[4] for r in rollouts for t in trains if r[1] == t[1] + 1)

    history = {row["step"]: row for row in json.loads((tmp_path / "runs" / "async" / "history.json").read_text())}
    assert history[2]["version_lag"] == {"1": 8}  # 2 prompts x 4 samples, all one version behind
    for row in history.values():
        assert row["stale_rejected"] == 0 and row["trained_rows"] == 8
        assert set(row["version_lag"]) <= {"0", "1"}
        # async mode's default correction: token-level truncated importance weights (is_cap 2)
        assert 0.0 < row["is_weight_mean"] <= row["is_weight_max"] <= 2.0 and row["is_masked_fraction"] == 0.0
    assert summary["final_adapter"] == "async-v000004"
    assert all(sum(row["finish_reasons"].values()) == 8 for row in history.values())
    # not evaluated (run.eval_before_after: false): still the final adapter's greedy completions of 4 problems
    preview = summary["final_preview"]
    assert (preview["adapter"], preview["n"], len(preview["samples"])) == ("async-v000004", 4, 4)
    assert all(s["tokens"] <= 6 and s["finish_reason"] in {"eos", "stop", "length"} for s in preview["samples"])
    report = (tmp_path / "runs" / "async" / "report.md").read_text()
    section = report.split("## Greedy completions after training (held-out)\n\n", 1)[1]
    assert section.startswith("Not evaluated") and section.count("- **Q:**") == 4


def test_a_masking_correction_reports_what_it_masked(tmp_path, tiny_model_dir):
    from flows.grpo_lora import train

    # a geometric-mean range that excludes every sequence: the whole batch is masked, the update is zero
    train(
        config_path=_config(
            tmp_path,
            tiny_model_dir,
            "masked",
            off_policy_correction={"type": "geometric-mask", "geo_mask_low": 5.0, "geo_mask_high": 6.0},
        )  # fmt: skip
    )
    history = json.loads((tmp_path / "runs" / "masked" / "history.json").read_text())
    assert [row["is_masked_fraction"] for row in history] == [1.0, 1.0, 1.0, 1.0]
    assert all(row["is_weight_max"] == 0.0 and row["grad_norm"] == 0.0 for row in history)


def test_a_crash_during_overlapped_steps_resumes_from_the_rollouts_that_ran_ahead(
    tmp_path, tiny_model_dir, traced, monkeypatch
):
    """Train step 3 fails while step 4's rollout runs (it was submitted when step 3 started). The failing
    flow lets that rollout finish, so its completions (sampled with version 2) persist; the resumed run
    takes steps 1-4's rollouts from Prefect's cache (none is sampled again, none with a newer version),
    restores the trainer from the step-2 checkpoint and trains steps 3 and 4."""
    from flows.grpo_lora import train

    config = _config(tmp_path, tiny_model_dir, "crash")
    monkeypatch.setenv("LORA_RL_FAULT", "train:3")
    with pytest.raises(InjectedFault):
        train(config_path=config)
    assert sorted((c[0], c[1]) for c in traced if c[0] == "rollout") == [("rollout", s) for s in (1, 2, 3, 4)]
    store = AdapterStore(f"file://{tmp_path / 'store'}")
    assert store.versions("crash") == [0, 1, 2]
    before = _rows(tmp_path, "crash", 4)
    assert {r["adapter_version"] for r in before} == {2}  # version 2 was serving when step 3 started

    traced.clear()
    train(config_path=config)  # a new flow run with the same run id resumes it
    assert [(c[0], c[1]) for c in traced] == [("train", 3), ("train", 4)]
    assert _rows(tmp_path, "crash", 4) == before
    assert store.versions("crash") == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("retire", ["unload", "keep"])
def test_async_rollouts_against_a_launched_sglang(tmp_path, tiny_model_dir, retire):
    """The same overlap through `SGLangEngine` (HTTP from the task runner's thread while the flow syncs),
    against the look-alike SGLang server the run launches, with both retire policies."""
    from flows.grpo_lora import train
    from lora_rl_testing.fake_launch import fake_launch

    path = write_tiny_config(
        tmp_path,
        tiny_model_dir,
        "async-sgl",
        run={"id": "async-sgl", "eval_before_after": False},
        rollout={"max_new_tokens": 6, "mode": "async"},
        algorithm={"skip_uniform_groups": False, "max_staleness": 1},
        trainer={"steps": 4},
        engine={
            "type": "sglang",
            "sync": "store",
            "sglang_retire": retire,
            "launch": fake_launch(),
        },
    )
    summary = train(config_path=str(path))
    assert summary["final_adapter"] == "async-sgl-v000004"
    history = json.loads((tmp_path / "runs" / "async-sgl" / "history.json").read_text())
    assert history[1]["version_lag"] == {"1": 8}
    assert all(row["stale_rejected"] == 0 and set(row["version_lag"]) <= {"0", "1"} for row in history)
