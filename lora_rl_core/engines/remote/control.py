"""The control calls of `HTTPEngine` (pause, resume, flush, paused state, health, version, metrics), as a mixin of it:
what differs between a real SGLang server and ours is the dialect's (`reports_state`: ours reports its paused
state and Prometheus metrics; for SGLang the client answers from its own calls and counters)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import httpx

from lora_rl_core.engines.base import PAUSE_MODES
from lora_rl_core.engines.remote.wire import json_or_empty, parse_metrics
from lora_rl_core.errors import EngineError, EngineUnavailable

if TYPE_CHECKING:
    from lora_rl_core.engines.remote.dialect import Dialect
    from lora_rl_core.engines.remote.tracking import InFlightRequests, LostCalls, RetiredAdapters

SGLANG_PAUSE_MODE = {"abort": "retract"}
"""With `abort="detach"`: the mode SGLang is paused in for a `pause(mode)` (an `abort` pause aborts its queued
requests, whose adapter references 0.5.17 never releases; `retract` keeps them to finish after the resume)."""


class ControlCalls:
    """`pause`, `resume`, `flush_cache`, `is_paused`, `health`, `server_version` and `metrics` of `HTTPEngine`
    (which sets the attributes declared here)."""

    url: str
    dialect: Dialect
    detach: bool
    tensors: Any
    _http: httpx.Client
    _paused: bool
    _closed: bool
    _version_pending: bool
    _requests: InFlightRequests
    _retired: RetiredAdapters
    _lost: LostCalls
    _loads: Any
    _kept: set[str]
    _call: Callable[..., httpx.Response]  # HTTPEngine._call

    def pause(self, mode: str = "in_place") -> None:
        """`/pause_generation` with `mode` in abort | retract | in_place; with `abort`, this client's requests
        in flight end with `abort_reason="paused"`. With `detach`, SGLang is paused in `retract` mode instead
        of `abort` (`SGLANG_PAUSE_MODE`): it finishes those requests after the resume."""
        if mode not in PAUSE_MODES:
            raise EngineError(f"pause mode must be one of {PAUSE_MODES}, got {mode!r}")
        if mode == "abort":  # the server aborts every request; this client's end with reason `paused`
            self._requests.keep_reason(None, "paused")
        sent = SGLANG_PAUSE_MODE.get(mode, mode) if self.detach else mode
        self._call("POST", "/pause_generation", json_body={"mode": sent})
        self._paused = True

    def resume(self) -> None:
        """`/continue_generation`."""
        self._call("POST", "/continue_generation", json_body={})
        self._paused = False

    def flush_cache(self) -> bool:
        """`/flush_cache`: True when flushed, False when the server refused (HTTP 400: requests running)."""
        return self._call("POST", "/flush_cache", accept=(400,)).status_code < 400

    def is_paused(self) -> bool:
        """Whether generation is paused. Our server reports it in `/paused` (other clients may pause it). For
        SGLang, whether this client paused it (`pause` without `resume` since), with no HTTP call: SGLang
        reports no paused state, and its `/health` runs a 1-token generation (at least 1 s on 0.5.17, which
        every adapter sync paid while `retire_stale` asked `health()`).

        Raises:
            EngineUnavailable: our server did not answer within 20 s, or is unreachable.
            EngineError: our server's answer says nothing about pausing (its engine cannot say); closed.
        """
        if self._closed:
            raise EngineError(f"{self!r} is closed")
        if not self.dialect.reports_state:
            return self._paused
        facts = json_or_empty(self._call("GET", "/paused", timeout_s=20.0, accept=(503,)))
        if not isinstance(facts.get("paused"), bool):
            raise EngineError(f"{self.url}/paused does not say whether generation is paused: {facts}")
        return facts["paused"]

    def health(self) -> dict[str, Any]:
        """`{"ok", "paused", "url"}` from `/health`, with every fact our server reports (never raises: an
        unreachable server is not ok).

        While this client has paused an SGLang server it asks `/model_info` instead: SGLang's `/health` runs a
        1-token generation, which cannot run while paused, and answers only after its 20 s health timeout
        (`SGLANG_HEALTH_CHECK_TIMEOUT`; seen on 0.5.17: `retire_stale` asks `health()` and held a sync for
        those 20 s while the resume waited behind it)."""
        path = "/model_info" if self._paused and not self.dialect.reports_state else "/health"
        try:
            response = self._http.get(path, timeout=20.0)
        except httpx.HTTPError as exc:
            return {"ok": False, "paused": self._paused, "url": self.url, "error": str(exc)}
        if not self.dialect.reports_state:
            return {"ok": response.status_code == 200, "paused": self._paused, "url": self.url}
        facts = json_or_empty(response)
        return {**facts, "ok": response.status_code == 200 and facts.get("ok", True), "url": self.url}

    def check_version(self) -> None:
        """Refuse a server of a version the dialect does not know (`Dialect.check_version`). `connect` asks
        once; where the server could not be reached then, the question is pending and asked before this
        client's next call goes out.

        Raises:
            EngineError: the version is not one the dialect knows (or the server says none).
            EngineUnavailable: the server cannot be reached (still pending).
        """
        if self.dialect.versions is None:
            return
        self._version_pending = False  # first: asking goes through `_call`, which asks while it is pending
        try:
            self.dialect.check_version(self.server_version(), self.url)
        except EngineUnavailable:
            self._version_pending = True
            raise

    def server_version(self) -> str | None:
        """The server's version as its `/server_info` says it (SGLang's; `/get_server_info` where a server has
        only that), or None where it says none.

        Raises:
            EngineUnavailable / EngineError: as every call (unreachable, an error status other than 404).
        """
        for path in ("/server_info", "/get_server_info"):
            response = self._call("GET", path, accept=(404,))
            if response.status_code != 404:
                version = json_or_empty(response).get("version")
                return version if isinstance(version, str) else None
        return None

    def metrics(self) -> dict[str, Any]:
        """Our server's `/metrics`, read back into `{"adapters": {name: {field: value}}, ...}`. For SGLang this
        client's counters: `{"adapters": {name: {"requests", "tokens"}}, "in_flight", "paused",
        "revived_adapters", "adapter_loads": {transport: count}, "tensor_fallback": why or None,
        "retired_resident": versions retired here but left on the server (`retire="keep"`), "lost_calls":
        `/generate` calls SGLang failed whole (HTTP 499), "resent_requests": requests of them to be sent again
        (a fresh rid; those past the deadline end `timeout` instead)}`."""
        if self.dialect.reports_state:
            return parse_metrics(self._call("GET", "/metrics").text)
        return {
            "adapters": self._requests.counts(),
            "in_flight": len(self._requests),
            "paused": self._paused,
            "revived_adapters": self._retired.revived,
            "adapter_loads": dict(self._loads),
            "tensor_fallback": self.tensors.fallback,
            "retired_resident": len(self._kept),
            "lost_calls": self._lost.counts["calls"],
            "resent_requests": self._lost.counts["resent"],
        }
