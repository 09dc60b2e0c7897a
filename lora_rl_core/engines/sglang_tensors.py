"""Payloads for SGLang's `/load_lora_adapter_from_tensors`: adapter tensors as torch multiprocessing pickles.

SGLang 0.5.17 (`sglang/srt/managers/tp_worker.py`, `_deserialize_own_rank`) reads
`serialized_named_tensors[tp_rank]` with `MultiprocessingSerializer.deserialize`: base64, then an
unpickler that allows `torch.*` callables (`SafeUnpickler`), after applying its
`monkey_patch_torch_reductions` (`sglang/srt/utils/patch_torch.py`), which rebuilds a CUDA tensor on the
device whose UUID the pickle names (a plain device index is accepted too). The LoRA weights are then
copied to CPU memory (`LoRAAdapter.initialize_weights_from_tensors`), so the sender's tensors may be freed
once the server has answered.

Two transports (docs/SGLANG.md, "Tensor path"):

* `ipc`: CUDA tensors pickled by torch's `ForkingPickler` reductions, i.e. CUDA IPC handles, not data;
  the device is named by UUID as SGLang's patched reduction does, so the server may see the GPU under
  another index. Same host only; the sender keeps the tensors alive until the answer and then calls
  `release_ipc` (`torch.cuda.ipc_collect`).
* `inline`: CPU tensors pickled by the standard pickler, data included (`torch.storage._load_from_bytes`),
  so it works across hosts, at the cost of base64 in the JSON body (4/3 of the adapter's bytes).

CPU tensors are never sent by shared memory: torch's `file_system` strategy starts a `torch_shm_manager`
daemon that outlives the caller (docs/SGLANG.md, hazards), and the `file_descriptor` strategy needs the
caller's multiprocessing authkey, which a separate server does not have.
"""

from __future__ import annotations

import base64
import io
import pickle
from multiprocessing.reduction import ForkingPickler
from typing import Any
from urllib.parse import urlsplit

import torch
import torch.multiprocessing  # noqa: F401 - registers torch's ForkingPickler reductions (CUDA IPC handles)
from torch.multiprocessing import reductions

from lora_rl_core.config import TENSOR_TRANSPORTS
from lora_rl_core.errors import EngineError

_LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})
_DEVICE_ARG = 6  # index of the device in `reduce_tensor`'s CUDA rebuild args (SGLang's _REDUCE_TENSOR_ARG_DEVICE_INDEX)


def is_loopback(url: str) -> bool:
    """Whether the server at `url` runs on this host (a loopback address), where CUDA IPC can reach it."""
    return (urlsplit(url).hostname or "") in _LOOPBACK_HOSTS


def pick_transport(requested: str, *, url: str, has_path: bool) -> str:
    """The transport for one tensor load.

    `auto`: `ipc` when the server is on this host and this process has CUDA; else `disk` when a published
    folder is given (`has_path`); else `inline`. Any other value is returned as given.

    Raises:
        EngineError: `requested` is not one of `TENSOR_TRANSPORTS`.
    """
    if requested not in TENSOR_TRANSPORTS:
        raise EngineError(f"engine.tensor_transport must be one of {TENSOR_TRANSPORTS}, got {requested!r}")
    if requested != "auto":
        return requested
    if is_loopback(url) and torch.cuda.is_available():
        return "ipc"
    return "disk" if has_path else "inline"


def _reduce_with_device_uuid(tensor: torch.Tensor) -> tuple[Any, tuple[Any, ...]]:
    """torch's CUDA tensor reduction with the device index replaced by the device's UUID."""
    rebuild, args = reductions.reduce_tensor(tensor)
    if tensor.is_cuda:
        device_uuid = str(torch.cuda.get_device_properties(args[_DEVICE_ARG]).uuid)
        args = (*args[:_DEVICE_ARG], device_uuid, *args[_DEVICE_ARG + 1 :])
    return rebuild, args


def ipc_payload(tensors: dict[str, torch.Tensor], device: torch.device | str = "cuda") -> tuple[str, dict]:
    """One `serialized_named_tensors` entry carrying CUDA IPC handles of `tensors` moved to `device`.

    Args:
        tensors: PEFT-keyed adapter weights, any device and dtype.
        device: the CUDA device to share them from.

    Returns:
        (base64 payload, the CUDA tensors it refers to: keep them alive until the server has answered).

    Raises:
        EngineError: this process has no CUDA device.
    """
    if not torch.cuda.is_available():
        raise EngineError("engine.tensor_transport 'ipc' needs CUDA in this process; use 'inline' or 'disk'")
    shared = {k: v.detach().to(device, copy=True).contiguous() for k, v in tensors.items()}
    buf = io.BytesIO()
    pickler = ForkingPickler(buf, pickle.HIGHEST_PROTOCOL)
    # a private table: the process-wide reductions stay torch's own (SGLang patches them globally instead)
    pickler.dispatch_table = {**pickler.dispatch_table, torch.Tensor: _reduce_with_device_uuid}
    pickler.dump(shared)
    return base64.b64encode(buf.getvalue()).decode("ascii"), shared


def inline_payload(tensors: dict[str, torch.Tensor]) -> str:
    """One `serialized_named_tensors` entry with the tensors' data in it (CPU copies, each its own storage:
    pickling a view would send the whole storage it views).

    Args:
        tensors: PEFT-keyed adapter weights, any device and dtype.

    Returns:
        The base64 payload: about 4/3 of the tensors' bytes.
    """
    own = {k: v.detach().to("cpu", copy=True).contiguous() for k, v in tensors.items()}
    return base64.b64encode(pickle.dumps(own, protocol=pickle.HIGHEST_PROTOCOL)).decode("ascii")


def release_ipc() -> None:
    """Free CUDA memory the server has stopped sharing (`torch.cuda.ipc_collect`); a no-op without CUDA."""
    if torch.cuda.is_available():
        torch.cuda.ipc_collect()
