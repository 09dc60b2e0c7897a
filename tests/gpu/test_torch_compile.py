"""Compiled decoder layers (`trainer.torch_compile`) change the trainer's speed, not its numbers.

A small random Qwen2 in bfloat16 on the GPU, the same LoRA init twice: one copy with each decoder layer
compiled (`lora_rl_core.trainer.kernels.compile_layers`: Inductor, dynamic shapes), one eager. The completion
logprobs agree to bfloat16 precision, and two PPO steps on batches of other lengths (a new sequence length needs
no new graph) give the same loss, grad norm and LoRA gradients. `PolicyTrainer.close` stops the compile workers
Inductor started. Needs CUDA."""

from __future__ import annotations

import pytest
import torch

from lora_rl_testing.gpu_trainers import assert_same_update, completion_logprobs, mixed_batch, qwen2_trainer

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]


def test_compiled_layers_give_the_same_logprobs_and_updates():
    batches = [mixed_batch(seed) for seed in (2, 3)]
    eager, compiled = qwen2_trainer(), qwen2_trainer(compiled=True)
    try:
        lp_eager, lp_compiled = completion_logprobs(eager, batches[0]), completion_logprobs(compiled, batches[0])
        assert lp_compiled.shape == lp_eager.shape
        assert torch.allclose(lp_compiled, lp_eager, atol=0.05), (lp_compiled - lp_eager).abs().max()
        for rows in batches:
            want, got = eager.train_step(rows), compiled.train_step(rows)
            assert got["loss"] == pytest.approx(want["loss"], abs=0.02)
            assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=0.05)
            assert_same_update(compiled, eager)
    finally:
        compiled.close()  # Inductor's compile workers stop with the trainer (the test fails if any outlive it)
