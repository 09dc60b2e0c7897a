"""Liger's fused kernels (`trainer.liger_kernels`) change the trainer's speed, not its numbers.

A small random Qwen2 in bfloat16 on the GPU, the same LoRA init twice: one copy patched with Liger's RMSNorm
and SwiGLU kernels (`lora_rl_core.trainer.kernels.apply_kernels`), one not. The completion logprobs
agree to bfloat16 precision, and one PPO step gives the same loss and LoRA gradients. Needs CUDA and
`liger-kernel` (the `gpu` extra)."""

from __future__ import annotations

import pytest
import torch

from lora_rl_core.trainer import PolicyTrainer
from lora_rl_core.trainer.kernels import liger_model_types
from lora_rl_testing.gpu_trainers import assert_same_update, completion_logprobs, mixed_batch, qwen2_trainer


def _liger_families() -> frozenset[str]:
    try:
        return liger_model_types()
    except ImportError:
        return frozenset()


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not (torch.cuda.is_available() and "qwen2" in _liger_families()), reason="needs a GPU and liger-kernel"
    ),
]


def liger_modules(trainer: PolicyTrainer) -> int:
    """Modules running a Liger forward: the MLPs (renamed `LigerSwiGLUMLP`) and the RMSNorms (forward bound)."""
    mlps = sum(m._get_name() == "LigerSwiGLUMLP" for m in trainer.model.modules())
    norms = sum("RMSNorm" in type(m).__name__ and "forward" in vars(m) for m in trainer.model.modules())
    return mlps + norms


def test_liger_kernels_give_the_same_logprobs_and_update():
    rows = mixed_batch()
    plain = qwen2_trainer()  # measured before the patched copy exists
    lp_plain, m_plain = completion_logprobs(plain, rows), plain.train_step(rows)
    fused = qwen2_trainer(liger=True)
    assert liger_modules(fused) == 3 + 2 * 3 + 1  # 3 MLPs, 2 norms per layer, the final norm
    assert liger_modules(plain) == 0  # only the patched instance changed
    lp_fused = completion_logprobs(fused, rows)
    assert lp_plain.shape == lp_fused.shape
    assert torch.allclose(lp_fused, lp_plain, atol=0.05), (lp_fused - lp_plain).abs().max()
    m_fused = fused.train_step(rows)
    assert m_fused["loss"] == pytest.approx(m_plain["loss"], abs=0.02)
    assert m_fused["grad_norm"] == pytest.approx(m_plain["grad_norm"], rel=0.05)
    assert_same_update(fused, plain)
