"""What differs between the two servers one HTTP client (`HTTPEngine`) speaks to: a real SGLang server and our
engine server (`lora-rl serve`, `lora_rl_core.engines.serve`).

Both speak SGLang's API (docs/SGLANG.md); a `Dialect` names the few places where they differ, as facts about
the server rather than as a client subclass. The engine kinds `sglang` and `server` of `engine.type`
(`lora_rl_core.engines.registry`) pick `SGLANG` and `SERVER`. How adapter tensors travel is a strategy of its
own (`lora_rl_core.engines.remote.transport`), chosen by `tensor_upload`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from lora_rl_core.engines.base import SamplingParams
from lora_rl_core.engines.remote.wire import local_peft_folder, sampling_body


@dataclass(frozen=True)
class Dialect:
    """The facts about one kind of server that change what the HTTP client sends or trusts.

    Attributes:
        name: the `engine.type` value (`sglang`, `server`).
        reports_adapter_version: `meta_info.weight_version` is the adapter's version (ours), not the base
            weights' (SGLang's); completions are checked against it.
        guards_retired: the client refuses requests for adapters it unloaded: SGLang reloads an unloaded
            adapter silently when a request names it; our server refuses such a request itself.
        reads_uris: the server reads any fsspec URI or store version folder (ours); SGLang reads local PEFT
            folders only, so the client turns `file://` URIs and version folders into paths.
        takes_abort_reason: `/abort_request` takes `abort_message` (ours; SGLang ignores it), so requests of
            other clients end with the reason too.
        seeds_per_call: one `sampling_seed` seeds the whole call (ours); SGLang seeds each request, so request
            `i` gets `seed + i` and a group's samples differ.
        reports_state: `/paused` says whether generation is paused and `/metrics` is the server's Prometheus
            text (ours); for SGLang the client answers both from what it did itself.
        tensor_upload: how adapter tensors are sent (`transport.tensor_loader`): `safetensors` bytes (ours) or
            SGLang's torch-multiprocessing payloads (`sglang`: CUDA IPC, inline, or the published folder).
    """

    name: str
    reports_adapter_version: bool
    guards_retired: bool
    reads_uris: bool
    takes_abort_reason: bool
    seeds_per_call: bool
    reports_state: bool
    tensor_upload: Literal["safetensors", "sglang"]

    def server_path(self, path: str, url: str) -> str:
        """The adapter path as the server can read it.

        Raises:
            EngineError: SGLang cannot read `path` (not a local folder or `file://` URI; pull the version first).
        """
        return path if self.reads_uris else local_peft_folder(path, url)

    def abort_body(self, body: dict[str, Any], reason: str) -> dict[str, Any]:
        """The `/abort_request` body: SGLang's `AbortReq` fields, plus `abort_message` where the server takes it."""
        return {**body, "abort_message": reason} if self.takes_abort_reason else body

    def sampling_payload(self, params: SamplingParams, n: int) -> dict[str, Any] | list[dict[str, Any]]:
        """`sampling_params` of a `/generate` call of `n` requests with equal `params`."""
        body = sampling_body(params)
        if params.seed is None:
            return body
        if self.seeds_per_call:
            return {**body, "sampling_seed": params.seed}
        return [{**body, "sampling_seed": params.seed + i} for i in range(n)]


SGLANG = Dialect(
    name="sglang",
    reports_adapter_version=False,
    guards_retired=True,
    reads_uris=False,
    takes_abort_reason=False,
    seeds_per_call=False,
    reports_state=False,
    tensor_upload="sglang",
)
"""A real SGLang server (0.5.17 to 0.5.23, docs/SGLANG.md)."""

SERVER = Dialect(
    name="server",
    reports_adapter_version=True,
    guards_retired=False,
    reads_uris=True,
    takes_abort_reason=True,
    seeds_per_call=True,
    reports_state=True,
    tensor_upload="safetensors",
)
"""Our engine server, `lora-rl serve` (`lora_rl_core.engines.serve`)."""
