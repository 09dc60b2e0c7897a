"""HTTP engines: a client of a real SGLang server, of our engine server, and a spread over several.

`SGLangEngine` speaks the SGLang API exactly as docs/SGLANG.md lists it (sglang
0.5.23 `sglang/srt/entrypoints/http_server.py`, structs in `sglang/srt/managers/io_struct.py`):
`/generate` with `input_ids` batches, a `lora_path` list (adapter name per prompt, null = base
model), `rid` list and `return_logprob`; `/load_lora_adapter`, `/unload_lora_adapter`,
`/pause_generation`, `/continue_generation`, `/flush_cache`, `/abort_request`, `/v1/models`.
`ServerEngine` adds what only our server (`lora_rl_core.engines.server`) offers: tensor loads as
safetensors bytes, adapter checksums, engine health and metrics.

Choices made here:

* Every HTTP call has a timeout (`timeout_s` for generation, `control_timeout_s` for the rest).
  A transport failure, a timeout or HTTP 502/503/504 raises `EngineUnavailable` (retry later);
  any other error status raises `EngineError` carrying the server's message.
* `generate` groups requests with equal sampling params into `/generate` batch calls of at most
  `max_batch_requests` prompts, sent concurrently, and maps the answers back by position.
  Against real SGLang a seeded batch gets one seed per request (`sampling_seed + i`), since
  SGLang seeds each request and equal seeds would make a group's samples identical; our server
  takes one seed per call.
* Real SGLang reads adapters from local folders: `file://` URIs are turned into paths and a store
  version folder into the folder of its files (`peft_folder`); other URIs are refused (pull the
  version first). Loading tensors into real SGLang is refused: its
  tensor endpoint takes torch multiprocessing pickles, usable on the same host only.
* `pause`/`resume` state of a real SGLang server is known only from this client's own calls.
* `MultiEngine` keeps every sample of one prompt on one engine (prefix cache) and deals
  prompts round-robin; loads and unloads go to every engine.

Left out: streaming, OpenAI-compatible endpoints, retries (the caller decides).
"""

from __future__ import annotations

import base64
import itertools
import json
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import httpx

from lora_rl_core.adapters import adapter_version, check_adapter_name, peft_folder, safetensors_bytes
from lora_rl_core.engines.base import (
    ABORT_REASONS,
    PAUSE_MODES,
    Completion,
    GenerationRequest,
    InferenceEngine,
    SamplingParams,
)
from lora_rl_core.errors import EngineError, StoreError

_ADAPTER_SAMPLES = {  # `lora_rl_adapter_<sample>` of our server's /metrics -> engine.metrics() field
    "requests_total": "requests",
    "tokens_total": "tokens",
    "loads_total": "loads",
    "evictions_total": "evictions",
    "load_seconds_total": "load_seconds_total",
    "in_flight": "in_flight",
    "resident": "resident",
    "pinned": "pinned",
    "version": "version",
}


class EngineUnavailable(EngineError):
    """The engine could not be reached, or did not answer in time; the call may succeed later."""


class SGLangEngine:
    # Real SGLang's meta_info.weight_version names the base weights, not the LoRA adapter; ours names the adapter.
    reports_adapter_version = False
    """`InferenceEngine` over a real SGLang server's HTTP API.

    Args:
        url: server root, e.g. `http://127.0.0.1:30000`.
        api_key: sent as `Authorization: Bearer KEY` on every call.
        timeout_s: deadline of one `generate` call, seconds.
        control_timeout_s: deadline of every other call, seconds.
        max_batch_requests: prompts per `/generate` call.
        max_concurrency: `/generate` calls in flight at once from this client.
    """

    def __init__(
        self,
        url: str,
        *,
        api_key: str | None = None,
        timeout_s: float = 600.0,
        control_timeout_s: float = 60.0,
        max_batch_requests: int = 256,
        max_concurrency: int = 4,
    ) -> None:
        if not url.startswith(("http://", "https://")):
            raise EngineError(f"engine URL {url!r} must start with http:// or https://")
        self.url = url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        timeout = httpx.Timeout(control_timeout_s, connect=min(10.0, control_timeout_s))
        self._http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout)
        self.timeout_s = timeout_s
        self.control_timeout_s = control_timeout_s
        self._max_batch = max_batch_requests
        self._pool = ThreadPoolExecutor(max_workers=max_concurrency, thread_name_prefix="engine-http")
        self._lock = threading.Lock()
        self._in_flight: set[str] = set()
        self._abort_reasons: dict[str, str] = {}  # request id -> first reason given to `abort` (SGLang keeps none)
        self._closed = False
        self._counters: defaultdict[str, Counter[str]] = defaultdict(Counter)
        self._paused = False

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"

    def close(self) -> None:
        """Close the HTTP connections and the worker threads (idempotent); later calls raise EngineError.
        The server is not told: requests it is running finish there."""
        self._closed = True
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._http.close()

    def members(self) -> list[SGLangEngine]:
        """`[self]`: a single engine (`InferenceEngine.members`)."""
        return [self]

    def __enter__(self) -> SGLangEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------- transport

    def _call(
        self,
        method: str,
        path: str,
        *,
        json_body: Any = None,
        timeout_s: float | None = None,
        accept: tuple[int, ...] = (),
    ) -> httpx.Response:
        """One HTTP call; statuses in `accept` are answers, not errors.
        Raises EngineUnavailable (transport, timeout) or EngineError (closed client, error status)."""
        if self._closed:
            raise EngineError(f"{self!r} is closed")
        timeout = timeout_s if timeout_s is not None else self.control_timeout_s
        try:
            response = self._http.request(method, path, json=json_body, timeout=timeout)
        except httpx.TimeoutException:
            raise EngineUnavailable(f"{method} {self.url}{path}: no answer within {timeout:g} s") from None
        except httpx.TransportError as exc:
            raise EngineUnavailable(f"{method} {self.url}{path}: cannot reach the engine: {exc}") from None
        if response.status_code >= 400 and response.status_code not in accept:
            error = EngineUnavailable if response.status_code in (502, 503, 504) else EngineError
            raise error(f"{_error_message(response)} ({method} {self.url}{path}: HTTP {response.status_code})")
        return response

    # ------------------------------------------------------------- generation

    def generate(
        self, requests: list[GenerationRequest], *, timeout_s: float | None = None, inline: bool = False
    ) -> list[Completion]:
        """Complete every request with its named adapter; order is preserved.

        Raises:
            EngineError: the server refused the batch (unknown adapter, bad params); its message is kept.
            EngineUnavailable: no answer within `timeout_s` (default `self.timeout_s`), or unreachable.
        """
        deadline = time.monotonic() + (timeout_s if timeout_s is not None else self.timeout_s)
        chunks = _chunks(requests, self._max_batch)
        if len(chunks) == 1:
            done = [self._generate_chunk(chunks[0][1], deadline)]
        else:
            done = list(self._pool.map(lambda chunk: self._generate_chunk(chunk[1], deadline), chunks))
        out: list[Completion | None] = [None] * len(requests)
        for (indices, _), completions in zip(chunks, done, strict=True):
            for i, completion in zip(indices, completions, strict=True):
                out[i] = completion
        return out  # type: ignore[return-value]  # every slot is filled above

    def submit(self, request: GenerationRequest) -> Future[Completion]:
        """Complete one request in the background; the future raises as `generate` does.

        Raises:
            EngineError: the client is closed.
        """
        if self._closed:
            raise EngineError(f"{self!r} is closed")
        deadline = time.monotonic() + self.timeout_s
        return self._pool.submit(lambda: self._generate_chunk([request], deadline)[0])

    def _generate_chunk(self, requests: list[GenerationRequest], deadline: float) -> list[Completion]:
        payload = {
            "input_ids": [list(r.prompt_ids) for r in requests],
            "sampling_params": self._sampling_payload(requests[0].sampling, len(requests)),
            "lora_path": [r.adapter for r in requests],
            "rid": [r.request_id for r in requests],
            "return_logprob": True,
            "stream": False,
        }
        left = deadline - time.monotonic()
        if left <= 0:
            raise EngineUnavailable(f"POST {self.url}/generate: deadline passed before the call was sent")
        with self._tracking(requests) as reasons:
            try:
                answer = self._call("POST", "/generate", json_body=payload, timeout_s=left).json()
            except EngineUnavailable:
                self._abort_quietly([r.request_id for r in requests])  # don't leave the server working on them
                raise
        if not isinstance(answer, list) or len(answer) != len(requests):
            raise EngineError(f"{self.url}/generate answered {type(answer).__name__}, not {len(requests)} outputs")
        completions = [
            _to_completion(
                r, out, self.url, check_version=self.reports_adapter_version, reason=reasons.get(r.request_id)
            )
            for r, out in zip(requests, answer, strict=True)
        ]
        self._count(completions)
        return completions

    def _sampling_payload(self, params: SamplingParams, n: int) -> dict[str, Any] | list[dict[str, Any]]:
        """SGLang seeds each request: give request i the seed `seed + i` so a group's samples differ."""
        base = _sampling(params)
        if params.seed is None:
            return base
        return [{**base, "sampling_seed": params.seed + i} for i in range(n)]

    @contextmanager
    def _tracking(self, requests: list[GenerationRequest]) -> Iterator[dict[str, str]]:
        """Mark `requests` in flight (what `abort` and `pause("abort")` keep reasons for) during the call.
        Yields a dict that, on exit, holds the reasons given to their aborts meanwhile (request id -> reason);
        this client forgets them then, whether or not the call succeeded."""
        ids = {r.request_id for r in requests}
        reasons: dict[str, str] = {}
        with self._lock:
            self._in_flight |= ids
        try:
            yield reasons
        finally:
            with self._lock:
                self._in_flight -= ids
                reasons.update((i, self._abort_reasons.pop(i)) for i in ids if i in self._abort_reasons)

    def _count(self, completions: list[Completion]) -> None:
        with self._lock:
            for c in completions:
                self._counters[c.adapter or "__base__"].update(requests=1, tokens=len(c.completion_ids))

    def _abort_quietly(self, request_ids: list[str]) -> None:
        """Best effort, at most ~5 s in all: the server may be what is failing."""
        deadline = time.monotonic() + 5.0
        for rid in request_ids:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            try:
                self._call("POST", "/abort_request", json_body={"rid": rid, "abort_all": False}, timeout_s=left)
            except EngineError:
                return

    def abort(self, request_id: str | None = None, *, reason: str = "aborted") -> int:
        """Abort one request (by id) or every request on the server (None) with `/abort_request`.

        SGLang's `/abort_request` takes no reason (`AbortReq` is `{rid, abort_all}`): this client keeps
        `reason` for its own requests in flight and sets it as `abort_reason` on their completions when the
        server's answer names no reason of its own (SGLang's prose). A request keeps the first reason given:
        a later `abort` or `pause("abort")` does not end it again.

        Returns:
            How many requests were aborted: the server's count where it reports one (ours does), else
            this client's own in-flight requests that match (real SGLang answers an empty 200).

        Raises:
            EngineError: `reason` is not one of `ABORT_REASONS`, or the server refused.
        """
        if reason not in ABORT_REASONS:
            raise EngineError(f"abort reason {reason!r} is not one of {ABORT_REASONS}")
        with self._lock:
            known = set(self._in_flight) if request_id is None else {request_id} & self._in_flight
            self._keep_reason(known, reason)  # before the call: the answer may come first
        body = {"rid": "", "abort_all": True} if request_id is None else {"rid": request_id, "abort_all": False}
        response = self._call("POST", "/abort_request", json_body=self._abort_body(body, reason))
        reported = _json_or_empty(response).get("aborted")
        return reported if isinstance(reported, int) else len(known)

    def _keep_reason(self, request_ids: set[str], reason: str) -> None:
        """Remember `reason` for these requests unless one was given before (call under `self._lock`)."""
        for rid in request_ids:
            self._abort_reasons.setdefault(rid, reason)

    def _abort_body(self, body: dict[str, Any], reason: str) -> dict[str, Any]:
        """The `/abort_request` body: SGLang's `AbortReq` fields only."""
        return body

    # ------------------------------------------------------------- adapters

    def load_adapter(
        self,
        name: str,
        *,
        path: str | None = None,
        tensors: dict | None = None,
        config: dict | None = None,
        pinned: bool = False,
        timeout_s: float | None = None,
    ) -> None:
        """Load a PEFT adapter folder under `name` (`/load_lora_adapter`).

        Raises:
            EngineError: bad name, tensors given (see the module docstring), a path the server cannot
                read, or the server's refusal (already loaded, rank or target modules outside the pool).
        """
        _check_name(name)
        if tensors is not None:
            raise EngineError(
                f"{self.url}: loading tensors into a real SGLang server is not supported: its "
                "/load_lora_adapter_from_tensors takes torch multiprocessing pickles (same host only). "
                "Publish the version to the store and load it by path (the store path) instead"
            )
        if path is None:
            raise EngineError(f"load_adapter({name!r}) needs path=")
        body = {"lora_name": name, "lora_path": self._server_path(path), "pinned": pinned}
        self._update("/load_lora_adapter", body, timeout_s)

    def _server_path(self, path: str) -> str:
        """A PEFT folder SGLang can read: `file://` URIs become local paths, a store version folder becomes
        the folder of its files (`peft_folder`); other URIs are refused."""
        scheme, sep, rest = path.partition("://")
        if not sep or scheme == "file":
            try:
                return peft_folder(rest if sep else path)
            except StoreError as exc:
                raise EngineError(str(exc)) from None
        raise EngineError(
            f"{self.url}: SGLang reads adapters from a local folder, not {path!r}: pull the version to a folder "
            "the server can read (`lora-rl adapters pull`) or use a shared filesystem"
        )

    def _update(self, path: str, body: dict[str, Any], timeout_s: float | None) -> dict[str, Any]:
        """POST a LoRA update and check `LoRAUpdateOutput.success`."""
        answer = _json_or_empty(self._call("POST", path, json_body=body, timeout_s=timeout_s))
        if answer.get("success") is False:
            raise EngineError(f"{answer.get('error_message') or 'refused'} ({self.url}{path})")
        return answer

    def unload_adapter(self, name: str, *, timeout_s: float = 30.0) -> None:
        """Unload `name` (`/unload_lora_adapter`).

        Raises:
            EngineError: unknown name, or the server's refusal.
            EngineUnavailable: no answer within `timeout_s`: SGLang's unload waits without timeout for
                the adapter's requests (hangs: sglang#36894); the server may be stuck.
        """
        self._update("/unload_lora_adapter", {"lora_name": name}, timeout_s)

    def list_adapters(self) -> dict[str, dict[str, Any]]:
        """Adapters from `/v1/models` (cards with a `parent`): name -> {path, version, and any
        of sha256, in_flight, pinned, resident the server reports}."""
        cards = _json_or_empty(self._call("GET", "/v1/models")).get("data") or []
        out = {}
        for card in cards:
            if card.get("parent") is None:
                continue
            extra = {k: card[k] for k in ("sha256", "in_flight", "pinned", "resident") if card.get(k) is not None}
            out[card["id"]] = {"path": card.get("root"), "version": adapter_version(card["id"]), **extra}
        return out

    # ------------------------------------------------------------- control

    def pause(self, mode: str = "in_place") -> None:
        """`/pause_generation` with `mode` in abort | retract | in_place; with `abort`, this client's requests
        in flight end with `abort_reason="paused"`."""
        if mode not in PAUSE_MODES:
            raise EngineError(f"pause mode must be one of {PAUSE_MODES}, got {mode!r}")
        if mode == "abort":  # the server aborts every request; this client's end with reason `paused`
            with self._lock:
                self._keep_reason(self._in_flight, "paused")
        self._call("POST", "/pause_generation", json_body={"mode": mode})
        self._paused = True

    def resume(self) -> None:
        """`/continue_generation`."""
        self._call("POST", "/continue_generation", json_body={})
        self._paused = False

    def flush_cache(self) -> bool:
        """`/flush_cache`: True when flushed, False when the server refused (HTTP 400: requests running)."""
        return self._call("POST", "/flush_cache", accept=(400,)).status_code < 400

    def health(self) -> dict[str, Any]:
        """`{"ok", "paused", "url"}` from `/health` (never raises: an unreachable server is not ok)."""
        try:
            response = self._http.get("/health", timeout=20.0)
        except httpx.HTTPError as exc:
            return {"ok": False, "paused": self._paused, "url": self.url, "error": str(exc)}
        return {"ok": response.status_code == 200, "paused": self._paused, "url": self.url}

    def metrics(self) -> dict[str, Any]:
        """This client's counters: `{"adapters": {name: {"requests", "tokens"}}, "in_flight", "paused"}`."""
        with self._lock:
            adapters = {name: dict(counts) for name, counts in self._counters.items()}
            return {"adapters": adapters, "in_flight": len(self._in_flight), "paused": self._paused}


class ServerEngine(SGLangEngine):
    """`SGLangEngine` for our engine server (`lora-rl serve`): adds tensor loads (safetensors bytes),
    fsspec URIs as adapter paths, the server's health facts and its Prometheus metrics."""

    reports_adapter_version = True

    def _server_path(self, path: str) -> str:
        return path  # the server reads any fsspec URI

    def _abort_body(self, body: dict[str, Any], reason: str) -> dict[str, Any]:
        """Our server also takes the reason (`abort_message`, a field of SGLang's `AbortReq` that its
        `/abort_request` ignores), so requests this client did not send end with it too."""
        return {**body, "abort_message": reason}

    def _sampling_payload(self, params: SamplingParams, n: int) -> dict[str, Any]:
        payload = _sampling(params)
        return payload if params.seed is None else {**payload, "sampling_seed": params.seed}

    def load_adapter(
        self,
        name: str,
        *,
        path: str | None = None,
        tensors: dict | None = None,
        config: dict | None = None,
        pinned: bool = False,
        timeout_s: float | None = None,
    ) -> None:
        """Load from a folder / fsspec URI (`path`), or from `tensors` + PEFT `config` sent as one
        base64 safetensors file (`/load_lora_adapter_from_tensors`, `load_format: "safetensors"`).

        The bytes are serialised as the store writes them, so the server's sha256 of them equals the
        store's checksum for the same tensors.
        """
        if tensors is None:
            super().load_adapter(name, path=path, pinned=pinned, timeout_s=timeout_s)
            return
        _check_name(name)
        if config is None:
            raise EngineError(f"load_adapter({name!r}, tensors=...) needs config= (the PEFT config dict)")
        body = {
            "lora_name": name,
            "config_dict": _json_safe(config),
            "serialized_named_tensors": [base64.b64encode(safetensors_bytes(tensors)).decode("ascii")],
            "load_format": "safetensors",
            "pinned": pinned,
        }
        self._update("/load_lora_adapter_from_tensors", body, timeout_s)

    def health(self) -> dict[str, Any]:
        """The server engine's `health()` facts from `/health`, plus `url`."""
        try:
            response = self._http.get("/health", timeout=20.0)
        except httpx.HTTPError as exc:
            return {"ok": False, "url": self.url, "error": str(exc)}
        facts = _json_or_empty(response)
        return {**facts, "ok": response.status_code == 200 and facts.get("ok", True), "url": self.url}

    def metrics(self) -> dict[str, Any]:
        """The server's `/metrics`, read back into `{"adapters": {name: {field: value}}, ...}`."""
        from prometheus_client.parser import text_string_to_metric_families

        text = self._call("GET", "/metrics").text
        adapters: defaultdict[str, dict[str, float]] = defaultdict(dict)
        out: dict[str, Any] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                field = _ADAPTER_SAMPLES.get(sample.name.removeprefix("lora_rl_adapter_"))
                if field is not None and "adapter" in sample.labels:
                    adapters[sample.labels["adapter"]][field] = sample.value
                elif sample.name.startswith("lora_rl_engine_") and not sample.labels:
                    out[sample.name.removeprefix("lora_rl_engine_").removesuffix("_total")] = sample.value
        return {**out, "adapters": dict(adapters)}


class MultiEngine:
    """Several engines behind one `InferenceEngine`: generation is spread, adapter changes broadcast.

    Args:
        engines: any engines of the protocol (HTTP clients, embedded engines, or a mix).
    """

    def __init__(self, engines: Sequence[InferenceEngine]) -> None:
        if not engines:
            raise EngineError("MultiEngine needs at least one engine")
        self.engines = list(engines)
        self._turn = itertools.count()
        self._pool = ThreadPoolExecutor(max_workers=max(2, len(self.engines)), thread_name_prefix="multi-engine")
        self._closed = False

    def __repr__(self) -> str:
        return f"MultiEngine({self.engines!r})"

    def generate(
        self, requests: list[GenerationRequest], *, timeout_s: float | None = None, inline: bool = False
    ) -> list[Completion]:
        """Deal prompts round-robin (all samples of a prompt on one engine); order is preserved.

        Raises:
            EngineError: naming the engine that failed (no silent retry on another engine); closed.
        """
        self._check_open()
        shares = self._spread(requests)
        futures = [
            self._pool.submit(_generate_on, engine, [requests[i] for i in share], timeout_s)
            for engine, share in zip(self.engines, shares, strict=True)
        ]
        out: list[Completion | None] = [None] * len(requests)
        for engine, share, future in zip(self.engines, shares, futures, strict=True):
            for i, completion in zip(share, _result(engine, future), strict=True):
                out[i] = completion
        return out  # type: ignore[return-value]  # every slot is filled above

    def _spread(self, requests: list[GenerationRequest]) -> list[list[int]]:
        """Indices per engine: prompts (equal `prompt_ids`) dealt round-robin from a rotating start."""
        start = next(self._turn)
        groups: dict[tuple[int, ...], list[int]] = {}
        for i, r in enumerate(requests):
            groups.setdefault(tuple(r.prompt_ids), []).append(i)
        shares: list[list[int]] = [[] for _ in self.engines]
        for k, indices in enumerate(groups.values()):
            shares[(start + k) % len(self.engines)].extend(indices)
        return shares

    def submit(self, request: GenerationRequest) -> Future[Completion]:
        """Submit to the next engine in turn."""
        self._check_open()
        return self.engines[next(self._turn) % len(self.engines)].submit(request)

    def abort(self, request_id: str | None = None, *, reason: str = "aborted") -> int:
        """Abort on every engine; the total count."""
        return sum(engine.abort(request_id, reason=reason) for engine in self.engines)

    def load_adapter(self, name: str, **kwargs: Any) -> None:
        """Load on every engine (concurrently). Raises EngineError listing the engines that failed;
        the others keep the adapter."""
        self._broadcast(lambda engine: engine.load_adapter(name, **kwargs), f"load_adapter({name!r})")

    def unload_adapter(self, name: str, **kwargs: Any) -> None:
        """Unload from every engine (concurrently); EngineError lists the engines that failed."""
        self._broadcast(lambda engine: engine.unload_adapter(name, **kwargs), f"unload_adapter({name!r})")

    def _broadcast(self, call: Any, what: str) -> None:
        futures = [self._pool.submit(call, engine) for engine in self.engines]
        failures = []
        for engine, future in zip(self.engines, futures, strict=True):
            try:
                future.result()
            except EngineError as exc:
                failures.append((engine, exc))
        if failures:
            text = "; ".join(f"{engine!r}: {exc}" for engine, exc in failures)
            unavailable = all(isinstance(exc, EngineUnavailable) for _, exc in failures)
            error = EngineUnavailable if unavailable else EngineError
            raise error(f"{what} failed on {len(failures)} of {len(self.engines)} engines: {text}")

    def list_adapters(self) -> dict[str, dict[str, Any]]:
        """Adapters loaded on every engine (info from the first engine)."""
        listed = [engine.list_adapters() for engine in self.engines]
        common = set(listed[0]).intersection(*listed[1:])
        return {name: info for name, info in listed[0].items() if name in common}

    def pause(self, mode: str = "in_place") -> None:
        """Pause every engine."""
        for engine in self.engines:
            engine.pause(mode)

    def resume(self) -> None:
        """Resume every engine."""
        for engine in self.engines:
            engine.resume()

    def flush_cache(self) -> bool:
        """Flush every engine's cache; True when every engine flushed."""
        return all([engine.flush_cache() for engine in self.engines])

    def health(self) -> dict[str, Any]:
        """`{"ok": all ok, "paused": any paused, "engines": [each health]}`."""
        facts = [engine.health() for engine in self.engines]
        return {"ok": all(f.get("ok") for f in facts), "paused": any(f.get("paused") for f in facts), "engines": facts}

    def metrics(self) -> dict[str, Any]:
        """`{"engines": [each metrics]}`."""
        return {"engines": [engine.metrics() for engine in self.engines]}

    def members(self) -> list[InferenceEngine]:
        """The single engines behind this one (members of member `MultiEngine`s included), in order."""
        return [member for engine in self.engines for member in engine.members()]

    def close(self) -> None:
        """Close every engine and the worker threads (idempotent); later calls raise EngineError."""
        self._closed = True
        for engine in self.engines:
            engine.close()
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _check_open(self) -> None:
        if self._closed:
            raise EngineError(f"{self!r} is closed")


def connect_engines(kind: str, urls: Sequence[str], **options: Any) -> SGLangEngine | MultiEngine:
    """HTTP engines for `urls`: `kind` is `server` (our engine server) or `sglang` (a real one);
    several URLs give a `MultiEngine`. `options` are the clients' keyword arguments (`api_key`,
    `timeout_s`, `control_timeout_s`, ...; defaults as `SGLangEngine`).

    Raises:
        EngineError: unknown kind, no URLs, or a malformed URL.
    """
    classes = {"server": ServerEngine, "sglang": SGLangEngine}
    if kind not in classes:
        raise EngineError(f"engine kind must be one of {sorted(classes)}, got {kind!r}")
    if not urls:
        raise EngineError("give at least one engine URL, e.g. http://127.0.0.1:30000")
    engines = [classes[kind](url, **options) for url in urls]
    return engines[0] if len(engines) == 1 else MultiEngine(engines)


# ----------------------------------------------------------------- helpers


def _check_name(name: str) -> None:
    try:
        check_adapter_name(name)
    except ValueError as exc:
        raise EngineError(str(exc)) from None


def _sampling(p: SamplingParams) -> dict[str, Any]:
    """SGLang sampling params (top_k -1 = off)."""
    top_k = p.top_k if p.top_k > 0 else -1
    return {"max_new_tokens": p.max_new_tokens, "temperature": p.temperature, "top_p": p.top_p, "top_k": top_k, "n": 1}


def _chunks(requests: list[GenerationRequest], size: int) -> list[tuple[list[int], list[GenerationRequest]]]:
    """(indices, requests) batches of equal sampling params, at most `size` each."""
    groups: dict[SamplingParams, list[int]] = {}
    for i, r in enumerate(requests):
        groups.setdefault(r.sampling, []).append(i)
    out = []
    for indices in groups.values():
        for start in range(0, len(indices), size):
            part = indices[start : start + size]
            out.append((part, [requests[i] for i in part]))
    return out


def _to_completion(
    request: GenerationRequest,
    out: dict[str, Any],
    url: str,
    *,
    check_version: bool = False,
    reason: str | None = None,
) -> Completion:
    """One `/generate` output -> Completion; token ids and logprobs from `output_token_logprobs`
    (`[logprob, token_id, text]` triples), finish reason from `meta_info.finish_reason.type`.

    An aborted completion's `abort_reason` is the server's `finish_reason.message` when it is one of
    `ABORT_REASONS` (our server's: it knows why it ended the request, e.g. `paused` when a pause came before
    this client's abort), else `reason` (what this client's `abort` was given; SGLang's messages are prose),
    else `aborted`.

    With `check_version` (our server), the adapter version the server reports in `meta_info.weight_version`
    must be the one the request named: EngineError otherwise, so a wrong version never reaches training.
    """
    meta = out.get("meta_info") or {}
    expected = adapter_version(request.adapter)
    reported = meta.get("weight_version")
    if check_version and reported is not None and str(reported) != str(expected):
        raise EngineError(
            f"{url}/generate served request {request.request_id} with version {reported}, "
            f"but it named {request.adapter!r} (version {expected})"
        )
    triples = meta.get("output_token_logprobs")
    if triples is None:
        raise EngineError(f"{url}/generate returned no output_token_logprobs (return_logprob was set)")
    finish = meta.get("finish_reason") or {}
    kind = finish.get("type") if isinstance(finish, dict) else finish
    if kind not in ("stop", "length", "abort"):
        raise EngineError(f"{url}/generate returned finish_reason {finish!r}; expected stop, length or abort")
    return Completion(
        request_id=request.request_id,
        prompt_ids=list(request.prompt_ids),
        completion_ids=[int(t[1]) for t in triples],
        logprobs=[float(t[0]) for t in triples],
        finish_reason=kind,
        adapter=request.adapter,
        adapter_version=adapter_version(request.adapter),
        abort_reason=_abort_reason(finish, reason) if kind == "abort" else None,
    )


def _abort_reason(finish: Any, reason: str | None) -> str:
    message = finish.get("message") if isinstance(finish, dict) else None
    if message in ABORT_REASONS:
        return str(message)
    return reason or "aborted"


def _generate_on(
    engine: InferenceEngine, requests: list[GenerationRequest], timeout_s: float | None
) -> list[Completion]:
    return engine.generate(requests, timeout_s=timeout_s) if requests else []


def _result(engine: InferenceEngine, future: Future) -> list[Completion]:
    try:
        return future.result()
    except EngineError as exc:
        raise type(exc)(f"{engine!r}: {exc}") from exc


def _error_message(response: httpx.Response) -> str:
    """The message of an SGLang error answer: `{"error": {"message"}}`, `error_message`, `message`, or text."""
    body = _json_or_empty(response)
    error = body.get("error")
    if isinstance(error, dict) and error.get("message"):
        return str(error["message"])
    for key in ("error_message", "message", "detail", "error"):
        if body.get(key):
            return str(body[key])
    return response.text.strip()[:500] or response.reason_phrase


def _json_or_empty(response: httpx.Response) -> dict[str, Any]:
    try:
        body = response.json()
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}


def _json_safe(config: dict[str, Any]) -> dict[str, Any]:
    """A PEFT config as plain JSON (sets become sorted lists)."""
    return json.loads(json.dumps(config, default=lambda o: sorted(o) if isinstance(o, set | frozenset) else str(o)))
