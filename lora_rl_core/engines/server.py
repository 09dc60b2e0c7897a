"""The embedded engine behind the SGLang HTTP API subset (`lora-rl serve`).

Mirrors sglang 0.5.23 `sglang/srt/entrypoints/http_server.py` with the request and response
structs of `sglang/srt/managers/io_struct.py` (`GenerateReqInput`, `LoadLoRAAdapterReqInput`,
`LoadLoRAAdapterFromTensorsReqInput`, `UnloadLoRAAdapterReqInput`, `LoRAUpdateOutput`,
`AbortReq`), so one client (`lora_rl_core.engines.http`) drives both this server and a real
SGLang server. See docs/SGLANG.md for the contract.

Choices made here:

* `/generate` answers like SGLang: a dict for one prompt with `n == 1`, else a list in
  SGLang's order (prompt-major: every sample of prompt 0, then of prompt 1, ...). Errors are
  HTTP 400 `{"error": {"message": ...}}`; a request naming an adapter that is not loaded is
  such an error, never a silent base-model completion. `meta_info.weight_version` carries the
  adapter version that produced the completion (null for the base model).
* `sampling_seed` (or `seed`) seeds one batch of this server's engine, so the samples of one
  call differ from each other; in SGLang it seeds each request.
* Tensor loads take only `load_format: "safetensors"` with base64 safetensors file bytes:
  SGLang's torch-multiprocessing pickles are refused, never deserialised.
* Control endpoints (load, unload, pause, continue, flush, abort) need
  `Authorization: Bearer <api key>` when the server has a key; `check_bind` refuses to bind
  beyond loopback without one.
* Blocking engine calls run in worker threads under deadlines. Each HTTP request's prompts are
  submitted to the engine (`InferenceEngine.submit`: batched with other callers' prompts).
  Prompts unfinished after `request_timeout_s` are aborted and answered with `finish_reason`
  `{"type": "abort", "message": "timeout"}`, as the protocol's `generate` deadline does.
* `/abort_request` also takes `abort_message` (a field of SGLang's `AbortReq` that SGLang's
  endpoint ignores): one of the protocol's `ABORT_REASONS`, given to the engine's `abort` and
  answered as the aborted requests' `finish_reason.message` (default `aborted`).
* `lora_path` may also be `store://RUN@VERSION` (the engine loads it from its store on first use),
  and `/load_lora_adapter` takes any fsspec URI, a store version folder (`AdapterRef.uri`, read
  sha256-verified by the engine), or, with `--store`, `RUN@VERSION` / an adapter name.
* `/v1/models` adapter cards carry extra fields (`version`, `sha256` of the safetensors bytes
  this server loaded, `in_flight`, `pinned`, `resident`) that SGLang clients ignore.
* `/metrics` is Prometheus text read from `engine.metrics()` at scrape time (a fresh
  `CollectorRegistry` per app), names prefixed `lora_rl_`.

Left out: streaming (`stream: true` is a 400), OpenAI-compatible `/v1/completions`, input
logprobs and top-k logprobs, stop strings and penalties (unknown sampling fields are a 400).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import hmac
import ipaddress
import os
import time
from collections.abc import Awaitable, Callable
from functools import partial
from typing import TYPE_CHECKING, Any, cast

import anyio
import fsspec
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from lora_rl_core.adapters import STORE_URI_PREFIX, adapter_run, adapter_version, load_safetensors, peft_folder
from lora_rl_core.engines.base import (
    PAUSE_MODES,
    Completion,
    GenerationRequest,
    InferenceEngine,
    SamplingParams,
    unknown_adapter_message,
)
from lora_rl_core.errors import EngineError, LoraRLError, StoreError

if TYPE_CHECKING:
    from lora_rl_core.config import RunConfig

TOP_K_ALL = 1 << 30  # SGLang's "whole vocabulary" top_k
TENSOR_ROOT = "__tensor__"  # SGLang's lora_path for adapters loaded from tensors
HEALTH_CHECK_TIMEOUT_S = 20.0  # as SGLANG_HEALTH_CHECK_TIMEOUT


# ----------------------------------------------------------------- request bodies


class SamplingIn(BaseModel):
    """The `sampling_params` subset served (sglang/srt/sampling/sampling_params.py); unknown fields are a 400."""

    model_config = ConfigDict(extra="forbid")

    max_new_tokens: int = Field(128, ge=1)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, ge=-1)
    """-1 (or 0, or >= 2**30) disables top-k."""
    n: int = Field(1, ge=1, le=1024)
    sampling_seed: int | None = None
    seed: int | None = None
    """Alias of sampling_seed."""
    skip_special_tokens: bool = True

    def to_params(self) -> SamplingParams:
        """Our `SamplingParams` (top_k 0 = off)."""
        top_k = 0 if self.top_k <= 0 or self.top_k >= TOP_K_ALL else self.top_k
        seed = self.sampling_seed if self.sampling_seed is not None else self.seed
        return SamplingParams(
            max_new_tokens=self.max_new_tokens, temperature=self.temperature, top_p=self.top_p, top_k=top_k, seed=seed
        )


class GenerateIn(BaseModel):
    """`GenerateReqInput` subset: one prompt or a batch, as text or token ids; other fields are ignored."""

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: SamplingIn | list[SamplingIn] | None = None
    lora_path: str | list[str | None] | None = None
    """Adapter name per prompt (a list) or for all; null = base model."""
    return_logprob: bool = False
    return_text_in_logprobs: bool = False
    stream: bool = False
    rid: str | list[str] | None = None


class LoadIn(BaseModel):
    """`LoadLoRAAdapterReqInput`. Without `lora_path`, a server with a store resolves `lora_name` there."""

    lora_name: str
    lora_path: str | None = None
    pinned: bool = False


class LoadTensorsIn(BaseModel):
    """`LoadLoRAAdapterFromTensorsReqInput`; only `load_format: "safetensors"` is accepted here."""

    lora_name: str
    config_dict: dict[str, Any]
    serialized_named_tensors: list[str] | None = None
    load_format: str | None = None
    pinned: bool = False


class UnloadIn(BaseModel):
    """`UnloadLoRAAdapterReqInput`."""

    lora_name: str


class PauseIn(BaseModel):
    """`PauseGenerationReqInput`: `abort` (SGLang's default), `retract` or `in_place`."""

    mode: str = "abort"


class AbortIn(BaseModel):
    """`AbortReq`: one request id, or every request; `abort_message` is the reason (one of `ABORT_REASONS`)."""

    rid: str = ""
    abort_all: bool = False
    abort_message: str | None = None


class HTTPError(Exception):
    """An error answered as `{"error": {"message": ...}}` with `status`."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def _error(status: int, message: str, **extra: Any) -> JSONResponse:
    return JSONResponse({"error": {"message": message}, **extra}, status_code=status)


# ----------------------------------------------------------------- the server


class EngineServer:
    """The routes of the engine server, bound to one engine. Build the app with `create_app`.

    Args:
        engine: the engine served (normally an `EmbeddedEngine`).
        tokenizer: decodes `text` and encodes `text` prompts; None serves `input_ids` only.
        served_model_name: the base model's id in `/v1/models`.
        model_path: reported by `/model_info` (default `served_model_name`).
        api_key: required as a Bearer token on control endpoints when set.
        store: an `AdapterStore`; lets `/load_lora_adapter` take `RUN@VERSION` or an adapter name.
        request_timeout_s: deadline of one `/generate` call (its requests are aborted after it).
        control_timeout_s: deadline of one load/unload/pause/flush call.
    """

    def __init__(
        self,
        engine: InferenceEngine,
        *,
        tokenizer: Any = None,
        served_model_name: str,
        model_path: str | None = None,
        api_key: str | None = None,
        store: Any = None,
        request_timeout_s: float = 600.0,
        control_timeout_s: float = 300.0,
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.served_model_name = served_model_name
        self.model_path = model_path or served_model_name
        self.api_key = api_key
        self.store = store
        self.request_timeout_s = request_timeout_s
        self.control_timeout_s = control_timeout_s
        self.started = time.time()
        self.loaded: dict[str, dict[str, Any]] = {}  # name -> {"path", "sha256"} for loads made here
        self.rids: dict[str, list[str]] = {}  # client rid -> engine request ids (n > 1 expands)
        self.registry = CollectorRegistry()
        self.registry.register(EngineCollector(engine))
        self.load_seconds = Histogram(
            "lora_rl_adapter_load_latency_seconds",
            "Wall time of adapter loads over HTTP, by source (path or tensors).",
            ["source"],
            registry=self.registry,
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
        )

    def app(self) -> FastAPI:
        """A FastAPI app serving the SGLang subset plus `/metrics`."""
        app = FastAPI(title="lora-rl engine server", openapi_url=None)
        control = [Depends(self._authorize)]
        routes: list[tuple[str, Callable, list[str], list]] = [
            ("/generate", self.generate, ["POST", "PUT"], []),
            ("/load_lora_adapter", self.load_lora_adapter, ["POST"], control),
            ("/load_lora_adapter_from_tensors", self.load_lora_adapter_from_tensors, ["POST"], control),
            ("/unload_lora_adapter", self.unload_lora_adapter, ["POST"], control),
            ("/pause_generation", self.pause_generation, ["POST"], control),
            ("/continue_generation", self.continue_generation, ["POST"], control),
            ("/flush_cache", self.flush_cache, ["GET", "POST"], control),
            ("/abort_request", self.abort_request, ["POST"], control),
            ("/v1/models", self.models, ["GET"], []),
            ("/health", self.health, ["GET"], []),
            ("/health_generate", self.health_generate, ["GET"], []),
            ("/model_info", self.model_info, ["GET"], []),
            ("/get_model_info", self.model_info, ["GET"], []),
            ("/metrics", self.metrics, ["GET"], []),
        ]
        for path, endpoint, methods, deps in routes:
            app.add_api_route(path, endpoint, methods=methods, dependencies=deps, response_model=None)
        handlers: dict[type[Exception], Callable[[Request, Any], Awaitable[JSONResponse]]] = {
            HTTPError: _on_http_error,
            LoraRLError: _on_engine_error,
            RequestValidationError: _on_validation_error,
            StarletteHTTPException: _on_starlette_error,
        }
        for error, handler in handlers.items():
            app.add_exception_handler(error, handler)
        return app

    # ------------------------------------------------------------- helpers

    async def _authorize(self, request: Request) -> None:
        if self.api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
            raise HTTPError(401, "Unauthorized: control endpoints need the header 'Authorization: Bearer <api key>'")

    async def _blocking(self, timeout_s: float, fn: Callable, /, *args: Any, **kwargs: Any) -> Any:
        """Run a blocking engine call in a worker thread; HTTP 504 after `timeout_s` (the call is
        abandoned, not killed: a torch call in a thread cannot be interrupted)."""
        try:
            with anyio.fail_after(timeout_s):
                return await anyio.to_thread.run_sync(partial(fn, *args, **kwargs), abandon_on_cancel=True)
        except TimeoutError:
            name = getattr(fn, "__name__", "engine call")
            raise HTTPError(504, f"{name} did not finish within {timeout_s:g} s") from None

    # ------------------------------------------------------------- generation

    async def generate(self, body: GenerateIn) -> Any:
        """`POST /generate`: complete each prompt `n` times with its adapter."""
        if body.stream:
            raise HTTPError(400, "stream=true is not supported by this server: send stream=false")
        prompts, batch = self._prompts(body)
        sampling = _per_prompt(body.sampling_params or SamplingIn(), len(prompts), "sampling_params")
        adapters = _per_prompt(body.lora_path, len(prompts), "lora_path")
        rids = [rid or os.urandom(16).hex() for rid in _per_prompt(body.rid, len(prompts), "rid")]
        requests = self._requests(prompts, sampling, adapters, rids)
        try:
            await self._check_adapters({r.adapter for r in requests if r.adapter is not None})
            completions = await self._complete(requests)
        finally:
            for rid in rids:
                self.rids.pop(rid, None)
        outs = [self._output(c, s, body) for c, s in zip(completions, _expand(sampling), strict=True)]
        return outs if batch or len(outs) > 1 else outs[0]

    def _prompts(self, body: GenerateIn) -> tuple[list[list[int]], bool]:
        if (body.text is None) == (body.input_ids is None):
            raise HTTPError(400, "give exactly one of `text` or `input_ids`")
        if body.input_ids is not None:
            batch = bool(body.input_ids) and isinstance(body.input_ids[0], list)
            prompts = cast(list[list[int]], body.input_ids if batch else [body.input_ids])
        else:
            if self.tokenizer is None:
                raise HTTPError(400, "this server has no tokenizer: send `input_ids` instead of `text`")
            batch = isinstance(body.text, list)
            texts = cast(list[str], body.text if batch else [body.text])
            prompts = [self.tokenizer(t)["input_ids"] for t in texts]
        if not prompts or any(not p for p in prompts):
            raise HTTPError(400, "every prompt needs at least one token")
        return prompts, batch

    def _requests(self, prompts: list, sampling: list, adapters: list, rids: list[str]) -> list[GenerationRequest]:
        """Prompt-major requests (SGLang's order); the samples of rid R are `R-0`, `R-1`, ... when n > 1."""
        requests = []
        for prompt, params, adapter, rid in zip(prompts, sampling, adapters, rids, strict=True):
            ids = [rid] if params.n == 1 else [f"{rid}-{j}" for j in range(params.n)]
            self.rids[rid] = ids
            requests += [GenerationRequest(list(prompt), adapter, params.to_params(), request_id=i) for i in ids]
        return requests

    async def _check_adapters(self, names: set[str]) -> None:
        """SGLang's 400 for a name that is not registered (`store://` names are the engine's to resolve)."""
        names = {n for n in names if not n.startswith(STORE_URI_PREFIX)}
        if not names:
            return
        loaded = await self._blocking(self.control_timeout_s, self.engine.list_adapters)
        unknown = sorted(names - set(loaded))
        if unknown:
            raise HTTPError(400, unknown_adapter_message(unknown[0], list(loaded)))

    async def _complete(self, requests: list[GenerationRequest]) -> list[Completion]:
        """Submit every request and wait until `request_timeout_s`; requests unfinished then are aborted and
        answered with `finish_reason` abort (the protocol's `generate` deadline)."""
        futures = [asyncio.wrap_future(f) for f in await anyio.to_thread.run_sync(self._submit_all, requests)]
        _, late = await asyncio.wait(futures, timeout=self.request_timeout_s)
        if late:
            ids = [r.request_id for r, f in zip(requests, futures, strict=True) if f in late]
            await anyio.to_thread.run_sync(self._abort_ids, ids, "timeout")
            _, stuck = await asyncio.wait(late, timeout=HEALTH_CHECK_TIMEOUT_S)
            if stuck:
                raise HTTPError(504, f"generation did not finish within {self.request_timeout_s:g} s")
        return [f.result() for f in futures]  # the first failed request's EngineError, if any

    def _submit_all(self, requests: list[GenerationRequest]) -> list[Any]:
        futures = []
        try:
            for r in requests:
                futures.append(self.engine.submit(r))
        except LoraRLError:
            self._abort_ids([r.request_id for r in requests[: len(futures)]], "aborted")
            raise
        return futures

    def _abort_ids(self, ids: list[str], reason: str) -> int:
        """Abort requests by id with `reason`; how many were aborted."""
        return sum(self.engine.abort(i, reason=reason) for i in ids)

    def _output(self, c: Completion, sampling: SamplingIn, body: GenerateIn) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "id": c.request_id,
            "finish_reason": _finish_reason(c),
            "prompt_tokens": len(c.prompt_ids),
            "completion_tokens": len(c.completion_ids),
            "cached_tokens": 0,
            "weight_version": c.adapter_version,
            "lora_path": c.adapter,
        }
        if body.return_logprob:
            texts = [self._decode([t], True) if body.return_text_in_logprobs else None for t in c.completion_ids]
            meta["output_token_logprobs"] = [
                [lp, tid, txt] for lp, tid, txt in zip(c.logprobs, c.completion_ids, texts, strict=True)
            ]
        text = self._decode(c.completion_ids, sampling.skip_special_tokens)
        return {"text": text, "output_ids": c.completion_ids, "meta_info": meta}

    def _decode(self, ids: list[int], skip_special: bool) -> str:
        return "" if self.tokenizer is None else self.tokenizer.decode(ids, skip_special_tokens=skip_special)

    # ------------------------------------------------------------- adapters

    async def load_lora_adapter(self, body: LoadIn) -> JSONResponse:
        """`POST /load_lora_adapter`: load a PEFT folder (local path or fsspec URI) under `lora_name`."""
        try:
            path = self._resolve(body.lora_name, body.lora_path)
            start = time.perf_counter()
            await self._blocking(
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
            sha = await self._blocking(self.control_timeout_s, self._load_tensors, body)
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
            await self._blocking(self.control_timeout_s, self.engine.unload_adapter, body.lora_name)
        except (LoraRLError, HTTPError) as exc:
            return await self._update_failed(exc)
        self.loaded.pop(body.lora_name, None)
        return await self._update_ok()

    async def _loaded_adapters(self) -> dict[str, str]:
        listed = await self._blocking(self.control_timeout_s, self.engine.list_adapters)
        return {name: self._root(name, info) for name, info in listed.items()}

    async def _update_ok(self) -> JSONResponse:
        body = {"success": True, "error_message": None, "loaded_adapters": await self._loaded_adapters()}
        return JSONResponse(body)

    async def _update_failed(self, exc: Exception) -> JSONResponse:
        """`LoRAUpdateOutput` with success=false (HTTP 400), plus SGLang's `error` shape."""
        message = exc.message if isinstance(exc, HTTPError) else str(exc)
        status = exc.status if isinstance(exc, HTTPError) else 400
        loaded = await self._loaded_adapters()
        return _error(status, message, success=False, error_message=message, loaded_adapters=loaded)

    def _root(self, name: str, info: dict[str, Any]) -> str:
        if name in self.loaded:
            return self.loaded[name]["path"]
        source = info.get("path") or info.get("source")
        return TENSOR_ROOT if source in (None, "tensors") else str(source)

    # ------------------------------------------------------------- control

    async def pause_generation(self, body: PauseIn | None = None) -> JSONResponse:
        """`POST /pause_generation` {mode}."""
        mode = (body or PauseIn()).mode
        if mode not in PAUSE_MODES:
            raise HTTPError(400, f"mode must be one of {PAUSE_MODES}, got {mode!r}")
        await self._blocking(self.control_timeout_s, self.engine.pause, mode)
        return JSONResponse({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(self) -> JSONResponse:
        """`POST /continue_generation`."""
        await self._blocking(self.control_timeout_s, self.engine.resume)
        return JSONResponse({"message": "Generation continued successfully.", "status": "ok"})

    async def flush_cache(self) -> PlainTextResponse:
        """`POST /flush_cache`: 200, or 400 when the engine refuses (requests running)."""
        try:
            flushed = await self._blocking(self.control_timeout_s, self.engine.flush_cache)
        except LoraRLError as exc:
            return PlainTextResponse(f"Cache not flushed: {exc}\n", status_code=400)
        if flushed is False:
            return PlainTextResponse("Cache not flushed: requests are running.\n", status_code=400)
        return PlainTextResponse("Cache flushed.\n")

    async def abort_request(self, body: AbortIn) -> JSONResponse:
        """`POST /abort_request` {rid, abort_all, abort_message}; answers `{"aborted": count}`."""
        reason = body.abort_message or "aborted"
        if body.abort_all:
            count = await self._blocking(self.control_timeout_s, self.engine.abort, None, reason=reason)
            return JSONResponse({"aborted": count})
        ids = self.rids.get(body.rid, [body.rid])
        count = await self._blocking(self.control_timeout_s, self._abort_ids, ids, reason)
        return JSONResponse({"aborted": count})

    # ------------------------------------------------------------- info

    async def models(self) -> JSONResponse:
        """`GET /v1/models`: the base model, then one card per adapter (`parent` = base model)."""
        listed = await self._blocking(self.control_timeout_s, self.engine.list_adapters)
        cards = [self._card(self.served_model_name, self.model_path, None, {})]
        cards += [
            self._card(name, self._root(name, info), self.served_model_name, info) for name, info in listed.items()
        ]
        return JSONResponse({"object": "list", "data": cards})

    def _card(self, name: str, root: str, parent: str | None, info: dict[str, Any]) -> dict[str, Any]:
        card = {"id": name, "object": "model", "created": int(info.get("loaded_at") or self.started)}
        card.update(owned_by="lora-rl", root=root, parent=parent, max_model_len=None)
        if parent is not None:
            card.update(version=adapter_version(name), sha256=self.loaded.get(name, {}).get("sha256"))
            card.update({k: info[k] for k in ("in_flight", "pinned", "resident") if k in info})
        return card

    async def health(self) -> JSONResponse:
        """`GET /health`: 200 with `engine.health()` as JSON, 503 when it is not ok."""
        try:
            facts = await self._blocking(HEALTH_CHECK_TIMEOUT_S, self.engine.health)
        except (LoraRLError, HTTPError) as exc:
            return JSONResponse({"ok": False, "error": str(exc)}, status_code=503)
        return JSONResponse(facts, status_code=200 if facts.get("ok", True) else 503)

    async def health_generate(self) -> Response:
        """`GET /health_generate`: one greedy base-model token; 503 when that fails or times out."""
        prompt = [getattr(self.tokenizer, "eos_token_id", None) or 0]
        request = GenerationRequest(prompt, None, SamplingParams(max_new_tokens=1, temperature=0.0))
        try:
            with anyio.fail_after(HEALTH_CHECK_TIMEOUT_S):
                await self._complete([request])
        except (TimeoutError, LoraRLError, HTTPError) as exc:
            return JSONResponse({"ok": False, "error": str(exc)}, status_code=503)
        return Response(status_code=200)

    async def model_info(self) -> JSONResponse:
        """`GET /model_info` (and SGLang's `/get_model_info`)."""
        tokenizer_path = getattr(self.tokenizer, "name_or_path", None)
        info = {"model_path": self.model_path, "tokenizer_path": tokenizer_path, "is_generation": True}
        info.update(preferred_sampling_params=None, weight_version="default", served_model_name=self.served_model_name)
        return JSONResponse({**info, "engine": "lora-rl"})

    async def metrics(self) -> Response:
        """`GET /metrics`: Prometheus text format."""
        data = await anyio.to_thread.run_sync(generate_latest, self.registry)
        return Response(data, media_type=CONTENT_TYPE_LATEST)


def _per_prompt(value: Any, n: int, field: str) -> list[Any]:
    """One value per prompt: a list must match the number of prompts; a scalar is repeated."""
    if not isinstance(value, list):
        return [value] * n
    if len(value) != n:
        raise HTTPError(400, f"`{field}` lists {len(value)} values for {n} prompts")
    return value


def _expand(sampling: list[SamplingIn]) -> list[SamplingIn]:
    return [s for s in sampling for _ in range(s.n)]


def _finish_reason(c: Completion) -> dict[str, Any]:
    if c.finish_reason == "stop":
        return {"type": "stop", "matched": c.completion_ids[-1] if c.completion_ids else None}
    if c.finish_reason == "length":
        return {"type": "length", "length": len(c.completion_ids)}
    return {"type": "abort", "message": c.abort_reason or "aborted"}


def _folder_sha256(path: str) -> str | None:
    """sha256 of the `adapter_model.safetensors` the engine read from `path` (a PEFT folder, or a store
    version folder: its data folder), or None when it cannot be read."""
    try:
        fs, root = fsspec.core.url_to_fs(peft_folder(path))
        return hashlib.sha256(fs.cat_file(f"{root.rstrip('/')}/adapter_model.safetensors")).hexdigest()
    except (OSError, ValueError, LoraRLError):
        return None


async def _on_http_error(request: Request, exc: HTTPError) -> JSONResponse:
    return _error(exc.status, exc.message)


async def _on_engine_error(request: Request, exc: LoraRLError) -> JSONResponse:
    return _error(400, str(exc))


async def _on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    parts = [f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()]
    return _error(400, "invalid request: " + "; ".join(parts))


async def _on_starlette_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    return _error(exc.status_code, str(exc.detail))


# ----------------------------------------------------------------- metrics

_ADAPTER_METRICS = {  # engine.metrics()["adapters"][name] key -> (counter?, metric name, help)
    "requests": (True, "lora_rl_adapter_requests", "Completions served, per adapter."),
    "tokens": (True, "lora_rl_adapter_tokens", "Completion tokens generated, per adapter."),
    "loads": (True, "lora_rl_adapter_loads", "Loads (including reloads after eviction), per adapter."),
    "evictions": (True, "lora_rl_adapter_evictions", "Evictions from the adapter pool, per adapter."),
    "load_seconds_total": (True, "lora_rl_adapter_load_seconds", "Seconds spent loading, per adapter."),
    "in_flight": (False, "lora_rl_adapter_in_flight", "Requests running or queued, per adapter."),
    "resident": (False, "lora_rl_adapter_resident", "1 when the adapter's weights are resident."),
    "pinned": (False, "lora_rl_adapter_pinned", "1 when the adapter is pinned (never evicted)."),
    "version": (False, "lora_rl_adapter_version", "The adapter's version number."),
}


class EngineCollector:
    """Prometheus collector reading `engine.metrics()` (the `EmbeddedEngine` shape) at scrape time.

    Per adapter (label `adapter`; the base model is `__base__`): requests, tokens, loads, evictions, load
    seconds, in-flight, resident, pinned, version. Per run: the newest loaded version. Engine-wide: queue
    depth, running requests, paused, batches, unloads, aborted requests by reason.
    """

    def __init__(self, engine: InferenceEngine) -> None:
        self.engine = engine

    def collect(self):  # noqa: ANN201 - prometheus_client's collector protocol
        """Yield the metric families (read fresh from the engine on every scrape)."""
        metrics = self.engine.metrics()
        adapters = dict(metrics.get("adapters") or {})
        if isinstance(metrics.get("base"), dict):
            adapters["__base__"] = metrics["base"]
        for key, (counter, name, doc) in _ADAPTER_METRICS.items():
            family = (CounterMetricFamily if counter else GaugeMetricFamily)(name, doc, labels=["adapter"])
            for adapter, info in adapters.items():
                if isinstance(info.get(key), int | float | bool):
                    family.add_metric([adapter], float(info[key]))
            yield family
        yield _active_versions(self.engine.list_adapters())
        yield from _engine_families(metrics)


def _engine_families(metrics: dict[str, Any]):  # noqa: ANN202 - a generator of metric families
    for key in ("queue_depth", "running", "paused", "resident"):
        if isinstance(metrics.get(key), int | float | bool):
            yield GaugeMetricFamily(f"lora_rl_engine_{key}", f"Engine {key}.", value=float(metrics[key]))
    for key in ("batches", "unloads"):
        if isinstance(metrics.get(key), int | float):
            yield CounterMetricFamily(f"lora_rl_engine_{key}", f"Engine {key}.", value=float(metrics[key]))
    aborted = CounterMetricFamily("lora_rl_engine_aborted", "Requests aborted, by reason.", labels=["reason"])
    for reason, count in sorted((metrics.get("aborted") or {}).items()):
        aborted.add_metric([reason], float(count))
    yield aborted


def _active_versions(adapters: dict[str, Any]) -> GaugeMetricFamily:
    """Newest loaded version per run (versioned adapter names only)."""
    family = GaugeMetricFamily("lora_rl_active_version", "Newest loaded adapter version, per run.", labels=["run"])
    newest: dict[str, int] = {}
    for name in adapters:
        run, version = adapter_run(name), adapter_version(name)
        if run is not None and version is not None:
            newest[run] = max(version, newest.get(run, version))
    for run, version in sorted(newest.items()):
        family.add_metric([run], float(version))
    return family


# ----------------------------------------------------------------- app + serve


def create_app(engine: InferenceEngine, **options: Any) -> FastAPI:
    """The FastAPI app of the engine server over `engine`; `options` are `EngineServer`'s keyword arguments
    (`served_model_name` required; `tokenizer`, `api_key`, `store`, `model_path`, `request_timeout_s`,
    `control_timeout_s`), whose defaults live there."""
    return EngineServer(engine, **options).app()


def is_loopback(host: str) -> bool:
    """True for `localhost` and loopback addresses (127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_bind(host: str, api_key: str | None) -> None:
    """Refuse to serve control endpoints beyond loopback without an API key.

    Raises:
        LoraRLError: `host` is not loopback and `api_key` is empty.
    """
    if not api_key and not is_loopback(host):
        raise LoraRLError(
            f"refusing to bind {host!r} without --api-key: the control endpoints (load, unload, pause, abort) "
            "would be open to the network; pass --api-key KEY or bind 127.0.0.1"
        )


def serve(cfg: RunConfig, *, host: str, port: int, api_key: str | None, served_model_name: str | None) -> None:
    """Serve the embedded engine that `cfg` describes with uvicorn until interrupted.

    The engine is built from `cfg.model` and `cfg.engine` (`build_embedded_engine`: batch and adapter pool
    limits, eviction, rank cap, generation deadline) with `cfg.store` for loads by `RUN@VERSION` and
    `store://` names, whatever `engine.type` says: a training config that points its rollouts at
    `engine.urls` serves that engine with the same limits. `engine.timeout_s` is also the deadline of one
    `/generate` call.

    Args:
        cfg: the run config (model, engine and store sections are read).
        host, port: bind address; beyond loopback needs `api_key` (`check_bind`).
        api_key: Bearer key of the control endpoints.
        served_model_name: the base model's id in `/v1/models`; None = the model folder's name.

    Raises:
        LoraRLError: unsafe bind, unloadable model, bad store URI.
    """
    import uvicorn

    from lora_rl_core.engines.factory import build_embedded_engine
    from lora_rl_core.models import load_tokenizer

    check_bind(host, api_key)
    store = cfg.store.build()
    tokenizer = load_tokenizer(cfg.model)
    engine = build_embedded_engine(cfg.engine, cfg.model, store, tokenizer=tokenizer)
    model = cfg.model.name_or_path
    app = create_app(
        engine,
        served_model_name=served_model_name or os.path.basename(os.path.normpath(model)),
        api_key=api_key,
        tokenizer=tokenizer,
        model_path=model,
        store=store,
        request_timeout_s=cfg.engine.timeout_s,
    )
    try:  # uvicorn shuts down gracefully on SIGINT/SIGTERM, then re-raises the signal (see cli.shutdown)
        uvicorn.run(app, host=host, port=port, log_level="info", timeout_keep_alive=5)
    finally:
        engine.close()  # stop the worker thread: queued requests end aborted
