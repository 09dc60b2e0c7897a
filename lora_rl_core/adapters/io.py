"""Reading and writing adapter files: safetensors weights and PEFT folders (a store version is read by
`lora_rl_core.store.sources`, which may build a store: this package never does).

Adapters come from untrusted places (a store, a folder someone hands over), so weights are
safetensors only: no pickle is ever loaded, and a safetensors header is checked (``safetensors_shapes``,
microseconds, nothing unpickled) before the tensors are read. Every error is a ``StoreError`` that
names the file or URI at fault; engines re-raise it as ``EngineError`` naming the adapter.

Left out: writing PEFT folders (``AdapterStore.pull`` writes them, verified) and reading
sharded safetensors (PEFT adapters are one file).
"""

from __future__ import annotations

import json
import logging
import math
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import fsspec

from lora_rl_core.adapters.names import (
    DATA_DIR_RE,
    MANIFEST_FILE,
    MODEL_FILE,
    PICKLE_SUFFIXES,
)
from lora_rl_core.errors import StoreError

if TYPE_CHECKING:
    import torch

TensorsAndConfig = tuple[dict[str, "torch.Tensor"], dict[str, Any]]
"""An adapter in memory: PEFT state dict (CPU tensors, keys as PEFT saves them) and its config dict."""

MAX_HEADER_BYTES = 100 * 2**20
log = logging.getLogger(__name__)
_warned_tempdir: list[bool] = []  # warn once per process
PT_METADATA: Mapping[str, str] = MappingProxyType({"format": "pt"})
"""The header metadata PEFT and transformers write (``save_pretrained``), and so do we."""
_DTYPE_BYTES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1,
    "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1,
}  # fmt: skip


# ----------------------------------------------------------------- safetensors


def safetensors_bytes(tensors: dict[str, torch.Tensor], metadata: Mapping[str, str] | None = PT_METADATA) -> bytes:
    """A safetensors file of ``tensors`` (copied to CPU, contiguous; header metadata ``metadata``, by default
    ``{"format": "pt"}``, None for none), as the store writes it and SGLang's ``load_lora_adapter_from_tensors``
    reads it.

    Written through a temporary file (``safetensors.torch.save_file``, then read back): the same bytes as
    ``safetensors.torch.save``, but its Rust writer and the read release the interpreter lock, while ``save``
    holds it while it copies every tensor into one buffer. The store and the checkpoint serialise on a
    background thread beside the step (docs/DESIGN.md, "Publish and checkpoint in the background"): beside
    ``save`` of a 7B adapter a main thread of small torch ops kept ~0.3x its speed, beside this ~0.78x
    (``benchmarks/serialise_gil.py``, 2-core AVX2 EPYC; safetensors >= 0.8, whose ``save_file`` hands Rust the
    tensors' memory). Where the temporary folder (``TMPDIR``) cannot be made or written (full, read-only),
    ``save`` makes the same bytes in memory.
    """
    from safetensors import SafetensorError  # lazy: importing torch takes ~1 s (CLI start-up)
    from safetensors.torch import save, save_file

    cpu = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
    header = None if metadata is None else dict(metadata)
    try:
        with tempfile.TemporaryDirectory(prefix="lora-rl-st-") as folder:
            path = Path(folder) / MODEL_FILE
            save_file(cpu, path, metadata=header)
            return path.read_bytes()
    except (OSError, SafetensorError) as exc:  # the folder cannot be made, or the file not written (full disk)
        if not _warned_tempdir:
            _warned_tempdir.append(True)
            log.warning(
                "writing safetensors under %s failed (%s); serialising in memory instead (set TMPDIR to a "
                "folder with room for a checkpoint)",
                tempfile.gettempdir(),
                exc,
            )
        return save(cpu, metadata=header)


def safetensors_shapes(data: bytes, where: str = MODEL_FILE) -> dict[str, list[int]]:
    """Parse and check a safetensors header without loading any tensor.

    Args:
        data: the whole file.
        where: file name or URI for messages.

    Returns:
        tensor name -> shape.

    Raises:
        StoreError: truncated file, header not JSON, unknown dtype, or a tensor's bytes outside the file.
    """
    if len(data) < 8:
        raise StoreError(f"{where} is not a safetensors file: {len(data)} bytes, shorter than the 8-byte header length")
    n = int.from_bytes(data[:8], "little")
    if n > min(len(data) - 8, MAX_HEADER_BYTES):
        raise StoreError(
            f"{where} is not a safetensors file (or is truncated): header length {n} > file size {len(data)}"
        )
    try:
        header = json.loads(data[8 : 8 + n])
    except ValueError as e:
        raise StoreError(f"{where} is not a safetensors file: its header is not JSON ({e})") from e
    if not isinstance(header, dict):
        raise StoreError(f"{where} is not a safetensors file: its header is not a JSON object")
    body = len(data) - 8 - n
    return {name: _tensor_shape(name, info, body, where) for name, info in header.items() if name != "__metadata__"}


def _tensor_shape(name: str, info: Any, body: int, where: str) -> list[int]:
    """Check one header entry: known dtype, integer shape, offsets inside the data and matching the shape."""
    entry = info if isinstance(info, dict) else {}
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    ok = dtype in _DTYPE_BYTES and isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)
    ok = ok and isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)
    if not ok or not isinstance(shape, list) or not isinstance(offsets, list):
        raise StoreError(f"{where}: tensor {name!r} has a malformed header entry (dtype, shape or data_offsets)")
    begin, end = offsets
    if not 0 <= begin <= end <= body:
        raise StoreError(f"{where}: tensor {name!r} lies outside the file (truncated?): bytes {begin}-{end} of {body}")
    if end - begin != math.prod(shape) * _DTYPE_BYTES[str(dtype)]:
        raise StoreError(f"{where}: tensor {name!r} has {end - begin} bytes, which does not match shape {shape}")
    return shape


def load_safetensors(data: bytes, where: str = MODEL_FILE) -> dict[str, torch.Tensor]:
    """CPU tensors of a safetensors file, its header checked first (``safetensors_shapes``).

    Raises:
        StoreError: a malformed or truncated file; ``where`` names it.
    """
    from safetensors.torch import load as st_load  # lazy, as in safetensors_bytes

    safetensors_shapes(data, where)
    try:
        return st_load(data)
    except Exception as e:  # safetensors raises its own SafetensorError
        raise StoreError(f"{where} is not a valid safetensors file: {e}") from e


def refuse_pickles(file_names: Iterable[str], where: str) -> None:
    """Refuse pickle checkpoints (``adapter_model.bin``, ``.pt``, ...): loading one runs arbitrary code.

    Raises:
        StoreError: naming the pickle files found in ``where`` and the fix.
    """
    pickles = sorted(n for n in file_names if n.endswith(PICKLE_SUFFIXES))
    if pickles:
        raise StoreError(
            f"{where}: pickle files {pickles} refused; adapters must be safetensors (save with safe_serialization=True)"
        )


# ----------------------------------------------------------------- folders


def peft_folder(path: str) -> str:
    """The PEFT folder of ``path`` (local path or fsspec URI): ``path`` itself, or for a store version folder
    (``<store>/<run>/adapters/vNNNNNN``, ``AdapterRef.uri``) the data folder its ``manifest.json`` names.

    Reading the files there skips the store's checksums: verify the version first (``AdapterStore.verify``),
    or read it with ``read_adapter_folder``, which does.

    Raises:
        StoreError: the manifest is unreadable or names an unsafe folder.
    """
    fs, root = fsspec.core.url_to_fs(path)
    root = root.rstrip("/")
    if fs.exists(f"{root}/{MODEL_FILE}") or not fs.exists(f"{root}/{MANIFEST_FILE}"):
        return path
    try:
        data_dir = json.loads(fs.cat_file(f"{root}/{MANIFEST_FILE}")).get("data_dir") or ""
    except (OSError, ValueError, AttributeError) as exc:
        raise StoreError(f"{path}/{MANIFEST_FILE} is unreadable: {exc}") from None
    if data_dir and (not isinstance(data_dir, str) or not DATA_DIR_RE.fullmatch(data_dir)):
        raise StoreError(f"{path}/{MANIFEST_FILE} names an unsafe data folder {data_dir!r}")
    return f"{path.rstrip('/')}/{data_dir}" if data_dir else path
