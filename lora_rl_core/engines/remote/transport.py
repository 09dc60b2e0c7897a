"""How an HTTP client sends an adapter given as tensors: a strategy per server dialect.

* `SafetensorsUpload` (our server): the tensors as one base64 safetensors file, serialised as the store writes
  them, so the server's sha256 of them equals the store's checksum for the same tensors.
* `SGLangTensorLoad` (real SGLang): `/load_lora_adapter_from_tensors` with torch multiprocessing payloads
  (`lora_rl_core.engines.remote.ipc`): CUDA IPC handles to a server on this host, or the data inline; or
  `/load_lora_adapter` of a PEFT folder written for the load on this host (`file`) or of the published folder
  (`disk`), as `engine.tensor_transport` asks (`auto`: resolved per server when its client is made). When
  SGLang refuses the tensors and a folder is given, the folder is loaded instead and the strategy keeps to
  folders from then on (`fallback` says why).

A strategy sends through the client's `AdapterSink` (`update`: one checked LoRA update call; `load_path`: a
load from a folder) and returns the transport it used, or None when it loaded the folder through `load_path`.
"""

from __future__ import annotations

import base64
import json
import logging
import shutil
import tempfile
from pathlib import Path
from typing import Any, Protocol

from lora_rl_core.adapters import CONFIG_FILE, MODEL_FILE, safetensors_bytes
from lora_rl_core.config import SGLANG_DEFAULTS, EngineConfig, IpcLayout, TensorDtype, TensorTransport, sglang_section
from lora_rl_core.engines.remote.wire import json_safe
from lora_rl_core.errors import EngineError, EngineUnavailable

log = logging.getLogger(__name__)


class AdapterSink(Protocol):
    """What a tensor loader needs of the HTTP client."""

    url: str

    def update(self, path: str, body: dict[str, Any], timeout_s: float | None) -> dict[str, Any]:
        """POST a LoRA update and check `LoRAUpdateOutput.success` (EngineError when refused)."""
        ...

    def load_path(self, name: str, path: str, pinned: bool, timeout_s: float | None, kind: str = "disk") -> None:
        """Load the PEFT folder `path` under `name` (`/load_lora_adapter`), counted as a `kind` load."""
        ...


class TensorLoader(Protocol):
    """A way to send an adapter's tensors; `fallback` says why it fell back to folders, else None."""

    fallback: str | None

    def load(
        self,
        sink: AdapterSink,
        name: str,
        tensors: dict,
        config: dict,
        *,
        path: str | None,
        pinned: bool,
        timeout_s: float | None,
    ) -> str | None:
        """Load `tensors` + PEFT `config` under `name`; the transport used, or None if `path` was loaded.

        Raises:
            EngineError: the server refused (and no folder to fall back to), or a transport that needs `path`.
        """
        ...


class SafetensorsUpload:
    """Our server's tensor load: one base64 safetensors file, `load_format: "safetensors"`."""

    fallback: str | None = None

    def load(
        self,
        sink: AdapterSink,
        name: str,
        tensors: dict,
        config: dict,
        *,
        path: str | None,
        pinned: bool,
        timeout_s: float | None,
    ) -> str:
        """Send the tensors as the store writes them (the server's sha256 equals the store's checksum)."""
        body = {
            "lora_name": name,
            "config_dict": json_safe(config),
            "serialized_named_tensors": [base64.b64encode(safetensors_bytes(tensors)).decode("ascii")],
            "load_format": "safetensors",
            "pinned": pinned,
        }
        sink.update("/load_lora_adapter_from_tensors", body, timeout_s)
        return "safetensors"


class SGLangTensorLoad:
    """Real SGLang's tensor load (module docstring).

    Args:
        transport: `engine.tensor_transport` resolved for the server (`server_transport`: `auto` left there is
            the published folder where a load gives one, else inline), `ipc`, `inline`, `file` or `disk`.
        layout: how `ipc` shares the tensors (`engine.tensor_layout`).
        dtype: the dtype tensors are sent in, or `keep` (`engine.tensor_dtype`).
    """

    def __init__(
        self,
        transport: TensorTransport = SGLANG_DEFAULTS.tensor_transport,
        layout: IpcLayout = SGLANG_DEFAULTS.tensor_layout,
        dtype: TensorDtype = SGLANG_DEFAULTS.tensor_dtype,
    ) -> None:
        self.transport, self.layout, self.dtype = transport, layout, dtype
        self.fallback: str | None = None

    def load(
        self,
        sink: AdapterSink,
        name: str,
        tensors: dict,
        config: dict,
        *,
        path: str | None,
        pinned: bool,
        timeout_s: float | None,
    ) -> str | None:
        """Send by the transport `pick_transport` chooses (`disk` once fallen back); fall back to `path` when
        SGLang refuses the tensors.

        Raises:
            EngineError: transport `disk` without `path`, `file` to a server not on this host, or SGLang's
                refusal with no `path` to fall back to.
            EngineUnavailable: no answer (the server may still be loading it: a second load would be refused).
        """
        from lora_rl_core.engines.remote.ipc import is_loopback, pick_transport  # lazy: torch only for tensor loads

        chosen = "disk" if self.fallback else pick_transport(self.transport, has_path=path is not None)
        if chosen == "file" and not is_loopback(sink.url):  # a setting to change, not a refusal to fall back from
            raise EngineError(
                f"engine.tensor_transport 'file' writes a local folder, which the server at {sink.url} (not on "
                "this host) cannot read: use 'inline' or 'disk'"
            )
        if chosen == "disk":
            if path is None:
                raise EngineError(
                    f"load_adapter({name!r}): engine.tensor_transport is 'disk' (or fell back to it) but no "
                    "published folder was given (path=)"
                )
            sink.load_path(name, path, pinned, timeout_s)
            return None
        try:
            if chosen == "file":
                self._send_file(sink, name, tensors, config, pinned, timeout_s)
                return None  # counted by `load_path`
            self._send(sink, name, tensors, config, pinned, timeout_s, chosen)
        except EngineUnavailable:
            raise
        except EngineError as exc:
            if path is None:
                raise
            self.fallback = f"{chosen}: {' '.join(str(exc).split())}"
            log.warning("%s refused the adapter tensors (%s); loading published folders from now on", sink.url, exc)
            sink.load_path(name, path, pinned, timeout_s)
            return None
        return chosen

    def _torch_dtype(self) -> Any:
        """The `torch.dtype` tensors are sent in (`engine.tensor_dtype`), None for `keep`."""
        import torch

        return None if self.dtype == "keep" else getattr(torch, self.dtype)

    def _send_file(
        self, sink: AdapterSink, name: str, tensors: dict, config: dict, pinned: bool, timeout_s: float | None
    ) -> None:
        """Write the tensors (in `dtype`) and config as a PEFT folder in this host's temporary directory, have
        the server on this host load it, and remove it: SGLang reads the files while it loads (into its CPU pool)
        and never again (a request naming an unloaded version is refused by our client before SGLang could
        reload it).

        Raises:
            EngineError: the server refused the folder.
        """
        from safetensors.torch import save_file

        dtype = self._torch_dtype()
        folder = Path(tempfile.mkdtemp(prefix=f"lora-rl-{name}-"))
        try:
            cast = {k: (v.to(dtype) if dtype is not None else v).contiguous() for k, v in tensors.items()}
            save_file(cast, str(folder / MODEL_FILE))
            (folder / CONFIG_FILE).write_text(json.dumps(json_safe(config)))
            sink.load_path(name, str(folder), pinned, timeout_s, kind="file")
        finally:
            # also after a timeout: a load still reading then fails on the server, and the sync retries it
            shutil.rmtree(folder, ignore_errors=True)

    def _send(
        self, sink: AdapterSink, name: str, tensors: dict, config: dict, pinned: bool, timeout_s: float | None, how: str
    ) -> None:
        """One `/load_lora_adapter_from_tensors` (tensor parallelism 1); the CUDA tensors an `ipc` payload refers
        to live until the server has answered (SGLang copies them to its CPU pool)."""
        from lora_rl_core.engines.remote.ipc import inline_payload, ipc_payload, release_ipc

        dtype = self._torch_dtype()
        shared: dict | None = None
        if how == "ipc":
            payload, shared = ipc_payload(tensors, layout=self.layout, dtype=dtype)
        else:
            payload = inline_payload(tensors, dtype=dtype)
        body = {"lora_name": name, "config_dict": json_safe(config), "serialized_named_tensors": [payload]}
        try:
            sink.update("/load_lora_adapter_from_tensors", {**body, "pinned": pinned}, timeout_s)
        finally:
            if shared is not None:
                del shared  # the last reference: ipc_collect can free the blocks SGLang has released
                release_ipc()


def tensor_loader(
    upload: str,
    *,
    url: str,
    transport: TensorTransport = SGLANG_DEFAULTS.tensor_transport,
    layout: IpcLayout = SGLANG_DEFAULTS.tensor_layout,
    dtype: TensorDtype = SGLANG_DEFAULTS.tensor_dtype,
) -> TensorLoader:
    """The loader for a dialect's `tensor_upload` (`safetensors` or `sglang`) to the server at `url`, its
    transport resolved once for that server (`server_transport`)."""
    if upload == "safetensors":
        return SafetensorsUpload()
    if transport == "auto":
        from lora_rl_core.engines.remote.ipc import server_transport  # lazy: torch only for tensor loads

        transport = server_transport(transport, url)
    return SGLangTensorLoad(transport, layout, dtype)


def sglang_tensor_load_reads_folder(engine: EngineConfig, transport: str) -> bool:
    """Whether SGLang clients of `cfg` load tensor syncs from the published folder, with `transport` (the
    run's `engine.tensor_transport`, resolved by its plan): `disk`, or `auto` (left per server) unless every
    server is on this host with CUDA here (then `ipc`); Ray replicas' servers may run on other hosts, so
    `auto` counts as the folder there. (A server that refuses the tensors falls back to the folder too;
    `lora_rl_core.run.versions.sync` then tries again once the folder is stored.)"""
    from lora_rl_core.engines.remote.ipc import server_transport  # lazy: torch only for tensor loads

    if transport != "auto":
        return transport == "disk"
    cfg = sglang_section(engine, "an SGLang tensor load")
    if cfg.ray_replicas:
        return True
    urls = cfg.urls or [f"http://{cfg.launch.host}:{cfg.launch.port}"]
    return any(server_transport("auto", url) != "ipc" for url in urls)
