"""The GPU memory plan of a run: what the trainer and a colocated SGLang need, decided before step 1.

A run whose trainer and SGLang share one GPU (the default on a one-GPU machine) holds two copies of the base
weights; the rest goes to SGLang's KV cache during the rollout and to the trainer's activations during the
train phase. With SGLang's memory saver (`--enable-memory-saver`) the KV cache is freed while the trainer
trains and taken back before the next rollout (verl does the same in its LoRA mode, verl PR #5769), so the
two peaks do not add up:

    rollout phase:  engine weights + LoRA pool + engine overhead + KV cache  + trainer resident   <= budget
    train phase:    engine weights + LoRA pool + engine overhead             + trainer resident
                                                                             + trainer activations <= budget
    trainer resident = base weights (bf16) + LoRA weights, gradients and AdamW moments (float32, 16 B each)

With several trainer ranks each GPU is planned alone: the base weights whole on every rank where that costs
the trainer no smaller micro-batch and no recomputation (data parallel), else 1/ranks of them (FSDP2), the
LoRA state whole on every rank plus its gradients' all-reduce buffer (`trainer.shard_weights`).

Without the saver (async rollouts keep SGLang busy while training, or `torch_memory_saver` is missing) the
KV cache and the activations add up. The saver costs a release, a resume and emptying the trainer's CUDA
cache every step (re-allocating its activations), so `auto` uses it only where it buys the trainer a larger
micro-batch or no recomputation, or where no micro-batch fits beside the cache at all. SGLang's KV cache gets
half again what the rollout batch needs where a micro-batch still fits beside it, else what the batch needs; it
always stays within what both models' weights leave (it comes back after every train phase).
`plan_memory` chooses `trainer.gradient_checkpointing` (`auto`: on only
where a micro-batch's activations would not fit even halved down to `MIN_MICRO_BATCH`; the micro-batch is
halved as far as needed either way), SGLang's `--mem-fraction-static` (`auto`: weights plus the KV cache
this plan gives it: what the activations leave) and the memory saver, and raises `ConfigError` naming the
settings to change where even checkpointed activations do not fit.

    shape.py   `ModelShape`: the model's and the adapter's sizes from its config, and the byte estimates
               (weights, activations of a micro-batch, KV cache per token)
    plan.py    `plan_memory`, `MemoryPlan`, `check_engine_alone`: the arithmetic per GPU

The plan's figures are logged and written to the run's `run.json` (`runtime.memory_plan`), so a run that
does not fit can be compared against it.
"""

from lora_rl_core.memory.plan import (
    CUDA_CONTEXT_BYTES,
    ENGINE_OVERHEAD_BYTES,
    MIN_MICRO_BATCH,
    SAFETY_BYTES,
    SGLANG_CHUNKED_PREFILL,
    MemoryPlan,
    check_engine_alone,
    log_plan,
    plan_memory,
    rollout_batch,
)
from lora_rl_core.memory.shape import ACTIVATION_CALIBRATION, GIB, ModelShape

__all__ = [
    "ACTIVATION_CALIBRATION",
    "CUDA_CONTEXT_BYTES",
    "ENGINE_OVERHEAD_BYTES",
    "GIB",
    "MIN_MICRO_BATCH",
    "SAFETY_BYTES",
    "SGLANG_CHUNKED_PREFILL",
    "MemoryPlan",
    "ModelShape",
    "check_engine_alone",
    "log_plan",
    "plan_memory",
    "rollout_batch",
]
