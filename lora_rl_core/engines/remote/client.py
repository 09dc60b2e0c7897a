"""The HTTP client of an SGLang-API server (`HTTPEngine`): a real SGLang server or our engine server.

One client speaks the SGLang API exactly as docs/SGLANG.md lists it (sglang 0.5.23
`sglang/srt/entrypoints/http_server.py`, structs in `sglang/srt/managers/io_struct.py`): `/generate` with
`input_ids` batches, a `lora_path` list (adapter name per prompt, null = base model), `rid` list and
`return_logprob`; `/load_lora_adapter`, `/load_lora_adapter_from_tensors`, `/unload_lora_adapter`,
`/pause_generation`, `/continue_generation`, `/flush_cache`, `/abort_request`, `/v1/models`. What differs
between a real SGLang and our server (`lora_rl_core.engines.serve`) is its `Dialect` (`remote.dialect`:
`SGLANG`, `SERVER`); how adapter tensors travel is its `TensorLoader` (`remote.transport`).

Choices made here:

* Every HTTP call has a timeout (`timeout_s` for generation, `control_timeout_s` for the rest).
  A transport failure, a timeout or HTTP 502/503/504 raises `EngineUnavailable` (retry later);
  any other error status raises `EngineError` carrying the server's message.
* `generate` groups requests with equal sampling params into `/generate` batch calls of at most
  `max_batch_requests` prompts, sent concurrently, and maps the answers back by position (seeds:
  `Dialect.sampling_payload`).
* Real SGLang reads adapters from local folders: `file://` URIs are turned into paths and a store
  version folder into the folder of its files (`Dialect.server_path`); other URIs are refused (pull the
  version first).
* `pause`/`resume` state of a real SGLang server is known only from this client's own calls (`is_paused`
  makes no HTTP call); our server reports it (`Dialect.reports_state`).
* Abort reasons: the server's reason wins where it names one (ours does); for SGLang's prose this client
  keeps the reason it gave (`remote.tracking.InFlightRequests`).
* Requests on a real SGLang server are never aborted there (`abort="detach"`, the default): SGLang 0.5.17
  never releases the adapter reference of a request aborted in its queue, by `/abort_request`, an `abort`
  pause or a closed connection (sglang#34205), and an unload of that adapter then waits forever under its
  LoRA lock. `abort`, an `abort` pause and the call's deadline end this client's requests at once with
  their reason, while SGLang finishes them and this client keeps them in flight until it has; `pause("abort")`
  pauses SGLang in `retract` mode. An unload first retires the name here, then waits until none of this
  client's requests uses it (`unload_adapter`), so SGLang's own wait finds its count at zero
  (docs/HOTSWAP.md, "Bounded residency on SGLang").
* SGLang 0.5.17 answers a whole `/generate` batch HTTP 499 ("Request RID was aborted") when one of its requests
  was aborted (by id, or by `/pause_generation` in `abort` mode) before the batch reached its scheduler:
  the requests this client aborted end with their kept reason; the others are sent again under fresh rids
  (an `abort` follows them), bounded (`tracking.MAX_UNEXPLAINED_LOSSES`) and within the call's deadline.

Modules: the wire format (payloads, answers into `Completion`s, error messages, metrics text) is
`remote.wire`; what a client keeps about its requests is `remote.tracking`.

Left out: streaming, OpenAI-compatible endpoints, retries (the caller decides).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import httpx

from lora_rl_core.adapters import adapter_version
from lora_rl_core.config import SGLANG_DEFAULTS, IpcLayout, SGLangAbort, SGLangRetire, TensorDtype, TensorTransport
from lora_rl_core.engines.base import ABORT_REASONS, Completion, GenerationRequest, aborted_completion
from lora_rl_core.engines.remote.coalesce import FreshCall
from lora_rl_core.engines.remote.control import ControlCalls
from lora_rl_core.engines.remote.dialect import Dialect
from lora_rl_core.engines.remote.tracking import InFlightRequests, LostCalls, RetiredAdapters
from lora_rl_core.engines.remote.transport import tensor_loader
from lora_rl_core.engines.remote.wire import (
    adapters_from_models,
    check_name,
    chunks,
    error_message,
    json_or_empty,
    to_completion,
)
from lora_rl_core.errors import EngineError, EngineUnavailable

log = logging.getLogger(__name__)

SUBMIT_CONCURRENCY = 512
"""`submit` calls in flight at once (a server in front of this client submits each request on its own)."""
KEEPALIVE_S = 2.0
"""Seconds an idle connection is kept for reuse: under the 5 s after which uvicorn closes it on the server."""
DETACHED_GRACE_S = 3600.0
"""With `abort="detach"`: how long past a call's deadline this client still waits for SGLang to answer the
requests it ended early (closing the connection sooner would make SGLang abort them: sglang#34205)."""


class HTTPEngine(ControlCalls):
    """`ServingEngine` over the HTTP API of a real SGLang server or of our engine server.

    Args:
        dialect: which server it is (`remote.dialect.SGLANG`, `remote.dialect.SERVER`).
        url: server root, e.g. `http://127.0.0.1:30000`.
        api_key: sent as `Authorization: Bearer KEY` on every call.
        timeout_s: deadline of one `generate` call, seconds.
        control_timeout_s: deadline of every other call, seconds.
        max_batch_requests: prompts per `/generate` call.
        max_concurrency: `/generate` calls in flight at once from this client.
        tensor_transport: how SGLang receives adapters given as tensors (`engine.tensor_transport`).
        retire: `unload` (`unload_adapter` calls `/unload_lora_adapter`) or `keep` (it only retires the name
            in this client and leaves the weights resident on the server; `engine.sglang_retire`).
        tensor_layout: how `ipc` shares the tensors (`engine.tensor_layout`).
        tensor_dtype: the dtype tensors are sent to SGLang in, or `keep` (`engine.tensor_dtype`).
        abort: for a real SGLang server, `detach` (the requests `abort`, an `abort` pause or the deadline end
            are ended here at once and left to finish on the server, which is never sent an abort) or
            `forward` (`/abort_request`; `engine.sglang_abort`).

    The allowed values of the last five are checked once, by `EngineConfig`.

    Raises:
        EngineError: `url` is not http(s).
    """

    def __init__(
        self,
        dialect: Dialect,
        url: str,
        *,
        api_key: str | None = None,
        timeout_s: float = SGLANG_DEFAULTS.timeout_s,
        control_timeout_s: float = 60.0,
        max_batch_requests: int = 256,
        max_concurrency: int = 4,
        tensor_transport: TensorTransport = SGLANG_DEFAULTS.tensor_transport,
        retire: SGLangRetire = SGLANG_DEFAULTS.sglang_retire,
        tensor_layout: IpcLayout = SGLANG_DEFAULTS.tensor_layout,
        tensor_dtype: TensorDtype = SGLANG_DEFAULTS.tensor_dtype,
        abort: SGLangAbort = SGLANG_DEFAULTS.sglang_abort,
    ) -> None:
        if not url.startswith(("http://", "https://")):
            raise EngineError(f"engine URL {url!r} must start with http:// or https://")
        self.dialect = dialect
        self.url = url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        timeout = httpx.Timeout(control_timeout_s, connect=min(10.0, control_timeout_s))
        # idle connections are dropped here before uvicorn (SGLang's and ours) drops them at 5 s, so that none is
        # reused as the server closes it (a reset or EBADF on 2 of ~23k calls of a look-alike soak at httpx's 5 s)
        control = httpx.Limits(max_connections=100, max_keepalive_connections=20, keepalive_expiry=KEEPALIVE_S)
        self._http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout, limits=control)
        # `/generate` calls get their own connections, as many as can be in flight: a control call (a resume
        # above all) must never wait for a connection behind generation calls that wait for it (seen on the
        # H100: 128 requests of a paused SGLang held httpx's default 100 connections, the resume timed out)
        most = SUBMIT_CONCURRENCY + max_concurrency
        limits = httpx.Limits(max_connections=most, max_keepalive_connections=64, keepalive_expiry=KEEPALIVE_S)
        self._generation_http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout, limits=limits)
        self.timeout_s = timeout_s
        self.control_timeout_s = control_timeout_s
        self._max_batch = max_batch_requests
        self._pool = ThreadPoolExecutor(max_workers=max_concurrency, thread_name_prefix="engine-http")
        self._submits = ThreadPoolExecutor(max_workers=SUBMIT_CONCURRENCY, thread_name_prefix="engine-submit")
        self.detach = abort == "detach" and dialect.guards_retired  # a real SGLang server
        self._upstream = ThreadPoolExecutor(max_workers=SUBMIT_CONCURRENCY, thread_name_prefix="engine-upstream")
        self._requests = InFlightRequests()
        # one GET /v1/models for the callers that arrive while none is in flight (our server lists per request)
        self._models = FreshCall(lambda: json_or_empty(self._call("GET", "/v1/models")))
        self._retired = RetiredAdapters()
        self.tensors = tensor_loader(
            dialect.tensor_upload, url=self.url, transport=tensor_transport, layout=tensor_layout, dtype=tensor_dtype
        )
        self.retire = retire
        self._kept: set[str] = set()  # retired here, left resident on the server (retire="keep")
        self._draining: set[str] = set()  # retired here, still listed there until their unload is done
        self._loads: Counter[str] = Counter()
        self._lost = LostCalls(self._requests)  # calls SGLang lost (HTTP 499) and requests sent again after one
        self._closed = False
        self._paused = False
        self._version_pending = False  # `connect` asks the version (`check_version`); pending if unreachable

    def __repr__(self) -> str:
        return f"HTTPEngine({self.dialect.name}, {self.url!r})"

    def close(self) -> None:
        """Close the HTTP connections and the worker threads (idempotent); later calls raise EngineError.
        The server is not told: requests it is running finish there."""
        self._closed = True
        for pool in (self._pool, self._submits, self._upstream):
            pool.shutdown(wait=False, cancel_futures=True)
        self._http.close()
        self._generation_http.close()

    def members(self) -> list[HTTPEngine]:
        """`[self]`: a single engine (`ServingEngine.members`)."""
        return [self]

    def __enter__(self) -> HTTPEngine:
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
        """One HTTP call (`/generate` on the generation connections, the rest on the control ones); statuses
        in `accept` are answers, not errors.
        Raises EngineUnavailable (transport, timeout) or EngineError (closed client, error status, a server of a
        version the dialect does not know: `check_version`, where `connect` could not ask)."""
        if self._closed:
            raise EngineError(f"{self!r} is closed")
        if self._version_pending:  # `connect` could not reach the server to ask its version
            self.check_version()
        timeout = timeout_s if timeout_s is not None else self.control_timeout_s
        http = self._generation_http if path == "/generate" else self._http
        try:
            try:
                response = http.request(method, path, json=json_body, timeout=timeout)
            except (httpx.ReadError, httpx.RemoteProtocolError):
                if method != "GET":
                    raise
                # a kept-alive connection the server closed as it was reused (uvicorn closes idle ones after
                # 5 s): a GET is safe to send once more (seen once in 23k calls of the look-alike soak)
                response = http.request(method, path, json=json_body, timeout=timeout)
        except httpx.TimeoutException:
            raise EngineUnavailable(f"{method} {self.url}{path}: no answer within {timeout:g} s") from None
        except httpx.TransportError as exc:
            raise EngineUnavailable(f"{method} {self.url}{path}: cannot reach the engine: {exc}") from None
        if response.status_code >= 400 and response.status_code not in accept:
            error = EngineUnavailable if response.status_code in (502, 503, 504) else EngineError
            raise error(f"{error_message(response)} ({method} {self.url}{path}: HTTP {response.status_code})")
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
        if self._closed:
            raise EngineError(f"{self!r} is closed")
        deadline = time.monotonic() + (timeout_s if timeout_s is not None else self.timeout_s)
        batches = chunks(requests, self._max_batch)
        if len(batches) == 1:
            done = [self._generate_chunk(batches[0][1], deadline)]
        else:
            done = list(self._pool.map(lambda batch: self._generate_chunk(batch[1], deadline), batches))
        out: list[Completion | None] = [None] * len(requests)
        for (indices, _), completions in zip(batches, done, strict=True):
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
        return self._submits.submit(lambda: self._generate_chunk([request], deadline)[0])

    def _generate_chunk(self, requests: list[GenerationRequest], deadline: float) -> list[Completion]:
        """One `/generate` batch call. With `detach`, the call runs in the background and this returns as soon
        as it answers or every one of its requests was ended here (aborted, paused; at the deadline the rest
        end `timeout`): those end with their reason while SGLang finishes them."""
        if self.dialect.guards_retired:  # never send a retired name: SGLang would load that version again
            self._retired.check(requests, self.url)
        if not self.detach:
            return self._run_chunk(requests, deadline)
        call = self._upstream.submit(self._run_chunk, requests, deadline + DETACHED_GRACE_S)
        ended = self._requests.wait_ended([r.request_id for r in requests], call, deadline)
        if ended is None:
            return call.result()
        call.add_done_callback(self._log_failure)
        return [aborted_completion(r, adapter_version(r.adapter), ended[r.request_id]) for r in requests]

    def _log_failure(self, call: Future[list[Completion]]) -> None:
        """A detached call's failure, logged (its caller has its requests' completions already), unless this
        client was closed meanwhile (closing fails the calls it leaves)."""
        if not self._closed and not call.cancelled() and (exc := call.exception()) is not None:
            log.warning("a /generate call whose requests ended early failed afterwards: %s", exc)

    def _run_chunk(self, requests: list[GenerationRequest], deadline: float) -> list[Completion]:
        """One `/generate` batch call, answered; where SGLang loses the whole call to an abort (HTTP 499), the
        rows this client aborted end with their kept reason and the others are sent again
        (`LostCalls.resolve`). With `detach`, a row ended here meanwhile ends with its kept reason whatever
        SGLang answered for it."""
        outs: dict[str, dict[str, Any]] = {}  # request id -> its /generate output
        lost: dict[str, str] = {}  # request id -> abort reason, for rows that ended with a call SGLang lost
        with self._requests.tracking(requests) as reasons:
            pending, rids = list(requests), {r.request_id: r.request_id for r in requests}
            unexplained = 0  # calls lost with no row this client aborted
            for attempt in itertools.count(1):
                answer = self._post_generate(pending, rids, deadline, first=attempt == 1)
                if not isinstance(answer, str):
                    outs.update((r.request_id, out) for r, out in zip(pending, answer, strict=True))
                    break
                pending, explained = self._lost.resolve(
                    pending, rids, lost, answer, attempt, deadline, unexplained, self.url
                )
                unexplained += not explained
                if not pending:
                    break
        if self.detach:
            lost.update((i, reason) for i, reason in reasons.items() if i not in lost)
        completions = [
            aborted_completion(r, adapter_version(r.adapter), lost[r.request_id])
            if r.request_id in lost
            else to_completion(
                r,
                outs[r.request_id],
                self.url,
                check_version=self.dialect.reports_adapter_version,
                reason=reasons.get(r.request_id),
            )
            for r in requests
        ]
        self._requests.count(completions)
        return completions

    def _post_generate(
        self, requests: list[GenerationRequest], rids: dict[str, str], deadline: float, *, first: bool
    ) -> list[dict[str, Any]] | str:
        """POST one `/generate` of `requests` under `rids`: their outputs in order, or the error message of
        an HTTP 499 (SGLang 0.5.17 failed the whole call because a request of it was aborted).

        Raises:
            EngineUnavailable: the deadline passed before the first send (`first`), no answer in time, or
                unreachable (the requests are then aborted on the server, best effort).
            EngineError: another error status, or an answer that is not one output per request.
        """
        left = deadline - time.monotonic()
        if left <= 0 and first:
            raise EngineUnavailable(f"POST {self.url}/generate: deadline passed before the call was sent")
        payload: dict[str, Any] = {
            "input_ids": [list(r.prompt_ids) for r in requests],
            "sampling_params": self.dialect.sampling_payload(requests[0].sampling, len(requests)),
            "rid": [rids[r.request_id] for r in requests],
            "return_logprob": True,
            "stream": False,
        }
        if any(r.adapter is not None for r in requests):  # a server started without LoRA refuses any lora_path
            payload["lora_path"] = [r.adapter for r in requests]
        try:
            response = self._call("POST", "/generate", json_body=payload, timeout_s=max(left, 0.001), accept=(499,))
        except EngineUnavailable:
            if not self.detach:  # don't leave the server working on them (detach: an abort would leak, #34205)
                self._abort_quietly([rids[r.request_id] for r in requests])
            raise
        if response.status_code == 499:
            return error_message(response)
        answer = response.json()
        if not isinstance(answer, list) or len(answer) != len(requests):
            raise EngineError(f"{self.url}/generate answered {type(answer).__name__}, not {len(requests)} outputs")
        return answer

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
        a later `abort` or `pause("abort")` does not end it again. With `detach` (a real SGLang server) nothing
        is sent: the request ends here at once with `reason` and SGLang finishes it (`None`: this client's
        requests only).

        Returns:
            How many requests were aborted: the server's count where it reports one (ours does), else
            this client's own in-flight requests it ended (real SGLang answers an empty 200).

        Raises:
            EngineError: `reason` is not one of `ABORT_REASONS`, or the server refused.
        """
        if reason not in ABORT_REASONS:
            raise EngineError(f"abort reason {reason!r} is not one of {ABORT_REASONS}")
        known = self._requests.keep_reason(request_id, reason)  # before the call: the answer may come first
        if self.detach:
            return len(known)
        if request_id is None:
            body: dict[str, Any] = {"rid": "", "abort_all": True}
        else:  # the rid it is sent under now: a fresh one if a lost call made this client send it again
            body = {"rid": self._requests.rid_of(request_id), "abort_all": False}
        response = self._call("POST", "/abort_request", json_body=self.dialect.abort_body(body, reason))
        reported = json_or_empty(response).get("aborted")
        return reported if isinstance(reported, int) else len(known)

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
        """Load a PEFT adapter under `name`: from a folder (`/load_lora_adapter`; our server also reads any
        fsspec URI), or from `tensors` + PEFT `config` by this client's `TensorLoader` (`self.tensors`; for
        SGLang: CUDA IPC handles, the data inline, or `path`, falling back to `path` when SGLang refuses the
        tensors, `metrics()["tensor_fallback"]` says why).

        Raises:
            EngineError: bad name, a path the server cannot read, tensors without config, transport `disk`
                without `path`, or the server's refusal (already loaded, rank or target modules outside the
                pool).
        """
        check_name(name)
        if tensors is None:
            if path is None:
                raise EngineError(f"load_adapter({name!r}) needs path=, or tensors= and config=")
            self.load_path(name, path, pinned, timeout_s)
            return
        if config is None:
            raise EngineError(f"load_adapter({name!r}, tensors=...) needs config= (the PEFT config dict)")
        used = self.tensors.load(self, name, tensors, config, path=path, pinned=pinned, timeout_s=timeout_s)
        if used is not None:
            self._loads[used] += 1

    def load_path(self, name: str, path: str, pinned: bool, timeout_s: float | None, kind: str = "disk") -> None:
        """`/load_lora_adapter` of the folder `path` (as the server can read it: `Dialect.server_path`), counted
        as a `kind` load (`disk`: a published folder; `file`: one written for this load)."""
        body = {"lora_name": name, "lora_path": self.dialect.server_path(path, self.url), "pinned": pinned}
        self.update("/load_lora_adapter", body, timeout_s)
        self._loads[kind] += 1

    def update(self, path: str, body: dict[str, Any], timeout_s: float | None) -> dict[str, Any]:
        """POST a LoRA update and check `LoRAUpdateOutput.success`.

        Raises:
            EngineError: the server refused (its `error_message`); EngineUnavailable: no answer.
        """
        answer = json_or_empty(self._call("POST", path, json_body=body, timeout_s=timeout_s))
        if answer.get("success") is False:
            raise EngineError(f"{answer.get('error_message') or 'refused'} ({self.url}{path})")
        return answer

    def unload_adapter(self, name: str, *, timeout_s: float = 30.0) -> None:
        """Unload `name` (`/unload_lora_adapter`). On a real SGLang server the name is retired in this client
        first (`RetiredAdapters`): from then on a request naming it is refused as an unknown adapter; then
        this client waits until none of its requests in flight uses it (drained), and only then asks SGLang,
        whose unload waits without a timeout for the adapter's requests while holding its LoRA lock.

        Raises:
            EngineError: unknown name, or the server's refusal.
            EngineUnavailable: not drained, or no answer, within `timeout_s` (SGLang's unload hangs after
                requests with n > 1 or aborted ones, sglang#36894 / #34205, which this client never sends);
                a name not drained stays retired here and loaded there, for a later retire.
        """
        deadline = time.monotonic() + timeout_s
        if self.dialect.guards_retired:
            self._draining.add(name)  # listed until SGLang has unloaded it: not a revived name meanwhile
            self._retired.retire(name)
            if self.retire == "unload" and (left := self._requests.wait_drained(name, deadline)):
                raise EngineUnavailable(
                    f"{self.url}: {left} request(s) of this client still use {name!r} after {timeout_s:g} s; "
                    "not unloaded yet (SGLang's unload would wait for them under its LoRA lock)"
                )
        if self.retire == "keep":  # SGLang 0.5.17's unload can hang under traffic (docs/HOTSWAP.md)
            if name not in self._listed_raw():
                raise EngineError(f"{self.url}: LoRA adapter {name!r} is not loaded")
            self._kept.add(name)
            self._draining.discard(name)
            return
        self.update("/unload_lora_adapter", {"lora_name": name}, max(deadline - time.monotonic(), 1.0))
        self._draining.discard(name)

    def _listed_raw(self) -> dict[str, dict[str, Any]]:
        return adapters_from_models(self._models())

    def list_adapters(self) -> dict[str, dict[str, Any]]:
        """Adapters from `/v1/models` (cards with a `parent`): name -> {path, version, in_flight, and any of
        sha256, pinned, resident the server reports}. Where the server reports no `in_flight` (SGLang), it is
        this client's own requests in flight naming the adapter, so `retire_stale` keeps those versions.
        With `retire="keep"`, versions retired in this client are left out though the server keeps them."""
        adapters = {n: a for n, a in self._listed_raw().items() if n not in self._kept}
        back = self._retired.revived_in(set(adapters) - self._draining) if self.dialect.guards_retired else []
        if back:
            log.warning("%s lists retired adapters again (reloaded by a request naming them): %s", self.url, back)
        held = self._requests.held()
        for name, info in adapters.items():  # SGLang reports no in-flight counts: this client's own ones
            info.setdefault("in_flight", held.get(name, 0))
        return adapters
