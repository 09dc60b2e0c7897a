"""The engine server's adapter routes: `/load_lora_adapter`, `/load_lora_adapter_from_tensors` and
`/unload_lora_adapter`, answered with SGLang's `LoRAUpdateOutput` (`success`, `error_message`,
`loaded_adapters`: name -> path).

Choices made here:

* A refused load or unload is HTTP 400 with `success: false` (and SGLang's `error` shape), never a 500.
* Tensor loads take only `load_format: "safetensors"` with one base64 safetensors file: SGLang's torch
  multiprocessing pickles are refused, never deserialised. The header is checked before anything loads.
* The sha256 of the `adapter_model.safetensors` bytes loaded here is kept per name (`/v1/models` reports
  it; `sync_version` compares it with the store's checksum).
* Without `lora_path`, or with a bare `RUN@VERSION`, a server with a store resolves the name there.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
import time
from typing import Any

import anyio
import fsspec
from fastapi.responses import JSONResponse
from prometheus_client import Histogram

from lora_rl_core.adapters import load_safetensors, peft_folder
from lora_rl_core.engines.base import ServingEngine
from lora_rl_core.engines.serve.api import HTTPError, LoadIn, LoadTensorsIn, UnloadIn, error_response, run_blocking
from lora_rl_core.errors import EngineError, LoraRLError, StoreError

TENSOR_ROOT = "__tensor__"  # SGLang's lora_path for adapters loaded from tensors


class AdapterRoutes:
    """The adapter-control route handlers of `EngineServer`, and what the server knows of the loads made
    through it (`loaded`: name -> {"path", "sha256"}).

    Args:
        engine: the engine served.
        store: an `AdapterStore`; lets `/load_lora_adapter` take `RUN@VERSION` or an adapter name.
        control_timeout_s: deadline of one load or unload, seconds (HTTP 504 after it).
        load_seconds: histogram of load wall times in seconds, label `source` (`path` or `tensors`).
    """

    def __init__(self, engine: ServingEngine, *, store: Any, control_timeout_s: float, load_seconds: Histogram) -> None:
        self.engine = engine
        self.store = store
        self.control_timeout_s = control_timeout_s
        self.load_seconds = load_seconds
        self.loaded: dict[str, dict[str, Any]] = {}

    async def load_lora_adapter(self, body: LoadIn) -> JSONResponse:
        """`POST /load_lora_adapter`: load a PEFT folder (local path or fsspec URI) under `lora_name`; a refusal
        is HTTP 400 with `success: false`, a load past `control_timeout_s` HTTP 504."""
        try:
            path = self._resolve(body.lora_name, body.lora_path)
            start = time.perf_counter()
            await run_blocking(
                self.control_timeout_s, self.engine.load_adapter, body.lora_name, path=path, pinned=body.pinned
            )
            self.load_seconds.labels("path").observe(time.perf_counter() - start)
            sha = await anyio.to_thread.run_sync(_folder_sha256, path)
        except (LoraRLError, HTTPError) as exc:
            return await self._update_failed(exc)
        self.loaded[body.lora_name] = {"path": path, "sha256": sha}
        return await self._update_ok()

    def _resolve(self, name: str, path: str | None) -> str:
        if path is not None and (self.store is None or "://" in path or "/" in path or os.path.exists(path)):
            return path
        if self.store is None:
            raise EngineError(f"load_lora_adapter({name!r}) needs lora_path (this server has no --store)")
        return self.store.resolve(path or name).uri

    async def load_lora_adapter_from_tensors(self, body: LoadTensorsIn) -> JSONResponse:
        """`POST /load_lora_adapter_from_tensors`: base64 safetensors bytes plus the PEFT config dict."""
        if body.load_format != "safetensors":
            message = (
                f"load_format {body.load_format!r} refused: this server accepts only load_format='safetensors' "
                "with serialized_named_tensors=[base64 of a safetensors file]; pickle payloads (torch "
                "multiprocessing, flattened_bucket) are never deserialised"
            )
            return await self._update_failed(HTTPError(400, message))
        try:
            start = time.perf_counter()
            sha = await run_blocking(self.control_timeout_s, self._load_tensors, body)
            self.load_seconds.labels("tensors").observe(time.perf_counter() - start)
        except (LoraRLError, HTTPError) as exc:
            return await self._update_failed(exc)
        self.loaded[body.lora_name] = {"path": TENSOR_ROOT, "sha256": sha}
        return await self._update_ok()

    def _load_tensors(self, body: LoadTensorsIn) -> str:
        payloads = body.serialized_named_tensors or []
        if len(payloads) != 1:
            raise EngineError(f"serialized_named_tensors must hold exactly one safetensors file, got {len(payloads)}")
        try:
            data = base64.b64decode(payloads[0], validate=True)
        except (binascii.Error, ValueError) as exc:
            raise EngineError(f"serialized_named_tensors[0] is not base64: {exc}") from None
        try:
            tensors = load_safetensors(data, "serialized_named_tensors[0]")  # header checked before loading
        except StoreError as exc:
            raise EngineError(str(exc)) from None
        self.engine.load_adapter(body.lora_name, tensors=tensors, config=body.config_dict, pinned=body.pinned)
        return hashlib.sha256(data).hexdigest()

    async def unload_lora_adapter(self, body: UnloadIn) -> JSONResponse:
        """`POST /unload_lora_adapter`."""
        try:
            await run_blocking(self.control_timeout_s, self.engine.unload_adapter, body.lora_name)
        except (LoraRLError, HTTPError) as exc:
            return await self._update_failed(exc)
        self.loaded.pop(body.lora_name, None)
        return await self._update_ok()

    async def loaded_adapters(self) -> dict[str, str]:
        """`LoRAUpdateOutput.loaded_adapters`: every adapter the engine lists -> its path (`root`)."""
        listed = await run_blocking(self.control_timeout_s, self.engine.list_adapters)
        return {name: self.root(name, info) for name, info in listed.items()}

    async def _update_ok(self) -> JSONResponse:
        body = {"success": True, "error_message": None, "loaded_adapters": await self.loaded_adapters()}
        return JSONResponse(body)

    async def _update_failed(self, exc: Exception) -> JSONResponse:
        """`LoRAUpdateOutput` with success=false (HTTP 400), plus SGLang's `error` shape."""
        message = exc.message if isinstance(exc, HTTPError) else str(exc)
        status = exc.status if isinstance(exc, HTTPError) else 400
        loaded = await self.loaded_adapters()
        return error_response(status, message, success=False, error_message=message, loaded_adapters=loaded)

    def root(self, name: str, info: dict[str, Any]) -> str:
        """Where adapter `name` was loaded from (its `/v1/models` card's `root`): the path given here, else
        the engine's `path`/`source` in `info` (its `list_adapters` entry), `__tensor__` for tensors."""
        if name in self.loaded:
            return self.loaded[name]["path"]
        source = info.get("path") or info.get("source")
        return TENSOR_ROOT if source in (None, "tensors") else str(source)

    def sha256(self, name: str) -> str | None:
        """The sha256 of the safetensors bytes loaded here under `name`; None when unknown (not loaded
        through this server, or its folder could not be read)."""
        return self.loaded.get(name, {}).get("sha256")


def _folder_sha256(path: str) -> str | None:
    """sha256 of the `adapter_model.safetensors` the engine read from `path` (a PEFT folder, or a store
    version folder: its data folder), or None when it cannot be read."""
    try:
        fs, root = fsspec.core.url_to_fs(peft_folder(path))
        return hashlib.sha256(fs.cat_file(f"{root.rstrip('/')}/adapter_model.safetensors")).hexdigest()
    except (OSError, ValueError, LoraRLError):
        return None
