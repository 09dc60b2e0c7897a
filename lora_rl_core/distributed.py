"""Everything that touches `torch.distributed`: process groups, FSDP2 sharding, gathers and reductions.

The one module with distributed code (docs/STYLE.md 9); the trainer calls the helpers
below and the pure losses, never `torch.distributed` itself. Every helper also
works without a process group (a single, unsharded process), where it is the
identity or a local operation. Only torch and peft are imported, so GPU
benchmarks can use this module without pydantic.

Choices:

* Backend: `gloo` on CPU, `nccl` on CUDA; rendezvous over TCP on 127.0.0.1 and a
  free port (`init_process_group(..., port=)`), or `env://` under torchrun.
* Sharding (`shard_model`): FSDP2 `fully_shard` on each decoder layer, found
  generically as the module list of identical blocks with the most parameters,
  then on the root (torchtune `training/_distributed.py`, torchtitan). Mixed
  precision `MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)`
  only on CUDA with bf16 support (and `shard_model(mixed_precision=True)`: the
  run asks for it unless `trainer.lora_compute_dtype` is `float32`); on CPU
  params and compute stay in their dtype.
  Activation checkpointing uses the composable `checkpoint` (FQNs unchanged, so
  PEFT state-dict keys stay the same as unsharded).
* Only the frozen base weights are sharded. The trainable (LoRA) parameters are
  FSDP-ignored (`fully_shard(ignored_params=)`): every rank holds all of them,
  with their gradients and AdamW state (a 7B's rank-16 adapter is 40M
  parameters, 0.65 GB with AdamW; the memory plan counts them per GPU). Their
  gradients are summed over ranks by ONE all-reduce per optimizer step
  (`sum_gradients`), not a reduce-scatter per layer and micro-batch, and a
  version or checkpoint is a copy on rank 0, not hundreds of gathers. Measured
  on 4 H100s, 7B, 2 ranks (benchmarks/results/gpu_scale/): with FSDP2 managing
  the LoRA weights too, its float32 reduce-scatters took 0.7 s of a 2.5 s train
  step, and gathering a checkpoint and a version parameter by parameter doubled
  the train phase seen by the run.
* Where the base weights fit every GPU whole (`trainer.shard_weights: auto` asks the memory plan; a 7B on
  80 GB GPUs), `shard_model(shard_weights=False)` applies no FSDP2 at all: every rank holds the whole model
  and only the LoRA gradients cross (`sum_gradients`), as DDP would, with no all-gather per layer and pass.
* Gradient reduction is a SUM across ranks, not a mean. The trainer weights
  each rank's loss by GLOBAL token / sequence counts, so the summed gradient
  equals the gradient of the global-batch loss and 1-process and N-process runs
  agree. (Every FSDP module is also set to sum, `set_gradient_divide_factor(1.0)`
  and `set_force_sum_reduction_for_comms(True)`, torch >= 2.8, for any
  trainable weight it would manage.)
* Gradient clipping: after the all-reduce every rank holds the same whole
  gradients, so `torch.nn.utils.clip_grad_norm_` gives every rank the global
  norm without communication. (On DTensor gradients it would take per-shard
  norms and redistribute their total; `clip_grad_norm_` here handles both.)
* Gathers (`gather_lora_state`, `full_tensor`) are local copies for the
  replicated LoRA weights, one parameter at a time, so the full model is never
  materialised on any rank.

Left out: HSDP / 2-D meshes, CPU offload, tensor parallelism.
"""

from __future__ import annotations

import datetime
import socket
from collections.abc import Iterable, Sequence
from typing import Any, cast

import torch
import torch.distributed as dist
from peft import get_peft_model_state_dict
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def backend_for(device: str | torch.device) -> str:
    """`nccl` for CUDA devices, `gloo` otherwise."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def init_process_group(
    device: str | torch.device,
    *,
    rank: int | None = None,
    world_size: int | None = None,
    port: int | None = None,
    timeout_s: float = 600.0,
) -> None:
    """Join the default process group (gloo on CPU, nccl on CUDA).

    Args:
        device: `cpu` or `cuda` (the backend follows it); on CUDA, call `torch.cuda.set_device` first.
        rank / world_size / port: rendezvous at `tcp://127.0.0.1:<port>`; all None = `env://`
            (torchrun sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT).
        timeout_s: how long a collective may wait for the other ranks before it raises.
    """
    kwargs: dict[str, Any] = {"backend": backend_for(device), "timeout": datetime.timedelta(seconds=timeout_s)}
    if port is not None:
        kwargs.update(init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    dist.init_process_group(**kwargs)


def destroy_process_group() -> None:
    """Leave the default process group, if any."""
    if is_distributed():
        dist.destroy_process_group()


def is_distributed() -> bool:
    """True when a default process group is initialised."""
    return dist.is_available() and dist.is_initialized()


def rank_and_world_size() -> tuple[int, int]:
    """`(rank, world_size)` of the default process group; `(0, 1)` without one."""
    if not is_distributed():
        return 0, 1
    return dist.get_rank(), dist.get_world_size()


def find_decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The transformer's block list: the `nn.ModuleList` of same-type modules with the most parameters.

    For Llama / Qwen2 under PEFT this is `model.get_base_model().model.layers`.

    Raises:
        ValueError: the model has no non-empty `nn.ModuleList` of identical block types.
    """
    candidates = [
        m
        for m in model.modules()
        if isinstance(m, nn.ModuleList) and len(m) > 0 and len({type(block) for block in m}) == 1
    ]
    if not candidates:
        raise ValueError(f"{type(model).__name__} has no nn.ModuleList of identical blocks to shard")
    return max(candidates, key=lambda m: sum(p.numel() for p in m.parameters()))


def mixed_precision_policy(device: torch.device) -> MixedPrecisionPolicy:
    """bf16 compute with fp32 gradient reduction on CUDA devices with bf16; otherwise no casting."""
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def shard_model(
    model: nn.Module,
    *,
    mixed_precision: bool,
    activation_checkpointing: bool,
    device: torch.device | None = None,
    replicate_trainable: bool = True,
    shard_weights: bool = True,
) -> nn.Module:
    """Shard `model`'s frozen weights in place with FSDP2: each decoder layer, then the root. Its trainable
    (LoRA) parameters stay whole on every rank, moved to `device`; `sum_gradients` sums their gradients.

    Call after `apply_lora` (LoRA params are created identically seeded on every rank) and before building the
    optimizer (FSDP2 replaces the sharded parameters with DTensor shards). Needs a process group;
    the mesh is all ranks, on the device type of the model's parameters.

    Args:
        model: the (PEFT) model, on `device` or on the CPU: `fully_shard` moves each layer's weights to the
            mesh's device as it shards them, so a GPU holds its shard plus one layer, never the whole model.
        mixed_precision: bf16 params / fp32 reduction where CUDA supports bf16 (ignored on CPU).
        activation_checkpointing: recompute each decoder layer's activations in backward.
        device: the rank's device; None = where the model's parameters are.
        replicate_trainable: keep the trainable parameters whole on every rank (the LoRA weights; module
            docstring); False shards them too (full fine-tuning: `benchmarks/train_step.py --modes full`).
        shard_weights: False = no FSDP2 at all: the model moves whole to `device` on every rank (data parallel
            for a base that fits each GPU: no all-gathers), only activation checkpointing is applied.

    Returns:
        The same module object (its class is now also an `FSDPModule`, unless `shard_weights` is False).
    """
    device = device or next(model.parameters()).device
    layers = find_decoder_layers(model)
    if activation_checkpointing:
        from torch.distributed._composable import checkpoint

        for layer in layers:
            checkpoint(layer)
    if not shard_weights:
        return model.to(device)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    policy = mixed_precision_policy(device) if mixed_precision else MixedPrecisionPolicy()
    # replicated: the module docstring says why
    trainable = {p for p in model.parameters() if p.requires_grad} if replicate_trainable else set()
    for layer in layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy, ignored_params=trainable & set(layer.parameters()))
    fully_shard(model, mesh=mesh, mp_policy=policy, ignored_params=trainable)
    with torch.no_grad():
        for p in trainable:  # FSDP2 does not move the parameters it ignores
            p.data = p.data.to(device)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            _sum_gradients(module)
    return model


@torch.no_grad()
def sum_gradients(params: Sequence[torch.Tensor]) -> None:
    """Sum the gradients of the replicated (FSDP-ignored) trainable parameters over ranks, in place: one
    all-reduce of them all, flattened (float32 for LoRA). A parameter with a gradient on some ranks only counts
    as zeros on the others; one with a gradient on no rank keeps none (as in one process, where AdamW then
    skips it). No-op without a process group, and for DTensor parameters (FSDP2 reduces those itself).

    Every rank must call it with the same parameters, once per optimizer step, after its last backward."""
    plain = [p for p in params if not isinstance(p, DTensor)]
    if not is_distributed() or not plain:
        return
    has = torch.tensor([float(p.grad is not None) for p in plain], device=_comm_device())
    dist.all_reduce(has, op=dist.ReduceOp.MAX)
    plain = [p for p, h in zip(plain, has.tolist(), strict=True) if h > 0]
    if not plain:
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in plain]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    for p, g, summed in zip(plain, grads, flat.split([g.numel() for g in grads]), strict=True):
        g.copy_(summed.view_as(g))
        p.grad = g


def _sum_gradients(module: FSDPModule) -> None:
    """Make FSDP2 reduce-scatter gradients as a plain SUM over ranks (no division by world size)."""
    if not hasattr(module, "set_force_sum_reduction_for_comms"):
        raise RuntimeError(
            f"sharded training needs torch >= 2.8 (FSDPModule.set_force_sum_...), have {torch.__version__}"
        )
    module.set_gradient_divide_factor(1.0)
    module.set_force_sum_reduction_for_comms(True)


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor: `DTensor.full_tensor()` (a collective: every rank must call it) or the tensor itself."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def local_part(tensor: torch.Tensor, rank: int, owner: int) -> tuple[torch.Tensor, list[int], list[int]] | None:
    """This rank's part of `tensor` as a checkpoint stores it, without communication: (its local data, the whole
    tensor's shape, the index of the data's first element in it), or None where another rank stores it. A
    DTensor shard is stored by the rank that holds it, its offset from its placements
    (`compute_local_shape_and_global_offset`, as torch.distributed.checkpoint computes it); a tensor that is
    the same on every rank (plain, as the LoRA weights are, or replicated) by rank `owner` alone."""
    if isinstance(tensor, DTensor) and not all(p.is_replicate() for p in tensor.placements):
        _, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
        return tensor.to_local(), list(tensor.shape), list(offset)
    if rank != owner:
        return None
    data = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return data, list(tensor.shape), [0] * tensor.dim()


def shard_like(like: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """`full` (the same on every rank) laid out like `like`: this rank's DTensor shard, or a plain copy.

    No communication: each rank slices its own shard (`distribute_tensor(src_data_rank=None)`).
    """
    if not isinstance(like, DTensor):
        return full.to(like.device, copy=True)
    local_device = like.to_local().device
    return distribute_tensor(full.to(local_device), like.device_mesh, like.placements, src_data_rank=None)


@torch.no_grad()
def copy_full_(target: torch.Tensor, full: torch.Tensor) -> None:
    """Copy a full tensor (the same on every rank) into `target`, a parameter or its DTensor shard."""
    if isinstance(target, DTensor):
        cast(DTensor, target).to_local().copy_(cast(DTensor, shard_like(target, full)).to_local())
    else:
        target.copy_(full)


@torch.no_grad()
def peft_adapter_state(model: nn.Module, adapter_name: str) -> dict[str, torch.Tensor]:
    """`get_peft_model_state_dict` of one adapter, without another adapter's `modules_to_save`: PEFT 0.21 also
    returns the original weights of a module another adapter fully trains (the critic's value head) under the
    policy's keys, which a server loading the policy's adapter would refuse."""
    state = get_peft_model_state_dict(model, adapter_name=adapter_name)
    config = getattr(model, "peft_config", {}).get(adapter_name)
    if config is not None and config.modules_to_save:
        return state
    return {key: value for key, value in state.items() if ".lora_" in key}


def gather_lora_state(model: nn.Module, adapter_name: str = "default") -> dict[str, torch.Tensor] | None:
    """The adapter's full weights, gathered one parameter at a time; every rank must call it.

    Returns:
        On rank 0: PEFT-keyed detached tensors where they are (the keys `get_peft_model_state_dict` gives for the
        unsharded model, e.g. `base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`), dtype as
        stored (float32 for LoRA): a replicated parameter itself, a sharded one gathered whole on rank 0's
        device. Not copies: the caller copies them before the model changes (to CPU, or straight into shared
        memory: `workers.PackedTensors.pack`). On other ranks: None.
    """
    rank, _ = rank_and_world_size()
    gathered: dict[str, torch.Tensor] = {}
    for key, value in peft_adapter_state(model, adapter_name).items():
        full = full_tensor(value.detach())
        if rank == 0:
            gathered[key] = full
    return gathered if rank == 0 else None


def clip_grad_norm_(params: Iterable[torch.Tensor], max_norm: float) -> float:
    """Clip gradients to a global L2 norm of `max_norm` (over all ranks when sharded); returns the pre-clip norm."""
    norm = torch.nn.utils.clip_grad_norm_(list(params), max_norm)
    return float(full_tensor(norm))


def _comm_device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _all_reduce(values: dict[str, float], op: dist.ReduceOp.RedOpType) -> dict[str, float]:
    if not is_distributed():
        return dict(values)
    keys = sorted(values)  # every rank must send the same keys
    packed = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=_comm_device())
    dist.all_reduce(packed, op=op)
    return dict(zip(keys, packed.tolist(), strict=True))


def all_reduce_sum(values: dict[str, float]) -> dict[str, float]:
    """Sum each value over ranks (float64); every rank must pass the same keys. Identity without a group."""
    return _all_reduce(values, dist.ReduceOp.SUM)


def all_reduce_max(values: dict[str, float]) -> dict[str, float]:
    """Max of each value over ranks (float64); every rank must pass the same keys. Identity without a group."""
    return _all_reduce(values, dist.ReduceOp.MAX)


def all_gather_cat(values: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Every rank's 1-D float32 `values` (any lengths) concatenated in rank order, on every rank, and where this
    rank's part starts in it. Without a process group: `(values, 0)`."""
    if not is_distributed():
        return values, 0
    rank, world_size = rank_and_world_size()
    device = _comm_device()
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world_size)]
    dist.all_gather(sizes, torch.tensor([values.numel()], dtype=torch.int64, device=device))
    counts = [int(n.item()) for n in sizes]
    padded = torch.zeros(max(counts), dtype=torch.float32, device=device)
    padded[: values.numel()] = values.to(device, torch.float32)
    parts = [torch.empty_like(padded) for _ in range(world_size)]
    dist.all_gather(parts, padded)
    return torch.cat([part[:n] for part, n in zip(parts, counts, strict=True)]), sum(counts[:rank])


def gather_objects(obj: Any) -> list[Any] | None:
    """Pickle-gather one object per rank onto rank 0: the list (by rank) there, None elsewhere."""
    if not is_distributed():
        return [obj]
    rank, world_size = rank_and_world_size()
    out: list[Any] | None = [None] * world_size if rank == 0 else None
    dist.gather_object(obj, out, dst=0)
    return out
