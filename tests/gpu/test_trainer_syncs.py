"""A minibatch's micro-batches queue on the GPU without waiting for each other: nothing in a micro-batch's
forward, loss, metrics or backward reads a value back to the host (a device sync), so the host launches the next
micro-batch while the GPU still runs the last (`PolicyTrainer._minibatch_update`). CUDA's sync debug mode turns
any sync inside a micro-batch into an error. Needs CUDA."""

from __future__ import annotations

import math

import pytest
import torch

from lora_rl_core.trainer import PolicyTrainer
from lora_rl_testing.gpu_trainers import mixed_batch, qwen2_trainer

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]


def test_no_device_sync_inside_a_micro_batch(monkeypatch):
    original = PolicyTrainer._micro_backward
    calls = []

    def strict(self, *args, **kwargs):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return original(self, *args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode("default")
            calls.append(1)

    monkeypatch.setattr(PolicyTrainer, "_micro_backward", strict)
    trainer = qwen2_trainer(micro_batch_size=2)
    metrics = trainer.train_step(mixed_batch())
    assert len(calls) == 4  # 8 rows in micro-batches of 2
    assert math.isfinite(metrics["loss"]) and metrics["grad_norm"] > 0 and 0 < metrics["entropy"]
