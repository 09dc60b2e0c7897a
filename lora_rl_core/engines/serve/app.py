"""The embedded engine behind the SGLang HTTP API subset (`lora-rl serve`).

Mirrors sglang 0.5.23 `sglang/srt/entrypoints/http_server.py` with the request and response
structs of `sglang/srt/managers/io_struct.py` (`GenerateReqInput`, `LoadLoRAAdapterReqInput`,
`LoadLoRAAdapterFromTensorsReqInput`, `UnloadLoRAAdapterReqInput`, `LoRAUpdateOutput`,
`AbortReq`), so one client (`lora_rl_core.engines.remote.client`) drives both this server and a real
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
  SGLang's torch-multiprocessing pickles are refused, never deserialised (`serve.adapters`).
* Control endpoints (load, unload, pause, continue, flush, abort) need
  `Authorization: Bearer <api key>` when the server has a key; `check_bind` refuses to bind
  beyond loopback without one.
* Blocking engine calls run in worker threads under deadlines. Each HTTP request's prompts are
  submitted to the engine (`ServingEngine.submit`: batched with other callers' prompts).
  Prompts unfinished after `request_timeout_s` are aborted and answered with `finish_reason`
  `{"type": "abort", "message": "timeout"}`, as the protocol's `generate` deadline does.
* `/abort_request` also takes `abort_message` (a field of SGLang's `AbortReq` that SGLang's
  endpoint ignores): one of the protocol's `ABORT_REASONS`, given to the engine's `abort` and
  answered as the aborted requests' `finish_reason.message` (default `aborted`).
* `lora_path` (and the OpenAI endpoints' `model`) may name a reference, `RUN@latest` (the newest version of
  RUN loaded here), `RUN@N` or `RUN@TAG`, resolved when the call is admitted and held until it ends
  (`serve.names`, `EngineServer.complete_named`); `meta_info.lora_path` says which version served it.
* `lora_path` may also be `store://RUN@VERSION` (the engine loads it from its store on first use),
  and `/load_lora_adapter` takes any fsspec URI, a store version folder (`AdapterRef.uri`, read
  sha256-verified by the engine), or, with `--store`, `RUN@VERSION` / an adapter name.
* `/v1/models` adapter cards carry extra fields (`version`, `sha256` of the safetensors bytes
  this server loaded, `in_flight`, `pinned`, `resident`) that SGLang clients ignore; a card per
  `RUN@latest` alias follows them, with `alias_of` naming the version it resolves to now.
* OpenAI-compatible `/v1/completions` and `/v1/chat/completions` (`serve.openai_api`) serve the same
  engine with `model` naming the base model or an adapter; errors on `/v1/` routes take OpenAI's shape.
* `/metrics` is Prometheus text read from `engine.metrics()` at scrape time (a fresh
  `CollectorRegistry` per app), names prefixed `lora_rl_` (`serve.metrics`).

Modules: this one holds `EngineServer` (the routes: generation, control, info), `create_app`, the bind
check and `serve`; `api` the request bodies, error answers and output shape; `adapters` the
adapter load/unload routes; `names` the adapter references; `openai_api` the OpenAI routes; `metrics`
the Prometheus collector.

* `/generate` takes SGLang's `stop`, `stop_token_ids` and `no_stop_trim` sampling params: the engine halts at
  the token that completes a stop string or is a stop token id (kept in `output_ids` and the logprobs), and
  `finish_reason` is SGLang's `{"type": "stop", "matched": ...}`: the stop string, or the token id for a stop
  token id and for EOS alike (`api.finish_reason`); `text` drops the match unless `no_stop_trim`.

Left out: streaming (`stream: true` is a 400), input logprobs and top-k logprobs, regex stops (`stop_regex`)
and penalties on `/generate` (unknown sampling fields are a 400).
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import anyio
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from lora_rl_core.adapters import STORE_URI_PREFIX, adapter_version
from lora_rl_core.config import ENGINE_DEFAULTS
from lora_rl_core.engines.base import (
    PAUSE_MODES,
    Completion,
    GenerationRequest,
    SamplingParams,
    ServingEngine,
)
from lora_rl_core.engines.serve.adapters import AdapterRoutes
from lora_rl_core.engines.serve.api import (
    AbortIn,
    GenerateIn,
    HTTPError,
    PauseIn,
    SamplingIn,
    expand_samples,
    generate_output,
    install_error_handlers,
    per_prompt,
    prompt_ids,
    run_blocking,
)
from lora_rl_core.engines.serve.metrics import server_registry
from lora_rl_core.engines.serve.names import AdapterNames, is_reference, latest_aliases
from lora_rl_core.engines.serve.openai_api import OpenAIRoutes
from lora_rl_core.errors import LoraRLError

if TYPE_CHECKING:
    from lora_rl_core.engines.records import BuiltEngine

HEALTH_CHECK_TIMEOUT_S = 20.0  # as SGLANG_HEALTH_CHECK_TIMEOUT
RESOLVE_ATTEMPTS = 3  # resolutions of one call that raced a sync retiring the version resolved (`complete_named`)


class EngineServer:
    """The routes of the engine server, bound to one engine. Build the app with `create_app`.

    Generation (`/generate`), control (pause, continue, flush, abort) and info (`/v1/models`, health, model
    info, metrics) are handled here; adapter loads and unloads by `self.adapters` (`AdapterRoutes`).

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
        engine: ServingEngine,
        *,
        tokenizer: Any = None,
        served_model_name: str,
        model_path: str | None = None,
        api_key: str | None = None,
        store: Any = None,
        request_timeout_s: float = ENGINE_DEFAULTS.timeout_s,
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
        self.rids: dict[str, list[str]] = {}  # client rid -> engine request ids (n > 1 expands)
        self.registry, load_seconds = server_registry(engine)
        self.adapters = AdapterRoutes(
            engine, store=store, control_timeout_s=control_timeout_s, load_seconds=load_seconds
        )
        self.names = AdapterNames(engine, store=store)
        bases = dict.fromkeys([served_model_name, self.model_path])
        self.openai = OpenAIRoutes(self.complete_named, tokenizer=tokenizer, base_names=list(bases))

    def app(self) -> FastAPI:
        """A FastAPI app serving the SGLang subset plus `/metrics`."""
        app = FastAPI(title="lora-rl engine server", openapi_url=None)
        control = [Depends(self._authorize)]
        routes: list[tuple[str, Callable, list[str], list]] = [
            ("/generate", self.generate, ["POST", "PUT"], []),
            ("/load_lora_adapter", self.adapters.load_lora_adapter, ["POST"], control),
            ("/load_lora_adapter_from_tensors", self.adapters.load_lora_adapter_from_tensors, ["POST"], control),
            ("/unload_lora_adapter", self.adapters.unload_lora_adapter, ["POST"], control),
            ("/pause_generation", self.pause_generation, ["POST"], control),
            ("/continue_generation", self.continue_generation, ["POST"], control),
            ("/flush_cache", self.flush_cache, ["GET", "POST"], control),
            ("/abort_request", self.abort_request, ["POST"], control),
            ("/v1/models", self.models, ["GET"], []),
            ("/v1/completions", self.openai.completions, ["POST"], []),
            ("/v1/chat/completions", self.openai.chat_completions, ["POST"], []),
            ("/health", self.health, ["GET"], []),
            ("/health_generate", self.health_generate, ["GET"], []),
            ("/paused", self.paused, ["GET"], []),
            ("/model_info", self.model_info, ["GET"], []),
            ("/get_model_info", self.model_info, ["GET"], []),
            ("/metrics", self.metrics, ["GET"], []),
        ]
        for path, endpoint, methods, deps in routes:
            app.add_api_route(path, endpoint, methods=methods, dependencies=deps, response_model=None)
        install_error_handlers(app)
        return app

    async def _authorize(self, request: Request) -> None:
        if self.api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
            raise HTTPError(401, "Unauthorized: control endpoints need the header 'Authorization: Bearer <api key>'")

    # ------------------------------------------------------------- generation

    async def generate(self, body: GenerateIn) -> Any:
        """`POST /generate`: complete each prompt `n` times with its adapter (`lora_path`: a name or a
        reference such as `RUN@latest`, `serve.names`)."""
        if body.stream:
            raise HTTPError(400, "stream=true is not supported by this server: send stream=false")
        prompts, batch = prompt_ids(body, self.tokenizer)
        sampling = per_prompt(body.sampling_params or SamplingIn(), len(prompts), "sampling_params")
        adapters = per_prompt(body.lora_path, len(prompts), "lora_path")
        rids = [rid or os.urandom(16).hex() for rid in per_prompt(body.rid, len(prompts), "rid")]
        completions = await self.complete_named(prompts, sampling, adapters, rids)
        outs = [self._output(c, s, body) for c, s in zip(completions, expand_samples(sampling), strict=True)]
        return outs if batch or len(outs) > 1 else outs[0]

    async def complete_named(
        self, prompts: list[list[int]], sampling: list[SamplingIn], names: list[str | None], rids: list[str]
    ) -> list[Completion]:
        """Resolve the adapter each prompt names (`AdapterNames`) and complete each prompt `n` times, in
        SGLang's prompt-major order; `rids` are the prompts' client request ids (for `/abort_request`).

        The resolution is held from submission: the engine counts each request in flight from then, and a
        sync never retires a version in flight. One race is left: a sync retires the version a reference
        named between the resolution and the submission (the requests then fail at submission, or end
        aborted `adapter_unloaded` at admission, never having run). Such a call is resolved and run again,
        whole, under fresh request ids (at most `RESOLVE_ATTEMPTS` times), so one resolution serves a call.

        Raises:
            HTTPError: as `AdapterNames.resolve`; 504 when generation did not end after its deadline.
            LoraRLError: the engine refused a request (answered 400).
        """
        plain = {n for n in names if n is not None and not is_reference(n) and not n.startswith(STORE_URI_PREFIX)}
        await self._check_adapters(plain)
        for attempt in range(RESOLVE_ATTEMPTS):
            last = attempt == RESOLVE_ATTEMPTS - 1 or not any(is_reference(n) for n in names)
            adapters = await run_blocking(self.control_timeout_s, self.names.resolve, names)
            requests = self._requests(prompts, sampling, adapters, rids, attempt)
            try:
                completions = await self._complete(requests)
            except LoraRLError:
                if last or not await self._retired(names, adapters):
                    raise
                continue
            finally:
                for rid in rids:
                    self.rids.pop(rid, None)
            unloaded = any(c.abort_reason == "adapter_unloaded" for c in completions)
            if last or not unloaded or not await self._retired(names, adapters):
                return completions
        raise AssertionError("unreachable: the last attempt returns or raises")

    async def _check_adapters(self, names: set[str]) -> None:
        """Before a call's plain adapter names are resolved (`AdapterNames.resolve` answers 400 for one that is
        not loaded): nothing here; the SGLang look-alike (`lora_rl_testing.sglang_fake`) reloads an unloaded
        adapter from its remembered path at this point, as SGLang does."""

    async def _retired(self, names: list[str | None], adapters: list[str | None]) -> bool:
        """Whether a version that a reference of `names` resolved to (in `adapters`) is no longer loaded."""
        listed = await run_blocking(self.control_timeout_s, self.engine.list_adapters)
        resolved = {a for n, a in zip(names, adapters, strict=True) if is_reference(n)}
        return any(a is not None and not a.startswith(STORE_URI_PREFIX) and a not in listed for a in resolved)

    def _requests(
        self, prompts: list, sampling: list, adapters: list, rids: list[str], attempt: int = 0
    ) -> list[GenerationRequest]:
        """Prompt-major requests (SGLang's order); the samples of rid R are `R-0`, `R-1`, ... when n > 1, and
        carry a suffix `.A` on attempt A > 0."""
        requests = []
        for prompt, params, adapter, rid in zip(prompts, sampling, adapters, rids, strict=True):
            ids = [rid] if params.n == 1 else [f"{rid}-{j}" for j in range(params.n)]
            ids = [f"{i}.{attempt}" for i in ids] if attempt else ids
            self.rids[rid] = ids
            requests += [GenerationRequest(list(prompt), adapter, params.to_params(), request_id=i) for i in ids]
        return requests

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
        return generate_output(c, sampling, body, self.tokenizer)

    # ------------------------------------------------------------- control

    async def pause_generation(self, body: PauseIn | None = None) -> JSONResponse:
        """`POST /pause_generation` {mode}."""
        mode = (body or PauseIn()).mode
        if mode not in PAUSE_MODES:
            raise HTTPError(400, f"mode must be one of {PAUSE_MODES}, got {mode!r}")
        await run_blocking(self.control_timeout_s, self.engine.pause, mode)
        return JSONResponse({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(self) -> JSONResponse:
        """`POST /continue_generation`."""
        await run_blocking(self.control_timeout_s, self.engine.resume)
        return JSONResponse({"message": "Generation continued successfully.", "status": "ok"})

    async def flush_cache(self) -> PlainTextResponse:
        """`POST /flush_cache`: 200, or 400 when the engine refuses (requests running)."""
        try:
            flushed = await run_blocking(self.control_timeout_s, self.engine.flush_cache)
        except LoraRLError as exc:
            return PlainTextResponse(f"Cache not flushed: {exc}\n", status_code=400)
        if flushed is False:
            return PlainTextResponse("Cache not flushed: requests are running.\n", status_code=400)
        return PlainTextResponse("Cache flushed.\n")

    async def abort_request(self, body: AbortIn) -> JSONResponse:
        """`POST /abort_request` {rid, abort_all, abort_message}; answers `{"aborted": count}`."""
        reason = body.abort_message or "aborted"
        if body.abort_all:
            count = await run_blocking(self.control_timeout_s, self.engine.abort, None, reason=reason)
            return JSONResponse({"aborted": count})
        ids = self.rids.get(body.rid, [body.rid])
        count = await run_blocking(self.control_timeout_s, self._abort_ids, ids, reason)
        return JSONResponse({"aborted": count})

    # ------------------------------------------------------------- info

    async def models(self) -> JSONResponse:
        """`GET /v1/models`: the base model, one card per adapter (`parent` = base model), then one per alias
        `RUN@latest` (`alias_of` = the newest loaded version of RUN; SGLang clients read it as an adapter,
        ours skip it)."""
        listed = await run_blocking(self.control_timeout_s, self.engine.list_adapters)
        cards = [self._card(self.served_model_name, self.model_path, None, {})]
        cards += [
            self._card(name, self.adapters.root(name, info), self.served_model_name, info)
            for name, info in listed.items()
        ]
        for alias, name in latest_aliases(listed).items():
            card = self._card(name, self.adapters.root(name, listed[name]), self.served_model_name, listed[name])
            cards.append({**card, "id": alias, "alias_of": name})
        return JSONResponse({"object": "list", "data": cards})

    def _card(self, name: str, root: str, parent: str | None, info: dict[str, Any]) -> dict[str, Any]:
        card = {"id": name, "object": "model", "created": int(info.get("loaded_at") or self.started)}
        card.update(owned_by="lora-rl", root=root, parent=parent, max_model_len=None)
        if parent is not None:
            card.update(version=adapter_version(name), sha256=self.adapters.sha256(name))
            card.update({k: info[k] for k in ("in_flight", "pinned", "resident") if k in info})
        return card

    async def health(self) -> JSONResponse:
        """`GET /health`: 200 with `engine.health()` as JSON, 503 when it is not ok."""
        try:
            facts = await run_blocking(HEALTH_CHECK_TIMEOUT_S, self.engine.health)
        except (LoraRLError, HTTPError) as exc:
            return JSONResponse({"ok": False, "error": str(exc)}, status_code=503)
        return JSONResponse(facts, status_code=200 if facts.get("ok", True) else 503)

    async def paused(self) -> JSONResponse:
        """`GET /paused`: `{"paused": bool}` from `engine.is_paused()`, which runs nothing on the engine (in front
        of SGLang, `/health` runs a 1-token generation: a second per adapter retire under load); 503 when the
        engine cannot say."""
        try:
            paused = await run_blocking(HEALTH_CHECK_TIMEOUT_S, self.engine.is_paused)
        except (LoraRLError, HTTPError) as exc:
            return JSONResponse({"paused": None, "error": str(exc)}, status_code=503)
        return JSONResponse({"paused": paused})

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


def create_app(engine: ServingEngine, **options: Any) -> FastAPI:
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


def serve(
    built: BuiltEngine,
    *,
    model_path: str,
    tokenizer: Any,
    store: Any,
    request_timeout_s: float,
    host: str,
    port: int,
    api_key: str | None,
    served_model_name: str | None,
) -> None:
    """Serve `built.engine` with uvicorn until interrupted, then close it (and what it owns: a launched SGLang).

    The engine comes from `engines.registry.build_serving_engine`: the embedded one, or our SGLang client, so
    that this server is SGLang's front door: clients' `n > 1` calls become single-sample requests here, no
    abort reaches SGLang (`engine.sglang_abort: detach`) and a version is unloaded only once none of its
    requests is in flight, so a subscriber pointed here keeps SGLang at most `keep` versions resident however
    its clients behave (docs/HOTSWAP.md, "Bounded residency on SGLang").

    Args:
        built: the engine and what it owns.
        model_path: the model folder (`/model_info`; the default served name is its last part).
        tokenizer: the model's tokenizer (text prompts, chat templates).
        store: the `AdapterStore` for loads by `RUN@VERSION` and `store://` names (None: none).
        request_timeout_s: the deadline of one `/generate` call (`engine.timeout_s`).
        host, port: bind address; beyond loopback needs `api_key` (`check_bind`).
        api_key: Bearer key of the control endpoints.
        served_model_name: the base model's id in `/v1/models`; None = the model folder's name.

    Raises:
        LoraRLError: unsafe bind.
    """
    import uvicorn

    try:
        check_bind(host, api_key)
        app = create_app(
            built.engine,
            served_model_name=served_model_name or os.path.basename(os.path.normpath(model_path)),
            api_key=api_key,
            tokenizer=tokenizer,
            model_path=model_path,
            store=store,
            request_timeout_s=request_timeout_s,
        )
        # uvicorn shuts down gracefully on SIGINT/SIGTERM, then re-raises the signal (see cli.shutdown)
        uvicorn.run(app, host=host, port=port, log_level="info", timeout_keep_alive=5)
    finally:
        built.close()  # the embedded engine's worker thread (queued requests end aborted), or a launched SGLang
