"""A fake SGLang server: an embedded engine behind our engine server, answering in real SGLang 0.5.x shapes.

Our server (`lora_rl_core.engines.serve.app`) already speaks SGLang's wire format for the requests and the
error bodies; where its answers carry more than SGLang's, this fake answers as SGLang does (sglang 0.5.23
`srt/entrypoints/http_server.py`, 0.5.17 as seen on the GPU host, docs/SGLANG.md):

* `/abort_request` answers an empty 200 (no count) and ignores any reason: SGLang passes only `rid` and
  `abort_all` to its tokenizer manager.
* An aborted request's `finish_reason` is `{"type": "abort", "message": "Aborted by AbortReq.", ...}`
  (`FINISH_ABORT.to_json()`), whatever the reason.
* Stop sequences (`stop`, `stop_token_ids`, `no_stop_trim`) as our server serves them, which is SGLang's shape:
  `finish_reason` `{"type": "stop", "matched": M}` with `M` the stop string, or the token id for a stop token id
  and for EOS alike; a stop's tokens in `output_token_logprobs`; `text` without the match unless `no_stop_trim`
  (`Req._check_str_based_finish`, `_check_token_based_finish`, `DetokenizerManager.trim_matched_stop`). And as
  SGLang, a completion whose last allowed token (`max_new_tokens`) ended it is `{"type": "length", ...}`:
  `Req.update_finish_state` checks the limit first. Without a tokenizer (`tokenizer=` not given) the matched
  string is the request's first stop string.
* `/server_info` (and `/get_server_info`) says `{"version": "0.5.17"}` (`version=` another, or None for none).
* `meta_info.weight_version` is `"default"` (the base weights' version, not the adapter's), and there
  is no `lora_path` in `meta_info`.
* `/v1/models` adapter cards are `{id, object, created, owned_by, root, parent, max_model_len}` only.
* `/health` answers an empty 200; while generation is paused it answers 503 only after
  `health_check_timeout_s` (SGLang's `/health` runs a 1-token generation, which cannot run while paused,
  and gives up after `SGLANG_HEALTH_CHECK_TIMEOUT`, 20 s; `/model_info` answers at once).
* A `/generate` that names an adapter unloaded earlier loads it again from the path it was first loaded
  from, and answers 200 (0.5.17 on the GPU host: `TokenizerManager.lora_ref_cache`, log line
  "Reloading evicted adapter"); `SGLangFakeServer.reloaded` lists the names brought back so. An adapter
  that came from tensors has the path `__tensor__`, which cannot be read again: that `/generate` is a 400
  "Failed to implicitly load LoRA adapter NAME: ..." (`TokenizerManager._resolve_lora_path`).
* A `/generate` call one of whose requests is aborted, by id (`/abort_request`) or by `/pause_generation` in
  `abort` mode (or `abort_all`), answers HTTP 499 `{"error": {"message": "Request RID was aborted"}}` for the
  whole call, and its other requests are dropped unfinished (aborted in the engine). SGLang 0.5.17 does so
  for a batch whose abort comes before it reaches the scheduler (`TokenizerManager.
  _raise_if_logical_rid_aborted` raises `RequestAbortedError`, status 499; `_discard_pending_req_states`
  drops the other rows; seen on the GPU host under the stress run); the fake does it whenever a row is
  aborted so, the harder case for a client. Rows that end by the server's own deadline (`timeout`) or
  because their adapter was unloaded keep per-row abort finishes. Our server (`lora_rl_core.engines.serve.app`)
  answers per-row aborts in every case.
* `/load_lora_adapter_from_tensors` takes SGLang's own payload: base64 of a pickled `{peft_key: tensor}`
  (`MultiprocessingSerializer`), unpickled with an allow-list as SGLang's `SafeUnpickler` does. Only
  pickles with the data in them work here (no GPU: CUDA IPC handles cannot be opened).

* Adapter reference counts as 0.5.17 keeps them (`LoRARegistry`, `TokenizerManager`): a `/generate` takes one
  reference per prompt naming an adapter once its names are checked, and each request that ends releases
  one, so a prompt with `n > 1` releases `n + 1` (its prefix request and each sample) and leaves the count
  below zero (sglang#36894); a request aborted by `/abort_request` or an `abort` pause, and every prompt of a
  call failed with HTTP 499, releases none (0.5.17 releases nothing for a request aborted in its queue,
  sglang#34205; the fake takes that for every such abort). `/unload_lora_adapter` unregisters the adapter,
  then waits, holding the LoRA update lock that every load and unload takes, until its count is exactly 0:
  SGLang waits forever; the fake gives up after `unload_wait_s` with HTTP 500 and records the adapter and
  its count in `SGLangFakeServer.hung_unloads` (the lock stays held for that long: later loads wait).

So a client that works against this fake relies on nothing only our server provides.
"""

from __future__ import annotations

import asyncio
import base64
import io
import pickle
import time
from collections import Counter
from typing import Any

import anyio
from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from lora_rl_core.engines.base import Completion, GenerationRequest, ServingEngine
from lora_rl_core.engines.serve.adapters import TENSOR_ROOT, AdapterRoutes
from lora_rl_core.engines.serve.api import (
    AbortIn,
    GenerateIn,
    HTTPError,
    LoadIn,
    LoadTensorsIn,
    SamplingIn,
    UnloadIn,
    output_text,
    run_blocking,
)
from lora_rl_core.engines.serve.app import HEALTH_CHECK_TIMEOUT_S, EngineServer
from lora_rl_core.errors import EngineError

SGLANG_ABORT_MESSAGE = "Aborted by AbortReq."  # sglang/srt/managers/scheduler.py, abort_request
ABORTED_STATUS = 499  # sglang/srt/managers/tokenizer_manager.py, RequestAbortedError.status_code
WHOLE_CALL_ABORTS = ("aborted", "paused")
"""Abort reasons that fail the whole `/generate` call with HTTP 499: an abort by id or of all, a pause in
`abort` mode (SGLang marks the request `abort_requested`)."""
_CARD_FIELDS = ("id", "object", "created", "owned_by", "root", "parent", "max_model_len")


class _RememberingRoutes(AdapterRoutes):
    """Adapter routes that remember the path of every adapter loaded from a folder, as SGLang's
    `lora_ref_cache` does, also after the adapter is unloaded; loads and unloads take one lock, and an unload
    waits for the adapter's reference count (`refs`) to be 0 (see the module docstring)."""

    def __init__(self, *args: Any, refs: Counter[str], unload_wait_s: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.ref_cache: dict[str, str] = {}
        self.refs = refs
        self.unload_wait_s = unload_wait_s
        self.update_lock = asyncio.Lock()  # SGLang's `lora_update_lock`
        self.hung_unloads: list[tuple[str, int]] = []

    async def unload_lora_adapter(self, body: UnloadIn) -> JSONResponse:
        """Unregister, then wait under the update lock until the count is 0 (SGLang: forever)."""
        async with self.update_lock:
            deadline = time.monotonic() + self.unload_wait_s
            while self.refs[body.lora_name] != 0 and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            if self.refs[body.lora_name] != 0:
                self.hung_unloads.append((body.lora_name, self.refs[body.lora_name]))
                count = self.refs[body.lora_name]
                message = f"fake: the unload of {body.lora_name} waits forever (reference count {count})"
                return await self._update_failed(HTTPError(500, message))
            return await super().unload_lora_adapter(body)

    async def load_lora_adapter(self, body: LoadIn) -> JSONResponse:
        async with self.update_lock:
            return await self._load_remembering(body)

    async def _load_remembering(self, body: LoadIn) -> JSONResponse:
        answer = await super().load_lora_adapter(body)
        if body.lora_name in self.loaded:
            self.ref_cache[body.lora_name] = self.loaded[body.lora_name]["path"]
        return answer

    async def load_lora_adapter_from_tensors(self, body: LoadTensorsIn) -> JSONResponse:
        """SGLang's pickle payload (`load_format` None); `safetensors` as our server."""
        async with self.update_lock:
            return await self._load_tensors_remembering(body)

    async def _load_tensors_remembering(self, body: LoadTensorsIn) -> JSONResponse:
        if body.load_format is not None:
            return await super().load_lora_adapter_from_tensors(body)
        try:
            await run_blocking(self.control_timeout_s, self._load_pickled, body)
        except (EngineError, HTTPError) as exc:
            return await self._update_failed(exc)
        self.loaded[body.lora_name] = {"path": TENSOR_ROOT, "sha256": None}
        self.ref_cache[body.lora_name] = TENSOR_ROOT
        return await self._update_ok()

    def _load_pickled(self, body: LoadTensorsIn) -> None:
        payloads = body.serialized_named_tensors or []
        if len(payloads) != 1:
            raise EngineError(f"expected one payload per TP rank (1), got {len(payloads)}")
        try:
            tensors = _SafeUnpickler(io.BytesIO(base64.b64decode(payloads[0], validate=True))).load()
        except Exception as exc:  # SGLang answers any deserialisation failure as success=false
            raise EngineError(f"cannot deserialize serialized_named_tensors[0]: {exc}") from None
        self.engine.load_adapter(body.lora_name, tensors=tensors, config=body.config_dict, pinned=body.pinned)


class _SafeUnpickler(pickle.Unpickler):
    """SGLang's `SafeUnpickler` allow-list, the prefixes a tensor dict needs (`sglang/srt/utils/common.py`)."""

    _ALLOWED = ("builtins.", "collections.", "copyreg.", "torch.", "multiprocessing.reduction.")
    _DENIED = {("builtins", "eval"), ("builtins", "exec"), ("builtins", "compile")}

    def find_class(self, module: str, name: str) -> Any:
        if not (module + ".").startswith(self._ALLOWED) or (module, name) in self._DENIED:
            raise RuntimeError(f"Blocked unsafe class loading ({module}.{name})")
        return super().find_class(module, name)


FAKE_SGLANG_VERSION = "0.5.17"
"""The version the fake says it is: the one seen on the GPU host."""


class SGLangFakeServer(EngineServer):
    """`EngineServer` with SGLang's answers where ours differ (see the module docstring)."""

    def __init__(
        self,
        engine: ServingEngine,
        *,
        health_check_timeout_s: float = 20.0,
        unload_wait_s: float = 5.0,
        version: str | None = FAKE_SGLANG_VERSION,
        **options: Any,
    ) -> None:
        super().__init__(engine, **options)
        self.health_check_timeout_s = health_check_timeout_s
        self.version = version
        """What `/server_info` says the version is (None: a server that says none)."""
        self.refs: Counter[str] = Counter()
        """Adapter name -> SGLang's reference count (`LoRARegistry._counters`), as 0.5.17 keeps it."""
        self.adapters = self.remembering = _RememberingRoutes(
            engine,
            store=self.store,
            control_timeout_s=self.control_timeout_s,
            load_seconds=self.adapters.load_seconds,
            refs=self.refs,
            unload_wait_s=unload_wait_s,
        )
        self.reloaded: list[str] = []

    def app(self) -> FastAPI:
        """Our server's app with SGLang's `/server_info` and its older name `/get_server_info` (the version)."""
        app = super().app()
        for path in ("/server_info", "/get_server_info"):
            app.add_api_route(path, self.server_info, methods=["GET"], response_model=None)
        return app

    async def server_info(self) -> dict[str, Any]:
        """SGLang's `/server_info`, of which the client reads `version` only."""
        return {} if self.version is None else {"version": self.version}

    @property
    def hung_unloads(self) -> list[tuple[str, int]]:
        """The unloads that would have waited forever on SGLang: (adapter, its reference count then)."""
        return self.remembering.hung_unloads

    async def complete_named(
        self, prompts: list[list[int]], sampling: list[SamplingIn], names: list[str | None], rids: list[str]
    ) -> list[Completion]:
        """As our server, counting adapter references as SGLang 0.5.17 does (module docstring)."""
        try:
            completions = await super().complete_named(prompts, sampling, names, rids)
        except HTTPError as exc:
            if exc.status == ABORTED_STATUS:  # referenced, then failed before the scheduler: never released
                self.refs.update(n for n in names if n is not None)
            raise
        done = iter(completions)
        for name, params in zip(names, sampling, strict=True):
            rows = [next(done) for _ in range(params.n)]
            if name is None:
                continue
            ended = sum(c.abort_reason not in WHOLE_CALL_ABORTS for c in rows)  # aborted ones release nothing
            self.refs[name] += 1 - ended - (params.n > 1)  # n > 1: the prefix request releases one more
        return completions

    async def _check_adapters(self, names: set[str]) -> None:
        """SGLang loads an unloaded adapter again from its remembered path before the 400 check."""
        listed = await run_blocking(self.control_timeout_s, self.engine.list_adapters)
        for name in sorted(names - set(listed)):
            path = self.remembering.ref_cache.get(name)
            if path == TENSOR_ROOT:
                message = f"Failed to implicitly load LoRA adapter {name}: cannot read {TENSOR_ROOT!r}"
                raise HTTPError(400, message)
            if path is not None:
                await run_blocking(self.control_timeout_s, self.engine.load_adapter, name, path=path)
                self.adapters.loaded[name] = {"path": path, "sha256": None}
                self.reloaded.append(name)
        await super()._check_adapters(names)

    async def _complete(self, requests: list[GenerationRequest]) -> list[Completion]:
        """As our server, except that the first request aborted by id or by an `abort` pause fails the whole
        call with HTTP 499, after the other requests of the call are aborted in the engine (SGLang drops them).

        Raises:
            HTTPError: 499 `Request RID was aborted`; 504 as our server when requests hang past the deadline.
        """
        futures = [asyncio.wrap_future(f) for f in await anyio.to_thread.run_sync(self._submit_all, requests)]
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.request_timeout_s
        pending: set[asyncio.Future] = set(futures)
        while pending and loop.time() < deadline:
            done, pending = await asyncio.wait(
                pending, timeout=deadline - loop.time(), return_when=asyncio.FIRST_COMPLETED
            )
            aborted = next((c for c in (_result(f) for f in done) if c and c.abort_reason in WHOLE_CALL_ABORTS), None)
            if aborted is not None:
                others = [r.request_id for r, f in zip(requests, futures, strict=True) if f in pending]
                await anyio.to_thread.run_sync(self._abort_ids, others, "aborted")
                if pending:
                    await asyncio.wait(pending, timeout=HEALTH_CHECK_TIMEOUT_S)
                raise HTTPError(ABORTED_STATUS, f"Request {self._rid_of(aborted.request_id)} was aborted")
        if pending:  # the deadline: per-row `timeout` aborts, as our server
            ids = [r.request_id for r, f in zip(requests, futures, strict=True) if f in pending]
            await anyio.to_thread.run_sync(self._abort_ids, ids, "timeout")
            _, stuck = await asyncio.wait(pending, timeout=HEALTH_CHECK_TIMEOUT_S)
            if stuck:
                raise HTTPError(504, f"generation did not finish within {self.request_timeout_s:g} s")
        return [f.result() for f in futures]

    def _rid_of(self, request_id: str) -> str:
        """The client's rid of an engine request (SGLang names the logical request; `n > 1` expands it)."""
        return next((rid for rid, ids in self.rids.items() if request_id in ids), request_id)

    async def abort_request(self, body: AbortIn) -> Response:  # type: ignore[override]
        """`POST /abort_request`: abort, then an empty 200 as SGLang (no count, no reason)."""
        await super().abort_request(AbortIn(rid=body.rid, abort_all=body.abort_all))
        return Response(status_code=200)

    def _output(self, c: Completion, sampling: SamplingIn, body: GenerateIn) -> dict[str, Any]:
        out = super()._output(c, sampling, body)
        meta = out["meta_info"]
        meta["weight_version"] = "default"
        meta.pop("lora_path", None)
        if c.finish_reason in ("stop", "eos") and len(c.completion_ids) >= sampling.max_new_tokens:
            meta["finish_reason"] = {"type": "length", "length": sampling.max_new_tokens}  # the limit wins
            out["text"] = output_text(c.completion_ids, None, sampling, self.tokenizer)  # nothing matched to trim
        if c.finish_reason == "abort":
            meta["finish_reason"] = {
                "type": "abort",
                "message": SGLANG_ABORT_MESSAGE,
                "status_code": None,
                "err_type": None,
            }
        return out

    def _card(self, name: str, root: str, parent: str | None, info: dict[str, Any]) -> dict[str, Any]:
        card = super()._card(name, root, parent, info)
        return {k: card[k] for k in _CARD_FIELDS}

    async def health(self) -> Response:  # type: ignore[override]
        """`GET /health`: an empty 200; while paused, a 503 after `health_check_timeout_s` (as SGLang)."""
        if self.engine.health().get("paused"):
            await asyncio.sleep(self.health_check_timeout_s)
            return Response(status_code=503)
        return Response(status_code=200)


def _result(future: asyncio.Future) -> Completion | None:
    """A finished request's completion; None when it failed (its error is raised with the others')."""
    return None if future.exception() is not None else future.result()


def create_sglang_fake_app(engine: ServingEngine, *, served_model_name: str = "fake-sglang", **options: Any) -> FastAPI:
    """The FastAPI app of the fake SGLang server over `engine` (`input_ids` prompts only: no tokenizer);
    `options` are `SGLangFakeServer`'s keyword arguments (e.g. `unload_wait_s`)."""
    return SGLangFakeServer(engine, served_model_name=served_model_name, **options).app()
