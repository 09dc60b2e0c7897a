"""The `trainer` section: optimisation of the LoRA parameters, and where the trainer runs (`trainer.backend`,
a section keyed by `type`: `in-process`, `local` FSDP2 processes or `ray` FSDP2 actors, each with only its
own options)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from lora_rl_core.config.base import Section, keyed_by_type, refuse_moved_keys


class InProcessBackend(Section):
    """`trainer.backend: in-process` (the default): one trainer in this process, on `model.device`."""

    type: Literal["in-process"] = "in-process"
    """The kind: no ranks, no process group."""


class LocalBackend(Section):
    """`trainer.backend: local`: `world_size` persistent FSDP2 processes spawned on this machine
    (`lora_rl_core/trainer/workers.py`); no Ray runtime needed."""

    type: Literal["local"] = "local"
    """The kind: spawned processes."""
    world_size: int = Field(1, ge=1)
    """FSDP2 ranks (processes; one GPU each on CUDA)."""
    device: Literal["cpu", "cuda"] = "cpu"
    """Device of the ranks: `cpu` (gloo) or `cuda` (NCCL, `cuda:<rank>`)."""


class RayBackend(Section):
    """`trainer.backend: ray`: `world_size` FSDP2 ranks as Ray actors in a placement group (one CPU or GPU
    each), joining `RAY_ADDRESS` or a local Ray (`lora_rl_core/trainer/ray_actors.py`)."""

    type: Literal["ray"] = "ray"
    """The kind: Ray actors."""
    world_size: int = Field(1, ge=1)
    """FSDP2 ranks (actors)."""
    device: Literal["cpu", "cuda"] = "cpu"
    """Device of the ranks: `cpu` (gloo, one CPU per actor) or `cuda` (NCCL)."""
    gpus_per_rank: float = Field(1.0, gt=0, le=1)
    """With `device: cuda`: GPUs each rank reserves; a fraction shares a GPU with an engine replica
    (`engine.ray_gpus_per_replica`)."""


TrainerBackendConfig = Annotated[
    InProcessBackend | LocalBackend | RayBackend, Field(discriminator="type"), keyed_by_type("in-process")
]
"""`trainer.backend`, keyed by `type`."""
RankedBackend = LocalBackend | RayBackend
"""The backends with FSDP2 ranks."""

MICRO_BATCH_AUTO_MAX = 64
"""`trainer.micro_batch_size: auto` on a GPU: the largest micro-batch the memory plan starts from."""
MICRO_BATCH_NO_PLAN = 16
"""`trainer.micro_batch_size: auto` without a GPU to plan (a CPU run, Ray ranks on unknown GPUs)."""

_MOVED = {
    "world_size": ("backend", "local", "world_size"),
    "device": ("backend", "local", "device"),
    "ray_gpus_per_rank": ("backend", "ray", "gpus_per_rank"),
}
"""The keys that moved into the backend they belong to (key -> sub-section, kind, field)."""


class TrainerConfig(Section):
    """Optimisation of the LoRA parameters."""

    steps: int = Field(30, ge=1)
    """Training steps (one rollout batch and one adapter version each)."""
    lr: float = Field(3e-4, gt=0)
    """AdamW learning rate (LoRA wants ~10x the full fine-tuning rate)."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW's decoupled weight decay on the LoRA parameters (per optimizer step, times the lr); 0 = none,
    the default (TRL/transformers `weight_decay`, verl `optim.weight_decay`)."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW's (beta1, beta2) moment decay rates; the default is PyTorch's (transformers `adam_beta1/2`)."""
    warmup_steps: int = Field(0, ge=0)
    """Linear learning-rate warmup, in training steps: the lr is `lr * min(1, (step + 1) / warmup_steps)`,
    then constant (no decay). 0 (the default) and 1 both start at the full lr (TRL `warmup_steps`)."""
    max_grad_norm: float = Field(1.0, gt=0)
    """Clip the global L2 norm of the LoRA gradients to this before each optimizer step (across ranks when
    sharded); the pre-clip norm is logged as `grad_norm` (TRL `max_grad_norm`, verl `actor.grad_clip`)."""
    micro_batch_size: Annotated[int, Field(ge=1)] | Literal["auto"] = "auto"
    """Sequences per forward/backward pass (gradient accumulation over the rest). `auto` (the default): on a GPU
    the largest that fits, the memory plan halving from the rollout batch's rows up to `MICRO_BATCH_AUTO_MAX`
    (64): fewer, larger passes launch fewer kernels per token (one H100: a 1.5B's train phase 1.27 -> 1.04 s at
    32 instead of 16; a 7B gets 8 either way); without a GPU to plan, `MICRO_BATCH_NO_PLAN` (16). A number is
    where the plan starts instead: halved to fit while `gradient_checkpointing` is `auto`, taken as set (or
    refused before step 1) when both are set (verl `ppo_micro_batch_size_per_gpu`, TRL
    `per_device_train_batch_size`)."""
    gradient_checkpointing: bool | Literal["auto"] = "auto"
    """Recompute activations in the backward pass instead of keeping them: less memory for about one more
    forward per micro-batch; with FSDP2 ranks (`backend` local or ray) it is applied per decoder layer (TRL/transformers
    `gradient_checkpointing`, verl `model.enable_gradient_checkpointing`). `auto`: on where the run's memory
    plan (`lora_rl_core.memory`) says a micro-batch's activations would not fit the GPU beside what else it
    holds even at a micro-batch of 4 (the plan first halves the micro-batch, down to 4: cheaper than
    recomputing every layer); off on a CPU."""
    liger_kernels: bool | Literal["auto"] = False
    """Fuse each decoder layer's RMSNorm and SwiGLU MLP into one Triton kernel each (Liger Kernel, forward
    and backward) in the trainer's copy of the model: fewer kernel launches and activations;
    the logits stay as they are (TRL `use_liger_kernel`, verl `model.use_liger`). Off by default: on one H100
    it moved the train phase by no more than the spread of steps (7B 3.94 -> 3.70 s, 1.5B 1.89 -> 2.05 s) and
    saved ~3 GiB at the peak (`benchmarks/results/gpu_scale/README.md`, "One GPU, A/B";
    `tests/gpu/test_liger_kernels.py` checks its numerics). `auto`: on for a trainer on CUDA
    where `liger-kernel` is installed (the `gpu` extra) and the model is a llama, mistral, qwen2 or qwen3,
    off otherwise;
    `true` where that does not hold is a config error (`lora_rl_core.trainer.kernels`)."""
    torch_compile: bool | Literal["auto"] = "auto"
    """Compile each decoder layer of the trainer's model with `torch.compile` (regional compilation: one graph
    that every layer shares, dynamic sequence lengths; TRL `torch_compile`, verl `use_torch_compile`): Inductor
    fuses the layer's elementwise work (norms, rotary, SwiGLU, the LoRA branches' scaling and adds) into few
    kernels and autograd sees one node per layer, where the eager layer launches hundreds of small kernels.
    On one H100 it took the train phase from 1.82 to 1.21 s (1.5B) and from 3.78 to 2.80 s (7B), with less
    memory at the peak (`benchmarks/results/gpu_scale/README.md`, "Compiled layers"); the first step pays the
    compilation (a 7B's step 1: 80-91 s instead of 9 s). `auto` (the default): on for an in-process trainer on
    CUDA; off on a CPU (where `make run` would pay the compilation for nothing) and for FSDP2 ranks (not built
    for them); `true` there is a config error (`lora_rl_core.trainer.kernels.choose_compile`)."""
    shard_weights: bool | Literal["auto"] = "auto"
    """With several trainer ranks: FSDP2 shards the frozen base weights over them (ZeRO-3: each rank holds its
    share and all-gathers each layer for every forward and backward), or every rank holds them whole and only the
    LoRA gradients are summed (data parallel, no all-gathers). `auto`: whole where they fit each GPU with a
    micro-batch and recomputation no worse than sharded (a 7B on 80 GB GPUs), else sharded (a 32B)
    (`lora_rl_core.memory.plan_memory`; verl `fsdp_config.fsdp_size`)."""
    lora_compute_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Dtype the LoRA branches compute in; the LoRA weights, their gradients and the AdamW state stay float32
    (master weights) either way, and logprobs and the loss are computed in float32 from the logits.
    `bfloat16`: the trainer's forward passes (policy, reference, old logprobs) run under `torch.autocast` and
    PEFT's cast of each LoRA input up to the adapter's float32 is off, so LoRA runs in the base model's
    bfloat16 (no float32 copy of every adapted layer's input); with FSDP2 ranks FSDP2's mixed precision
    is on (bfloat16 parameters, float32 gradient reduction), off with `float32`. Needs bfloat16 base weights
    (`model.dtype`); on a CPU it uses CPU autocast (slow without native bfloat16). `auto` (the default):
    bfloat16 on CUDA with bfloat16 base weights, float32 otherwise, so a CPU run computes as before
    (`lora_rl_core.runtime.choose_lora_compute_dtype`; transformers `bf16`, verl `fsdp_config.mixed_precision`)."""
    backend: TrainerBackendConfig = InProcessBackend()
    """Where the trainer runs, keyed by `type`: `in-process` (the default: this process, on `model.device`),
    `{type: local, world_size: N, device: cuda}` (N spawned FSDP2 processes on this machine, gloo on CPU, NCCL
    on GPUs) or `{type: ray, world_size: N, device: cuda, gpus_per_rank: 1}` (N FSDP2 Ray actors in a placement
    group, joining `RAY_ADDRESS` or a local Ray). A bare kind (`trainer.backend=local`) takes its defaults."""
    checkpoint_every: int = Field(1, ge=1)
    """Save a checkpoint (LoRA weights, optimizer, scheduler, RNG states) every this many steps. The prompts
    of a step are a function of `run.seed` and the step, so no data cursor is saved."""
    keep_checkpoints: int = Field(2, ge=1)
    """Checkpoints kept in the store; older ones are deleted."""
    background_publish: bool = True
    """Write each step's adapter version and checkpoint to the store on a background thread while the next
    rollout runs (the engines take the new version from memory at once: `engine.sync: tensor`; a sync that
    reads the store waits for its version). The snapshot is taken at once; one thread writes in step order,
    at most one step behind; a failed write fails the run at the next step, naming the version or checkpoint,
    and a resume redoes it (docs/DESIGN.md, "Publish and checkpoint in the background"). False writes them
    inside the train and publish phases."""

    @model_validator(mode="before")
    @classmethod
    def _moved(cls, data: Any) -> Any:
        refuse_moved_keys(data, "trainer", _MOVED)
        return data

    def micro_batch_start(self, rows: int, *, on_gpu: bool) -> int:
        """The micro-batch the memory plan starts from (and halves to fit): the set number, or for `auto` the
        batch's `rows` up to `MICRO_BATCH_AUTO_MAX` where a GPU is planned, `MICRO_BATCH_NO_PLAN` where not; never
        more than `rows`."""
        if self.micro_batch_size != "auto":
            return min(self.micro_batch_size, rows)
        return min(MICRO_BATCH_AUTO_MAX if on_gpu else MICRO_BATCH_NO_PLAN, rows)

    def ranks(self) -> int:
        """FSDP2 ranks: `backend.world_size`, 0 for `in-process`."""
        return self.backend.world_size if isinstance(self.backend, (LocalBackend, RayBackend)) else 0
