"""A run that fails at step k and is resumed equals an uninterrupted run, without recomputing earlier steps."""

from __future__ import annotations

import pytest
import torch

from lora_rl_core.faults import InjectedFault
from lora_rl_core.run import phases
from lora_rl_core.store import AdapterStore
from tests.integration.tiny_run import write_tiny_config

pytestmark = pytest.mark.slow  # the flow under the Prefect test server


def _write_config(tmp_path, tiny_model_dir, run_id: str):
    return str(
        write_tiny_config(
            tmp_path,
            tiny_model_dir,
            run_id,
            run={"id": run_id, "eval_before_after": False},
            rollout={"max_new_tokens": 6},
            trainer={"steps": 4},
            data={"train_size": 32},
        )
    )


def test_killed_and_resumed_run_equals_uninterrupted_run(tmp_path, tiny_model_dir, monkeypatch):
    from flows.grpo_lora import train

    executed: list[tuple[str, int]] = []
    for phase, name in (("rollout", "rollout"), ("train", "train_step")):
        original = getattr(phases, phase)

        def traced(run, step, _original=original, _name=name):
            executed.append((_name, step))
            return _original(run, step)

        monkeypatch.setattr(phases, phase, traced)

    train(config_path=_write_config(tmp_path, tiny_model_dir, "straight"))
    executed.clear()

    monkeypatch.setenv("LORA_RL_FAULT", "train_step:3")
    resumed_cfg = _write_config(tmp_path, tiny_model_dir, "resumed")
    with pytest.raises(InjectedFault):
        train(config_path=resumed_cfg)
    assert ("train_step", 3) in executed
    executed.clear()
    train(config_path=resumed_cfg)  # a new flow run with the same run id resumes it
    # steps 1-2 come from the cache and the step-2 checkpoint; step 3's rollout was cached before the fault
    assert executed == [("train_step", 3), ("rollout", 4), ("train_step", 4)]

    store = AdapterStore(f"file://{tmp_path / 'store'}")
    assert store.versions("resumed") == store.versions("straight") == [0, 1, 2, 3, 4]
    straight, _ = store.load_tensors("straight", 4)
    resumed, _ = store.load_tensors("resumed", 4)
    assert straight.keys() == resumed.keys()
    for key in straight:
        torch.testing.assert_close(resumed[key], straight[key], atol=1e-5, rtol=1e-4)
    assert any(not torch.equal(straight[k], store.load_tensors("straight", 1)[0][k]) for k in straight)
