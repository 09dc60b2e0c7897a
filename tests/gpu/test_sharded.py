"""FSDP2 on two GPUs (NCCL, bfloat16) against one GPU on the same batches (issue 33, item 6).

The same config and batches as the CPU test (`tests/unit/test_distributed.py`: two minibatches, KL to the
reference, TIS, one-row micro-batches, a rank without rows, clipping active), on CUDA with bfloat16 base
weights and the plan's bfloat16 LoRA compute: in one process on `cuda:0` (autocast), and as two NCCL ranks
(FSDP2 mixed precision: bfloat16 parameters, float32 gradient reduction). bfloat16 sums in another order, so
the check is bf16 tolerance: metrics within 2 %, and the LoRA update (after - before) within 5 % of its norm.

    python -m pytest -m gpu tests/gpu/test_sharded.py       # skipped without 2 GPUs
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from lora_rl_core.config import InProcessBackend, LocalBackend, RunConfig
from lora_rl_core.lora import adapter_state, apply_lora
from lora_rl_core.models import load_model
from lora_rl_core.plan import make_plan
from lora_rl_core.trainer import PolicyTrainer, TrainerPlan
from lora_rl_core.trainer.workers import TrainerWorkers
from tests.unit.test_distributed import BATCHES, make_config

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"),
]
CHECKED = ("loss", "pg_loss", "kl", "grad_norm")


def cuda_config(model_dir) -> RunConfig:
    return make_config(model_dir, dtype="bfloat16", device="cuda:0")


def plan_for(cfg: RunConfig, ranks: int) -> TrainerPlan:
    backend = LocalBackend(world_size=ranks, device="cuda") if ranks else InProcessBackend()
    plan = make_plan(cfg.model_copy(update={"trainer": cfg.trainer.model_copy(update={"backend": backend})})).trainer
    assert plan is not None and plan.lora_compute_dtype == "bfloat16" and plan.dtype == "bfloat16"
    return plan


def one_gpu_trainer(cfg: RunConfig) -> PolicyTrainer:
    model, tokenizer = load_model(cfg.model, device="cuda:0", dtype="bfloat16")
    torch.manual_seed(cfg.run.seed)  # as build_sharded_trainer does
    return PolicyTrainer(apply_lora(model, cfg.lora), plan_for(cfg, 0), pad_id=tokenizer.pad_token_id)


def relative_gap(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], start: dict[str, torch.Tensor]) -> float:
    """|| (got - start) - (want - start) || / || want - start || over every LoRA tensor (the update's error)."""
    num = sum(float((got[k].float().cpu() - want[k].float().cpu()).norm() ** 2) for k in want)
    den = sum(float((want[k].float().cpu() - start[k].float().cpu()).norm() ** 2) for k in want)
    return (num / den) ** 0.5


@pytest.fixture(scope="module")
def cfg(tiny_model_dir) -> RunConfig:
    return cuda_config(tiny_model_dir)


@pytest.fixture(scope="module")
def two_ranks(cfg) -> Iterator[TrainerWorkers]:
    with TrainerWorkers(plan_for(cfg, 2), timeout_s=300) as workers:
        yield workers


def test_two_gpu_step_equals_one_gpu_step(cfg, two_ranks):
    single = one_gpu_trainer(cfg)
    initial = single.state_dict()
    start, _ = adapter_state(single.model)
    two_ranks.load_state_dict(initial)
    for batch in BATCHES:
        want = single.train_step(batch)
        got = two_ranks.train_step(batch)
        for key in CHECKED:
            assert got[key] == pytest.approx(want[key], rel=2e-2, abs=2e-4), (key, got[key], want[key])
        assert got["train_tokens"] == want["train_tokens"]
    want_adapter, want_config = adapter_state(single.model)
    got_adapter, got_config = two_ranks.adapter_state()
    assert got_config == want_config
    assert relative_gap(got_adapter, want_adapter, start) < 0.05


def test_a_two_rank_checkpoint_resumes_on_one_gpu(cfg, two_ranks):
    single = one_gpu_trainer(cfg)
    two_ranks.load_state_dict(single.state_dict())
    for batch in BATCHES[:2]:
        two_ranks.train_step(batch)
    saved = two_ranks.state_dict()  # written by 2 ranks
    assert saved["meta"]["world_size"] == 2
    before, _ = two_ranks.adapter_state()
    want = two_ranks.train_step(BATCHES[2])
    want_adapter, _ = two_ranks.adapter_state()
    resumed = one_gpu_trainer(cfg)  # a fresh trainer without optimizer state
    resumed.load_state_dict(saved)
    got = resumed.train_step(BATCHES[2])
    for key in CHECKED:
        assert got[key] == pytest.approx(want[key], rel=2e-2, abs=2e-4), (key, got[key], want[key])
    assert relative_gap(adapter_state(resumed.model)[0], want_adapter, before) < 0.05
