"""Compiled decoder layers (`trainer.torch_compile`) change the trainer's speed, not its numbers.

A small random Qwen2 in bfloat16 on the GPU, the same LoRA init twice: one copy with each decoder layer
compiled (`lora_rl_core.trainer.kernels.compile_layers`: Inductor, dynamic shapes), one eager. The completion
logprobs agree to bfloat16 precision, and two PPO steps on batches of other lengths (a new sequence length must
not need a new graph per length) give the same loss, grad norm and LoRA update. Needs CUDA."""

from __future__ import annotations

import pytest
import torch

from lora_rl_testing.gpu_trainers import completion_logprobs, lora_weights, mixed_batch, qwen2_trainer

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]


def test_compiled_layers_give_the_same_logprobs_and_updates():
    batches = [mixed_batch(seed) for seed in (2, 3)]
    eager = qwen2_trainer()
    lp_eager = completion_logprobs(eager, batches[0])
    m_eager = [eager.train_step(rows) for rows in batches]
    weights = lora_weights(eager)
    compiled = qwen2_trainer(compiled=True)
    lp_compiled = completion_logprobs(compiled, batches[0])
    assert lp_compiled.shape == lp_eager.shape
    assert torch.allclose(lp_compiled, lp_eager, atol=0.05), (lp_compiled - lp_eager).abs().max()
    m_compiled = [compiled.train_step(rows) for rows in batches]
    for got, want in zip(m_compiled, m_eager, strict=True):
        assert got["loss"] == pytest.approx(want["loss"], abs=0.02)
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=0.05)
    for name, p in compiled.model.named_parameters():
        if "lora_" in name:
            assert torch.allclose(p, weights[name], atol=4e-4), (name, (p - weights[name]).abs().max())
    fresh = lora_weights(qwen2_trainer())
    assert any(not torch.equal(w, fresh[n]) for n, w in weights.items())  # the steps did move the weights
