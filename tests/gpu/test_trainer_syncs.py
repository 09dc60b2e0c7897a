"""A minibatch's micro-batches queue on the GPU without our code waiting for them: nothing in a micro-batch's
loss, metrics or backward reads a value back to the host (a device sync), and the batches were sent before the
first forward (`PolicyTrainer._minibatch_update`). The one sync left per forward is transformers' own check of the
padding mask. CUDA's sync debug mode reports every sync as a warning; they are counted per micro-batch. Needs
CUDA."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from lora_rl_core.trainer import PolicyTrainer
from lora_rl_testing.gpu_trainers import mixed_batch, qwen2_trainer

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]


def test_at_most_one_device_sync_per_micro_batch(monkeypatch):
    original = PolicyTrainer._micro_backward
    syncs: list[int] = []

    def counted(self, *args, **kwargs):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                return original(self, *args, **kwargs)
            finally:
                torch.cuda.set_sync_debug_mode("default")
                syncs.append(sum("synchronizing" in str(w.message) for w in caught))

    monkeypatch.setattr(PolicyTrainer, "_micro_backward", counted)
    trainer = qwen2_trainer(micro_batch_size=2)
    metrics = trainer.train_step(mixed_batch())
    assert len(syncs) == 4  # 8 rows in micro-batches of 2
    assert max(syncs) <= 1, f"device syncs per micro-batch: {syncs} (one is transformers' padding-mask check)"
    assert math.isfinite(metrics["loss"]) and metrics["grad_norm"] > 0 and metrics["entropy"] > 0
