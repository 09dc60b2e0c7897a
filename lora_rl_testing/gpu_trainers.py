"""A small random Qwen2 trainer on the GPU and a batch for it: the GPU tests that compare two ways of running the
same trainer (Liger's kernels, compiled layers) build both copies from the same seeds here."""

from __future__ import annotations

import dataclasses

import torch

from lora_rl_core.config import LoRAConfig, ModelConfig, TrainerConfig
from lora_rl_core.lora import apply_lora
from lora_rl_core.records import TrainBatch
from lora_rl_core.trainer import PolicyTrainer
from lora_rl_core.trainer.kernels import apply_kernels, compile_layers
from lora_rl_testing.plans import trainer_plan

VOCAB = 512
"""The model's vocabulary; the batch's token ids are below it."""


def qwen2_trainer(*, liger: bool = False, compiled: bool = False, micro_batch_size: int = 4) -> PolicyTrainer:
    """A 3-layer Qwen2 (hidden 256) in bfloat16 on `cuda`, LoRA rank 8 with nonzero B, bfloat16 LoRA compute;
    the same weights on every call. `liger`: Liger's kernels patched in first; `compiled`: `compile_layers`."""
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
    if compiled:
        compile_layers(model)
    trainer = TrainerConfig(lr=1e-3, micro_batch_size=micro_batch_size, lora_compute_dtype="bfloat16")
    plan = trainer_plan(trainer=trainer, model=ModelConfig(device="cpu", dtype="bfloat16"))  # the plan's sections
    # the plan was made for a CPU (no compilation there): it says what was done here, so `close` stops the workers
    return PolicyTrainer(model, dataclasses.replace(plan, torch_compile=compiled), pad_id=0)


def mixed_batch(seed: int = 2) -> TrainBatch:
    """8 rows of prompts (3-30 tokens) and completions (1-40 tokens) of mixed lengths, mixed-sign advantages."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in (7, 12, 5, 9, 30, 3, 16, 11)]
    completions = [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in (20, 4, 33, 9, 12, 40, 1, 25)]
    return TrainBatch(
        prompt_ids=prompts,
        completion_ids=completions,
        advantages=[1.0, -1.0, 0.5, -0.5, 2.0, -2.0, 0.1, -0.1],
        inference_logprobs=[[0.0] * len(c) for c in completions],
    )


def completion_logprobs(trainer: PolicyTrainer, rows: TrainBatch) -> torch.Tensor:
    """Every completion token's logprob under the trainer's current policy, rows concatenated, `[tokens]` float32."""
    plan = [[list(range(len(rows)))]]
    with torch.no_grad():
        return torch.cat(list(trainer._old_logprobs(rows, plan).values()))


def lora_gradients(trainer: PolicyTrainer) -> torch.Tensor:
    """The LoRA gradients the trainer's last step left (after clipping), flattened into one float32 vector."""
    return torch.cat([p.grad.float().flatten() for p in trainer.params if p.grad is not None])


def assert_same_update(got: PolicyTrainer, want: PolicyTrainer, *, min_cosine: float = 0.99) -> None:
    """Two trainers' last steps agree to bfloat16 precision: their LoRA gradients point the same way (cosine
    similarity at least `min_cosine`) with the same norm (5 %). Gradients, not the weights after AdamW: its first
    step moves every weight by about `lr` in its gradient's sign, so a gradient near 0 flips that sign on
    bfloat16 noise alone."""
    g_got, g_want = lora_gradients(got), lora_gradients(want)
    assert g_got.shape == g_want.shape and g_want.norm() > 0
    cosine = float(torch.nn.functional.cosine_similarity(g_got, g_want, dim=0))
    assert cosine >= min_cosine, f"LoRA gradients differ: cosine similarity {cosine:.4f} < {min_cosine}"
    norms = float(g_got.norm()), float(g_want.norm())
    assert abs(norms[0] - norms[1]) <= 0.05 * norms[1], f"LoRA gradient norms differ: {norms}"
