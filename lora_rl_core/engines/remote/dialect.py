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

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from lora_rl_core.engines.base import SamplingParams
from lora_rl_core.engines.remote.wire import local_peft_folder, sampling_body
from lora_rl_core.errors import EngineError


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
        versions: the server versions this client knows (a PEP 440 specifier; `connect` asks each server its
            version and refuses another), or None for any (ours: the client and server ship together).
    """

    name: str
    reports_adapter_version: bool
    guards_retired: bool
    reads_uris: bool
    takes_abort_reason: bool
    seeds_per_call: bool
    reports_state: bool
    tensor_upload: Literal["safetensors", "sglang"]
    versions: str | None = None

    def check_version(self, version: str | None, where: str) -> None:
        """Refuse a server version outside `versions` in one line naming it, where it runs (`where`: a URL or
        the interpreter that would launch it) and the versions known; `version` None (the server did not say
        one) is refused too.

        Raises:
            EngineError: the version is not one this client knows, or is not a version at all.
        """
        if self.versions is None:
            return
        known = SpecifierSet(self.versions)
        try:
            ok = version is not None and known.contains(Version(version), prereleases=True)
        except InvalidVersion:
            ok = False
        if not ok:
            said = f"SGLang {version}" if version is not None else "an SGLang that does not say its version"
            raise EngineError(
                f"{said} at {where} is not a version this client knows ({self.versions}, docs/SGLANG.md): "
                f"install one of them, e.g. pip install 'sglang{self.versions}'"
            )

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
    versions=">=0.5.17,<0.5.24",
)
"""A real SGLang server (0.5.17 to 0.5.23, docs/SGLANG.md; `pyproject.toml`'s `gpu` extra pins the same)."""

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
