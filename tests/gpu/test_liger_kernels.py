"""Liger's fused kernels (`trainer.liger_kernels`) change the trainer's speed, not its numbers.

A small random Qwen2 in bfloat16 on the GPU, the same LoRA init twice: one copy patched with Liger's RMSNorm
and SwiGLU kernels (`lora_rl_core.trainer.kernels.apply_kernels`), one not. The completion logprobs
agree to bfloat16 precision, and one PPO step moves the LoRA weights the same way. Needs CUDA and
`liger-kernel` (the `gpu` extra)."""

from __future__ import annotations

import pytest
import torch

from lora_rl_core.config import LoRAConfig, ModelConfig, TrainerConfig
from lora_rl_core.lora import apply_lora
from lora_rl_core.records import TrainBatch
from lora_rl_core.trainer import PolicyTrainer
from lora_rl_core.trainer.kernels import apply_kernels, liger_model_types
from lora_rl_testing.plans import trainer_plan


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
VOCAB = 512


def qwen2_trainer(liger: bool) -> PolicyTrainer:
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=704,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    torch.manual_seed(0)
    with torch.device("cuda"):
        base = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    apply_kernels(base, liger)
    torch.manual_seed(1)
    model = apply_lora(base, LoRAConfig(rank=8))
    for name, p in model.named_parameters():  # B = 0 at init would make the first step's A gradients 0
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02)
    trainer = TrainerConfig(lr=1e-3, micro_batch_size=4, lora_compute_dtype="bfloat16")
    plan = trainer_plan(trainer=trainer, model=ModelConfig(device="cpu", dtype="bfloat16"))  # the plan's sections
    return PolicyTrainer(model, plan, pad_id=0)


def batch() -> TrainBatch:
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in (7, 12, 5, 9, 30, 3, 16, 11)]
    completions = [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in (20, 4, 33, 9, 12, 40, 1, 25)]
    return TrainBatch(
        prompt_ids=prompts,
        completion_ids=completions,
        advantages=[1.0, -1.0, 0.5, -0.5, 2.0, -2.0, 0.1, -0.1],
        inference_logprobs=[[0.0] * len(c) for c in completions],
    )


def completion_logprobs(trainer: PolicyTrainer, rows: TrainBatch) -> torch.Tensor:
    plan = [[list(range(len(rows)))]]
    with torch.no_grad():
        return torch.cat(list(trainer._old_logprobs(rows, plan).values()))


def liger_modules(trainer: PolicyTrainer) -> int:
    """Modules running a Liger forward: the MLPs (renamed `LigerSwiGLUMLP`) and the RMSNorms (forward bound)."""
    mlps = sum(m._get_name() == "LigerSwiGLUMLP" for m in trainer.model.modules())
    norms = sum("RMSNorm" in type(m).__name__ and "forward" in vars(m) for m in trainer.model.modules())
    return mlps + norms


def test_liger_kernels_give_the_same_logprobs_and_update():
    rows = batch()
    plain = qwen2_trainer(False)  # measured before the patched copy exists
    lp_plain, m_plain = completion_logprobs(plain, rows), plain.train_step(rows)
    weights = {n: p.detach().clone() for n, p in plain.model.named_parameters() if "lora_" in n}
    fused = qwen2_trainer(True)
    assert liger_modules(fused) == 3 + 2 * 3 + 1  # 3 MLPs, 2 norms per layer, the final norm
    assert liger_modules(plain) == 0  # only the patched instance changed
    lp_fused = completion_logprobs(fused, rows)
    assert lp_plain.shape == lp_fused.shape
    assert torch.allclose(lp_fused, lp_plain, atol=0.05), (lp_fused - lp_plain).abs().max()
    m_fused = fused.train_step(rows)
    assert m_fused["loss"] == pytest.approx(m_plain["loss"], abs=0.02)
    assert m_fused["grad_norm"] == pytest.approx(m_plain["grad_norm"], rel=0.05)
    for name, p in fused.model.named_parameters():
        if "lora_" in name:
            assert torch.allclose(p, weights[name], atol=2e-4), (name, (p - weights[name]).abs().max())
