"""Payloads for SGLang's `/load_lora_adapter_from_tensors`: adapter tensors as torch multiprocessing pickles.

SGLang 0.5.17 (`sglang/srt/managers/tp_worker.py`, `_deserialize_own_rank`) reads
`serialized_named_tensors[tp_rank]` with `MultiprocessingSerializer.deserialize`: base64, then an
unpickler that allows `torch.*`, `builtins.*`, `operator.*`, ... (`SafeUnpickler`), after applying its
`monkey_patch_torch_reductions` (`sglang/srt/utils/patch_torch.py`), which rebuilds a CUDA tensor on the
device whose UUID the pickle names (a plain device index is accepted too). `LoRAAdapter.
initialize_weights_from_tensors` then calls `.cpu()` on every tensor (`_process_weight`) and keeps those
CPU tensors in its CPU pool, so the sender's tensors may be freed once the server has answered. The GPU pool
(the model's dtype) is filled from the CPU pool on the adapter's first request (docs/SGLANG.md).

Two transports (docs/SGLANG.md, "Tensor path"):

* `ipc`: CUDA tensors pickled by torch's `ForkingPickler` reductions, i.e. CUDA IPC handles, not data;
  the device is named by UUID as SGLang's patched reduction does, so the server may see the GPU under
  another index. Same host only; the sender keeps the tensors alive until the answer and then calls
  `release_ipc` (`torch.cuda.ipc_collect`). Three layouts (`config.IPC_LAYOUTS`):

  - `per-tensor`: each tensor its own CUDA copy. The server pays per tensor an IPC event open and wait, a
    `cudaIpcOpenMemHandle` per distinct allocator segment, a refcount release and a synchronous `.cpu()`.
  - `packed`: one contiguous CUDA buffer per dtype and views into it. torch's `rebuild_cuda_tensor`
    caches storages by (handle, offset), so the server opens the buffer once; it still copies each view to
    host memory by its own `.cpu()` (each weight its own CPU tensor, as with `per-tensor`).
  - `host` (default, `engine.tensor_layout`): the packed buffer is copied to host memory once while the server unpickles
    (`torch._utils._rebuild_device_tensor_from_cpu_tensor`, one device-to-host copy) and the weights are
    `torch.as_strided` views of that copy, so SGLang's `.cpu()` finds them on the CPU already. The views
    keep the whole host copy alive while the adapter is loaded (SGLang concatenates q/k/v and gate/up into
    new tensors but keeps o/down as given): about 1.7x the adapter's bytes of CPU memory per loaded version.

  `dtype` casts on this side, before sharing: SGLang keeps what it gets in the CPU pool and casts to the
  model's dtype when it copies into the GPU pool (`copy_weight_into_buffer`: a device copy, a cast and a
  copy per weight when the dtypes differ, one copy when they match), so sending the model's dtype gives the
  same GPU weights with half the bytes (from float32 to bfloat16) and fewer operations at first use.
* `inline`: CPU tensors pickled by the standard pickler, data included (`torch.storage._load_from_bytes`),
  so it works across hosts, at the cost of base64 in the JSON body (4/3 of the adapter's bytes).

CPU tensors are never sent by shared memory: torch's `file_system` strategy starts a `torch_shm_manager`
daemon that outlives the caller (docs/SGLANG.md, hazards), and the `file_descriptor` strategy needs the
caller's multiprocessing authkey, which a separate server does not have.
"""

from __future__ import annotations

import base64
import copyreg
import io
import math
import pickle
import types
from collections.abc import Iterator, Mapping
from multiprocessing.reduction import ForkingPickler
from typing import Any
from urllib.parse import urlsplit

import torch
import torch.multiprocessing  # noqa: F401 - registers torch's ForkingPickler reductions (CUDA IPC handles)
from torch.multiprocessing import reductions

from lora_rl_core.config import SGLANG_DEFAULTS, IpcLayout, TensorTransport
from lora_rl_core.errors import EngineError

_LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})
_DEVICE_ARG = 6  # index of the device in `reduce_tensor`'s CUDA rebuild args (SGLang's _REDUCE_TENSOR_ARG_DEVICE_INDEX)
DEFAULT_IPC_LAYOUT = SGLANG_DEFAULTS.tensor_layout


def is_loopback(url: str) -> bool:
    """Whether the server at `url` runs on this host (a loopback address), where CUDA IPC can reach it."""
    return (urlsplit(url).hostname or "") in _LOOPBACK_HOSTS


def server_transport(requested: TensorTransport, url: str) -> TensorTransport:
    """`engine.tensor_transport` for the server at `url`, resolved once, when its client is made (this process
    and the server's host are known then: a Ray replica's URL only once it has started, before step 1).

    `auto` becomes `ipc` when the server is on this host and this process has CUDA; else it stays `auto`, which
    a load then takes as the published folder where it gives one and inline data where not (`pick_transport`).
    Any other value (checked by `EngineConfig.tensor_transport`) is returned as given.
    """
    if requested == "auto" and is_loopback(url) and torch.cuda.is_available():
        return "ipc"
    return requested


def pick_transport(transport: TensorTransport, *, has_path: bool) -> str:
    """The transport for one tensor load of a client whose transport `server_transport` resolved: `auto` (no
    CUDA IPC to that server) is `disk` when a published folder is given (`has_path`), else `inline`; any other
    value as given."""
    if transport != "auto":
        return transport
    return "disk" if has_path else "inline"


def pack(
    tensors: Mapping[str, torch.Tensor],
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> dict[str, torch.Tensor]:
    """Copies of `tensors` as views into one new contiguous buffer per dtype.

    Args:
        tensors: any devices, dtypes and layouts.
        device: where the buffers live (None: the device of the first tensor).
        dtype: cast every tensor to it (None: each keeps its dtype, one buffer per dtype).

    Returns:
        The same keys in the same order, each a contiguous view (same shape) into its dtype's buffer; the
        views of one buffer cover it end to end in key order. Writing to the inputs does not change them.
    """
    views = {
        name: flat[offset : offset + math.prod(size)].view(size)
        for flat, name, size, offset in _spans(_pack(tensors, device, dtype), {k: v.shape for k, v in tensors.items()})
    }
    return {name: views[name] for name in tensors}


def _pack(
    tensors: Mapping[str, torch.Tensor], device: torch.device | str | None, dtype: torch.dtype | None
) -> list[tuple[torch.Tensor, list[str]]]:
    """(flat buffer, the names it holds in order), one per dtype."""
    if not tensors:
        return []
    target = torch.device(device) if device is not None else next(iter(tensors.values())).device
    groups: dict[torch.dtype, list[str]] = {}
    for name, tensor in tensors.items():
        groups.setdefault(dtype or tensor.dtype, []).append(name)
    return [
        (_concat([tensors[n].detach().reshape(-1) for n in names], target, group_dtype), names)
        for group_dtype, names in groups.items()
    ]


def _spans(
    buffers: list[tuple[torch.Tensor, list[str]]], shapes: Mapping[str, torch.Size]
) -> Iterator[tuple[torch.Tensor, str, tuple[int, ...], int]]:
    """(buffer, name, size, element offset) of each name in `_pack`'s buffers, end to end in buffer order."""
    for flat, names in buffers:
        offset = 0
        for name in names:
            size = tuple(shapes[name])
            yield flat, name, size, offset
            offset += math.prod(size)


def _concat(parts: list[torch.Tensor], device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """One new flat tensor of `dtype` on `device` holding `parts` end to end: one `cat` where the parts are
    (a few kernels, not one per part), then one cast and move when needed. Parts on the host bound for a GPU
    move there first (cast on the way) and are joined there: a `cat` of a 7B adapter's ~390 host tensors took
    ~0.2 s of a sync on the GPU host, where the parts' copies are asynchronous from the page-locked memory
    that `lora.cpu_copies` gives them."""
    sources = {p.device for p in parts}
    if device.type == "cuda" and any(s.type == "cpu" for s in sources):
        parts = [p.to(device=device, dtype=dtype, non_blocking=True) for p in parts]
    elif len(sources) > 1:
        parts = [p.to(device) for p in parts]
    if len({p.dtype for p in parts}) == 1:
        flat = torch.cat(parts)
    else:  # cast part by part into the buffer (the output's dtype counts: torch.cat's `out`)
        flat = torch.cat(parts, out=torch.empty(sum(p.numel() for p in parts), dtype=dtype, device=parts[0].device))
    return flat.to(device=device, dtype=dtype)  # no copy when it is there in that dtype already


class _HostCopy:
    """Pickled as `torch._utils._rebuild_device_tensor_from_cpu_tensor(flat, dtype, "cpu", False)`: the server
    rebuilds `flat` from its CUDA IPC handle and copies it to host memory once (`flat.to(device="cpu")`)."""

    def __init__(self, flat: torch.Tensor) -> None:
        self.flat = flat

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return torch._utils._rebuild_device_tensor_from_cpu_tensor, (self.flat, self.flat.dtype, "cpu", False)


class _HostView:
    """Pickled as `torch.as_strided(host, size, stride, offset)`: a view of the server's host copy. The
    pickler memoises the `_HostCopy`, so every view of one buffer refers to one copy."""

    def __init__(self, host: _HostCopy, size: tuple[int, ...], stride: tuple[int, ...], offset: int) -> None:
        self.host = host
        self.args = (size, stride, offset)

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return torch.as_strided, (self.host, *self.args)


def _host_views(buffers: list[tuple[torch.Tensor, list[str]]], shapes: Mapping[str, torch.Size]) -> dict:
    """`_HostView`s of `_pack`'s buffers (one `_HostCopy` each), in `shapes`' key order."""
    hosts = {id(flat): _HostCopy(flat) for flat, _ in buffers}  # one host copy per buffer
    views = {
        name: _HostView(hosts[id(flat)], size, _contiguous_strides(size), offset)
        for flat, name, size, offset in _spans(buffers, shapes)
    }
    return {name: views[name] for name in shapes}


def _contiguous_strides(size: tuple[int, ...]) -> tuple[int, ...]:
    """The strides of a contiguous tensor of `size` (as torch computes them: a 0-sized dim counts as 1)."""
    return tuple(math.prod(max(d, 1) for d in size[i + 1 :]) for i in range(len(size)))


def _reduce_with_device_uuid(tensor: torch.Tensor) -> tuple[Any, tuple[Any, ...]]:
    """torch's CUDA tensor reduction with the device index replaced by the device's UUID."""
    rebuild, args = reductions.reduce_tensor(tensor)
    if tensor.is_cuda:
        device_uuid = str(torch.cuda.get_device_properties(args[_DEVICE_ARG]).uuid)
        args = (*args[:_DEVICE_ARG], device_uuid, *args[_DEVICE_ARG + 1 :])
    return rebuild, args


def _reduce_builtin(function: Any) -> Any:
    """`torch.as_strided` as the global `torch.as_strided` (its own reduction is `builtins.getattr` of
    `torch._C._VariableFunctionsClass`); other builtin functions as usual."""
    if function is torch.as_strided:
        return "as_strided"
    return function.__reduce_ex__(pickle.HIGHEST_PROTOCOL)


def _dumps(obj: Any, *, share_cuda: bool) -> bytes:
    """Pickle `obj`: `share_cuda` with torch's `ForkingPickler` reductions (CUDA tensors as IPC handles, device
    by UUID), else with the standard ones (tensor data inline). A private dispatch table: the process-wide
    reductions stay torch's own (SGLang patches them globally instead)."""
    buf = io.BytesIO()
    pickler = (ForkingPickler if share_cuda else pickle.Pickler)(buf, pickle.HIGHEST_PROTOCOL)
    table = dict(pickler.dispatch_table if share_cuda else copyreg.dispatch_table)
    table[types.BuiltinFunctionType] = _reduce_builtin
    if share_cuda:
        table[torch.Tensor] = _reduce_with_device_uuid
    pickler.dispatch_table = table
    pickler.dump(obj)
    return buf.getvalue()


def ipc_payload(
    tensors: Mapping[str, torch.Tensor],
    device: torch.device | str = "cuda",
    *,
    layout: IpcLayout = DEFAULT_IPC_LAYOUT,
    dtype: torch.dtype | None = None,
) -> tuple[str, dict[str, torch.Tensor]]:
    """One `serialized_named_tensors` entry carrying CUDA IPC handles of `tensors` copied to `device`.

    Args:
        tensors: PEFT-keyed adapter weights, any device and dtype.
        device: the CUDA device to share them from.
        layout: `per-tensor`, `packed` or `host` (module docstring; `EngineConfig.tensor_layout` checks it).
        dtype: cast to it before sharing (the server model's dtype saves bytes and casts; None keeps each
            tensor's dtype).

    Returns:
        (base64 payload, the CUDA tensors it refers to: keep them alive until the server has answered).

    Raises:
        EngineError: this process has no CUDA device.
    """
    if not torch.cuda.is_available():
        raise EngineError("engine.tensor_transport 'ipc' needs CUDA in this process; use 'inline' or 'disk'")
    target = torch.device(device)
    if target.type == "cuda" and target.index is None:
        target = torch.device("cuda", torch.cuda.current_device())
    obj: Any
    if layout == "per-tensor":
        shared = {k: v.detach().to(target, dtype=dtype or v.dtype, copy=True).contiguous() for k, v in tensors.items()}
        obj = shared
    elif layout == "packed":
        shared = obj = pack(tensors, device=target, dtype=dtype)
    else:
        buffers = _pack(tensors, target, dtype)
        shared = {f"buffer{i}": flat for i, (flat, _) in enumerate(buffers)}
        obj = _host_views(buffers, {k: v.shape for k, v in tensors.items()})
    return base64.b64encode(_dumps(obj, share_cuda=True)).decode("ascii"), shared


def inline_payload(tensors: Mapping[str, torch.Tensor], *, dtype: torch.dtype | None = None) -> str:
    """One `serialized_named_tensors` entry with the tensors' data in it (CPU copies, each its own storage:
    pickling a view would send the whole storage it views).

    Args:
        tensors: PEFT-keyed adapter weights, any device and dtype.
        dtype: cast to it first (None keeps each tensor's dtype).

    Returns:
        The base64 payload: about 4/3 of the tensors' bytes.
    """
    own = {k: v.detach().to("cpu", dtype=dtype or v.dtype, copy=True).contiguous() for k, v in tensors.items()}
    return base64.b64encode(_dumps(own, share_cuda=False)).decode("ascii")


def release_ipc() -> None:
    """Free CUDA memory the server has stopped sharing (`torch.cuda.ipc_collect`); a no-op without CUDA."""
    if torch.cuda.is_available():
        torch.cuda.ipc_collect()
