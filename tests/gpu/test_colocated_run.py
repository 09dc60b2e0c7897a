"""A colocated run on two GPUs (issue 33, item 6): two FSDP2 trainer ranks and two SGLang servers (one per
GPU, data parallel) on the same GPUs (`placement: colocated`), three steps through the library's step loop. Versions 1-3
are published to the store, and after each step SGLang lists that version and completes requests under its
name on both servers (one group each). No process is left on a GPU afterwards.

    LORA_RL_SGLANG_MODEL=/tmp/models/smollm2-random LORA_RL_SGLANG_PYTHONPATH=/tmp/sglsite \
        python -m pytest -m gpu tests/gpu/test_colocated_run.py      # skipped without 2 GPUs and SGLang
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch

from lora_rl_core.adapters import adapter_name
from lora_rl_core.config import load_config
from lora_rl_core.engines.base import GenerationRequest, SamplingParams
from lora_rl_core.run import open_run
from lora_rl_core.run.loop import RunPhases, run_steps

MODEL = os.environ.get("LORA_RL_SGLANG_MODEL", "")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2 or not MODEL, reason="needs 2 GPUs and LORA_RL_SGLANG_MODEL"),
]
GREEDY = SamplingParams(max_new_tokens=8, temperature=0.0)


def gpu_processes() -> list[int]:
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"], capture_output=True)
    return [int(p) for p in out.stdout.decode().split()]


def test_a_colocated_two_gpu_run_publishes_and_serves_each_version(tmp_path: Path):
    env = {"PYTHONPATH": os.environ["LORA_RL_SGLANG_PYTHONPATH"]} if os.environ.get("LORA_RL_SGLANG_PYTHONPATH") else {}
    cfg = load_config(
        None,
        [
            f"model.name_or_path={MODEL}",
            "model.device=cuda",
            "lora.target_modules=[q_proj, v_proj]",
            "rollout.prompts_per_step=8",
            "rollout.group_size=4",
            "rollout.max_new_tokens=32",
            "trainer.steps=3",
            "algorithm.skip_uniform_groups=false",  # random weights score 0: train on every row anyway
            "engine.type=sglang",
            "engine.launch.enabled=true",
            "engine.launch.cuda_graph_max_bs=null",
            f"engine.launch.env={env}",
            "placement={type: colocated, gpus: [0, 1]}",
            f"run.output_dir={tmp_path}",
            f"store.uri=file://{tmp_path}/store",
        ],
    )
    before = set(gpu_processes())
    run = open_run(cfg, "colocated")
    try:
        assert run.plan.trainer is not None and run.plan.trainer.world_size == 2
        assert run.plan.engine.launch is not None and run.plan.engine.launch.servers == 2
        assert run.plan.engine.tensor_transport == "file"
        prompt = run.inputs.tokenizer("What is 2 + 3?")["input_ids"]
        served: dict[int, list[int]] = {}  # step -> a completion under that step's version

        def on_step(metrics: dict) -> None:
            name = adapter_name(run.run_id, metrics["step"])
            assert name in run.engine.list_adapters()
            # both servers have the version: four groups, dealt two per server
            requests = [GenerationRequest(list(prompt) + [i], name, GREEDY) for i in range(4)]
            done = run.engine.generate(requests)
            assert all(c.finish_reason in ("stop", "length") and c.completion_ids for c in done)
            served[metrics["step"]] = done[0].completion_ids

        with RunPhases(run) as phases:
            run_steps(phases, steps=3, ahead=run.plan.rollouts_ahead(), on_step=on_step)
        assert sorted(served) == [1, 2, 3]
        assert run.store.versions(run.run_id) == [0, 1, 2, 3]  # 0: the initial adapter
    finally:
        run.close()
    assert not set(gpu_processes()) - before, "a trainer rank or SGLang worker outlived the run"
