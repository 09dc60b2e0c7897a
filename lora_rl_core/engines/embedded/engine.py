"""In-process engine: transformers generation with PEFT multi-adapter batches, behind SGLang's LoRA semantics.

One background worker thread runs the forward passes. Callers `submit` requests (futures) or `generate`
a list and wait with a deadline; the worker forms forward batches (`scheduler.form_batch`): equal
sampling params, at most `max_batch_size` sequences and `max_loras_per_batch` distinct adapters (the
base model counted). PEFT routes each row through its own LoRA weights (`adapter_names=`).

Adapters (`pool.py`) load from tensors (the colocated trainer), a PEFT folder / fsspec URI, or a store
version, always under a new versioned name; `max_loaded_loras` caps resident (injected) adapters with
`lru`/`fifo` eviction, pinned ones stay. A request whose adapter is `store://RUN@7` (or `store://RUN@latest`,
`store://RUN-v000007`) loads that version from the engine's `store` on first use, under `RUN-v000007`.

Semantics chosen here (SGLang: `sglang/srt/managers/scheduler.py`, `managers/tokenizer_manager.py`,
`lora/lora_registry.py`):

* Admission = the request's batch is formed. Its adapter must still be registered then (else the request
  ends aborted, `adapter_unloaded`); its usage count is taken then and released exactly once when the
  batch ends, whatever way the request ended. The completion records the adapter version admitted.
* A request naming an adapter that is not registered fails at submit with SGLang's message; it never
  falls back to the base model.
* Deadlines: `generate(timeout_s=)` (default `default_timeout_s`) returns requests still unfinished as
  aborted with `abort_reason="timeout"`, never raising for a timeout; `load_adapter` waits at most
  `timeout_s` for the running batch; `unload_adapter` waits at most `timeout_s` for holders, then raises.
* Abort: a queued request ends at once. A request in the running forward batch also ends at once for its
  caller (`finish_reason="abort"`), but HF `generate` can't be interrupted: the batch runs to its end,
  that request's tokens are dropped, and its adapter usage is released then.
* `pause("abort")` aborts queued and running requests (`abort_reason="paused"`) and admits nothing until
  `resume`. `pause("retract")` admits nothing; queued requests stay queued and run after `resume`; a
  running batch finishes. `pause("in_place")` is the same as `retract` here (there is no KV cache to keep).
  Requests submitted while paused are queued; their deadline still runs.
* Model changes (inject, evict, delete) and forward passes share one model lock; the registry and the
  queue share one condition. Waiting for holders (unload) holds neither, so loads go on meanwhile.

Layout: this module is the request lifecycle (public API, deadlines, pause, the worker thread);
`requests.py` the queue, admission, usage counts, abort and futures; `peft_model.py` the model (inject,
evict, delete adapters, forward batches, completions and logprobs); `adapters/` the file reading and
validation. Retiring stale versions is the subscriber's job (`subscriber.retire_stale`), not the engine's.

Generation itself (`generation.py`) samples by inverse CDF and prefills a prompt repeated in one batch
(GRPO's group, SGLang's `n`) once. Left out: continuous batching (a batch runs to its end), streaming, a
prefix cache across batches, and SGLang's tensor wire format for `load_lora_adapter_from_tensors` (the
HTTP server's job).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import weakref
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from lora_rl_core.adapters import STORE_URI_PREFIX, adapter_run, adapter_version, check_adapter_name
from lora_rl_core.config import ENGINE_DEFAULTS, EvictionPolicy
from lora_rl_core.engines.base import ABORT_REASONS, PAUSE_MODES, Completion, GenerationRequest
from lora_rl_core.engines.embedded.peft_model import PeftAdapterModel, adapter_loader
from lora_rl_core.engines.embedded.pool import AdapterPool
from lora_rl_core.engines.embedded.requests import Job, RequestQueue, check_request
from lora_rl_core.errors import EngineError, StoreError

log = logging.getLogger(__name__)

_IDLE_WAIT_S = 0.2  # how often an idle worker wakes to check for shutdown and free unloaded adapters


class EmbeddedEngine:
    """Batched sampling with per-request adapters on one in-process model; SGLang's LoRA semantics.

    Args:
        model: the base causal LM (not a PeftModel); the engine wraps it.
        tokenizer: its tokenizer (pad and EOS ids are read from it).
        max_batch_size: sequences per forward batch.
        max_loras_per_batch: distinct adapters per forward batch, the base model counted
            (SGLang `--max-loras-per-batch`); also caps pinned adapters at this minus one.
        max_loaded_loras: cap on resident (injected) adapters, None = no cap (SGLang `--max-loaded-loras`).
        eviction_policy: `lru` or `fifo` (SGLang `--lora-eviction-policy`).
        max_lora_rank: reject adapters of a larger rank (SGLang `--max-lora-rank`); None = any.
        store: an `AdapterStore` for `store://` adapter names and paths.
        default_timeout_s: deadline (s) of `generate` and of `load_adapter`'s wait for the running batch.

    Raises:
        ValueError: a limit below 1 or an unknown eviction policy.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        *,
        max_batch_size: int = ENGINE_DEFAULTS.max_batch_size,
        max_loras_per_batch: int = ENGINE_DEFAULTS.max_loras_per_batch,
        max_loaded_loras: int | None = ENGINE_DEFAULTS.max_loaded_loras,
        eviction_policy: EvictionPolicy = ENGINE_DEFAULTS.eviction_policy,
        max_lora_rank: int | None = ENGINE_DEFAULTS.max_lora_rank,
        store: Any = None,
        default_timeout_s: float = ENGINE_DEFAULTS.timeout_s,
    ) -> None:
        if min(max_batch_size, max_loras_per_batch) < 1:
            raise ValueError("max_batch_size and max_loras_per_batch must be >= 1")
        self._store = store
        self._timeout = default_timeout_s
        self._pool = AdapterPool(
            max_loaded=max_loaded_loras, policy=eviction_policy, max_pinned=max_loras_per_batch - 1
        )
        self._model = PeftAdapterModel(model, tokenizer, self._pool, max_lora_rank=max_lora_rank)
        self._requests = RequestQueue(
            self._pool, max_batch_size=max_batch_size, max_loras_per_batch=max_loras_per_batch
        )
        self._cond = self._pool.cond  # one condition for registry, queue and flags
        self._stop = threading.Event()
        _warm_up_intra_op_pool()
        self._worker = threading.Thread(
            target=_worker_main, args=(weakref.ref(self), self._stop), name="embedded-engine", daemon=True
        )
        self._worker.start()

    # ---------------------------------------------------------------- lifecycle
    def __enter__(self) -> EmbeddedEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        stop = getattr(self, "_stop", None)
        if stop is not None:
            stop.set()

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the worker: queued and running requests end aborted (`engine_closed`); later calls fail.
        Joins the worker for at most `timeout_s` seconds (a running batch finishes first)."""
        with self._cond:
            self._requests.closed = True
            self._requests.abort_all("engine_closed")
            self._cond.notify_all()
        self._stop.set()
        if threading.current_thread() is not self._worker:
            self._worker.join(timeout_s)

    def members(self) -> list[EmbeddedEngine]:
        """`[self]`: a single engine (`ServingEngine.members`)."""
        return [self]

    # ----------------------------------------------------------------- adapters
    def load_adapter(
        self,
        name: str,
        *,
        path: str | None = None,
        tensors: dict[str, torch.Tensor] | None = None,
        config: dict[str, Any] | None = None,
        pinned: bool = False,
        timeout_s: float | None = None,
    ) -> None:
        """Load a LoRA adapter under a new `name` and make it resident (SGLang `/load_lora_adapter`).

        Args:
            name: adapter name, usually `<run>-v<NNNNNN>`; must not be loaded already (no upsert).
            path: a local PEFT folder or fsspec URI with `adapter_config.json` and `adapter_model.safetensors`,
                a store version folder URI (`AdapterRef.uri`), or `store://RUN@VERSION` (needs `store`); or else
            tensors, config: PEFT state dict (as `get_peft_model_state_dict` gives) and config dict. The engine
                keeps these CPU tensors to re-inject the adapter after eviction: don't modify them.
            pinned: never evict it (at most `max_loras_per_batch - 1` pinned).
            timeout_s: how long to wait for a running forward batch (default `default_timeout_s`).
                Never waits on an unload in progress.

        Raises:
            EngineError: bad or duplicate name, missing files, a pickle checkpoint, rank above `max_lora_rank`,
                unknown target modules, non-finite weights, shape/key mismatch, pinned cap, full pool, or timeout.
                The adapters already loaded keep serving (a load may evict some by policy; they stay known).
        """
        name = _checked_name(name)
        self._pool.check_new(name, pinned=pinned)  # fail fast, before reading files
        loader, source = adapter_loader(name, path, tensors, config, self._store)
        tensors, config = loader()
        self._model.validate(name, tensors, config)
        timeout = self._timeout if timeout_s is None else timeout_s
        with self._model.locked(timeout, f"load_adapter({name!r})"):
            self._pool.check_new(name, pinned=pinned)
            seconds = self._model.add(name, tensors, config)
            self._pool.register(
                name, source=source, loader=loader, pinned=pinned, version=adapter_version(name), load_seconds=seconds
            )

    def unload_adapter(self, name: str, *, timeout_s: float = 30.0) -> None:
        """Unload `name` (SGLang `/unload_lora_adapter`): unregister it at once, so new requests for it fail
        as unknown, then wait until no admitted request holds it and free it.

        Args:
            timeout_s: how long to wait for the requests holding it (seconds).

        Raises:
            EngineError: `name` is not loaded; or requests still hold it at the deadline: the message lists
                their ids. It then stays unregistered and is freed when they end (never re-registered).
        """
        deadline = time.monotonic() + timeout_s
        with self._cond:
            self._pool.unregister(name)
            self._requests.counters["unloads"] += 1
            if not self._pool.wait_unused(name, timeout_s):
                holders = self._pool.holders(name)
                raise EngineError(
                    f"unload_adapter({name!r}): {len(holders)} requests still hold it after {timeout_s:g} s: "
                    f"{holders}; it is unregistered and will be freed when they end"
                )
        self._model.reap(deadline - time.monotonic())

    def list_adapters(self) -> dict[str, dict[str, Any]]:
        """Loaded adapters: name -> {version, source, loaded_at (unix s), in_flight, pinned, resident}.

        `in_flight` counts running and queued requests (SGLang counts a request from its arrival), so a
        subscriber never retires a version that queued requests still name.
        """
        with self._cond:
            return _adapter_list(self._pool, self._requests)

    # ----------------------------------------------------------------- requests
    def submit(self, request: GenerationRequest) -> Future[Completion]:
        """Queue one request (SGLang `/generate`); the future resolves to its Completion, or to an EngineError
        if its forward pass failed. `future.cancel()` works while it is queued; see also `abort`.

        Raises:
            EngineError: unknown adapter (SGLang's message), unreadable `store://` adapter, empty prompt,
                duplicate request id, or the engine is closed.
        """
        return self._requests.enqueue([self._prepare(request)])[0].future

    def generate(
        self, requests: list[GenerationRequest], *, timeout_s: float | None = None, inline: bool = False
    ) -> list[Completion]:
        """Complete every request with its named adapter; order is preserved.

        Args:
            requests: the requests; all are checked before any is queued.
            timeout_s: deadline for the whole call (default `default_timeout_s`). Requests unfinished then
                are aborted and returned with `finish_reason="abort"`, `abort_reason="timeout"`.
            inline: run this call's batches on the calling thread instead of the worker (same admission,
                usage counting, pause and abort rules; the deadline is checked between batches). For a
                single synchronous caller that also trains: torch's OpenMP pool runs ~40 % slower on CPU
                when two threads take turns with it (measured: 64 x 48 tokens, 7.4 s vs 10.5 s).

        Raises:
            EngineError: as `submit` (nothing is queued then), or a forward pass failed.
        """
        deadline = time.monotonic() + (self._timeout if timeout_s is None else timeout_s)
        jobs = [self._prepare(r) for r in requests]
        owner = threading.get_ident() if inline else None
        for job in jobs:
            job.owner = owner
        self._requests.enqueue(jobs)
        if inline:
            self._drive(jobs, deadline, owner)
        _, late = wait_futures([j.future for j in jobs], timeout=max(0.0, deadline - time.monotonic()))
        for job in jobs:
            if job.future in late:
                self.abort(job.rid, reason="timeout")
        return [j.future.result(timeout=_IDLE_WAIT_S) for j in jobs]

    def abort(self, request_id: str | None = None, *, reason: str = "aborted") -> int:
        """Abort one request by id, or every queued and running request when None (SGLang `/abort_request`).

        Its future resolves at once to a Completion with `finish_reason="abort"` and `abort_reason=reason`.
        A request in the running forward batch can't be stopped: that batch finishes, the request's tokens
        are dropped, and its adapter usage is released when the batch ends.

        Args:
            request_id: the request to abort; None = all.
            reason: one of `ABORT_REASONS` (the engine itself uses `timeout`, `paused`, ...).

        Returns:
            How many requests were aborted (0 for an unknown or finished id).

        Raises:
            EngineError: `reason` is not one of `ABORT_REASONS`.
        """
        if reason not in ABORT_REASONS:
            raise EngineError(f"abort reason {reason!r} is not one of {ABORT_REASONS}")
        return self._requests.abort_ids(request_id, reason)

    def _prepare(self, request: GenerationRequest) -> Job:
        """Check one request and resolve a `store://` adapter to its versioned name (loading it if new)."""
        check_request(request)
        if request.adapter is not None and request.adapter.startswith(STORE_URI_PREFIX):
            request = dataclasses.replace(request, adapter=self._auto_load(request.adapter))
        return Job(request)

    def _auto_load(self, uri: str) -> str:
        """Load the store version `uri` names (first use) and return its versioned adapter name."""
        if self._store is None:
            raise EngineError(f"adapter {uri!r}: store URIs need EmbeddedEngine(store=AdapterStore(...))")
        try:
            ref = self._store.resolve(uri.removeprefix(STORE_URI_PREFIX))
        except StoreError as exc:
            raise EngineError(f"adapter {uri!r}: {exc}") from None
        if self._pool.get(ref.name) is None:
            try:
                self.load_adapter(ref.name, path=f"{STORE_URI_PREFIX}{ref.run_id}@{ref.version}")
            except EngineError:
                if self._pool.get(ref.name) is None:  # else another caller loaded it first
                    raise
        return ref.name

    # ------------------------------------------------------------------ control
    def pause(self, mode: str = "in_place") -> None:
        """Stop admitting requests (SGLang `/pause_generation`); `mode` is `abort`, `retract` or `in_place`
        (see the module docstring). Returns at once; a running batch finishes.

        Raises:
            EngineError: unknown mode.
        """
        if mode not in PAUSE_MODES:
            raise EngineError(f"pause mode {mode!r} is not one of {PAUSE_MODES}")
        with self._cond:
            self._requests.paused = True
            if mode == "abort":
                self._requests.abort_all("paused")
            self._cond.notify_all()

    def resume(self) -> None:
        """Admit requests again (SGLang `/continue_generation`); queued requests run in order."""
        with self._cond:
            self._requests.paused = False
            self._cond.notify_all()

    def flush_cache(self) -> bool:
        """No-op (this engine keeps no KV or prefix cache between batches); returns True."""
        return True

    def is_paused(self) -> bool:
        """Whether generation is paused (`pause` without `resume` since)."""
        with self._cond:
            return self._requests.paused

    def health(self) -> dict[str, Any]:
        """`{"ok", "paused", "closed", "worker_alive", "adapters", "resident", "queue_depth", "running"}`;
        ok = the worker is alive and the engine not closed."""
        with self._cond:
            return _health(self._pool, self._requests, self._worker.is_alive())

    def metrics(self) -> dict[str, Any]:
        """Counters and gauges as plain values (ready for Prometheus labels).

        Returns:
            `adapters`: name -> {version, pinned, resident, in_flight, requests, tokens (completion tokens),
            loads (injections), evictions, load_seconds_last, load_seconds_total}; `base`: {requests, tokens};
            `active_versions`: run -> newest loaded version; `unloading`: name -> request ids holding it;
            `aborted`: reason -> count; `queue_depth`, `running`, `batches`, `unloads`, `resident`, `paused`.
        """
        with self._cond:
            return _metrics(self._pool, self._requests)

    # ------------------------------------------------------------------- worker
    def _drive(self, jobs: list[Job], deadline: float, owner: int | None) -> None:
        """Run `owner`'s queued jobs on the calling thread until they end or the deadline passes."""
        while not all(j.future.done() for j in jobs) and time.monotonic() < deadline:
            with self._cond:
                batch = self._requests.admit(owner) if self._requests.ready(owner) else []
                if not batch:
                    self._cond.wait(min(_IDLE_WAIT_S, max(0.0, deadline - time.monotonic())))
                    continue
            self._run_batch(batch)

    def _step(self) -> bool:
        """One worker turn: wait briefly for work, admit a batch and run it. False once closed."""
        with self._cond:
            if not self._requests.ready():
                self._cond.wait(_IDLE_WAIT_S)
            if self._requests.closed:
                return False
            jobs = self._requests.admit() if self._requests.ready() else []
        if jobs:
            self._run_batch(jobs)
        elif self._pool.reapable():
            self._model.reap(0.0)
        return True

    def _run_batch(self, jobs: list[Job]) -> None:
        """Run one admitted batch; every job ends (completion or error) and is released exactly once."""
        results: dict[str, Completion | BaseException] = {}
        try:
            outs = self._model.run([j.request for j in jobs], [j.version for j in jobs], self._timeout)
            results = {j.rid: out for j, out in zip(jobs, outs, strict=True)}
        except Exception as exc:
            log.exception("embedded engine: forward batch failed")
            error = EngineError(f"generation failed: {type(exc).__name__}: {exc}")
            results = {j.rid: error for j in jobs}
        finally:
            self._requests.release(jobs, results)
            for job in jobs:
                self._requests.resolve(job, results.get(job.rid, EngineError("generation was interrupted")))


def _worker_main(engine_ref: weakref.ref, stop: threading.Event) -> None:
    """The worker loop. Holds the engine only weakly between turns, so a dropped engine is collected."""
    while not stop.is_set():
        engine = engine_ref()
        if engine is None:
            return
        try:
            if not engine._step():
                return
        except Exception:  # never let the worker die: requests would wait until their deadlines
            log.exception("embedded engine worker: unexpected error")
            stop.wait(_IDLE_WAIT_S)
        finally:
            del engine


def _warm_up_intra_op_pool() -> None:
    """Enter torch's OpenMP pool once from the constructing thread before the worker starts.

    Measured on a loaded 2-core CPU host (torch 2.13, OpenMP): when the worker is the first thread to
    run parallel regions, each one is slow (a tiny model's SDPA: 8 ms instead of 0.02 ms per call) until
    the thread that built the engine runs one; OMP_WAIT_POLICY=PASSIVE also cures it, so it is OpenMP
    spin-waiting under CPU oversubscription. One tiny parallel op here avoids it (< 1 ms).
    """
    torch.ones(1 << 16).sum()


# ------------------------------------------------------------------- reports (condition held)
def _adapter_list(pool: AdapterPool, requests: RequestQueue) -> dict[str, dict[str, Any]]:
    keys = ("version", "source", "loaded_at", "in_flight", "pinned", "resident")
    queued = requests.queued_per_adapter()
    return {
        n: {**{k: info[k] for k in keys}, "in_flight": info["in_flight"] + queued[n]}
        for n, info in pool.snapshot().items()
    }


def _health(pool: AdapterPool, requests: RequestQueue, alive: bool) -> dict[str, Any]:
    return {
        "ok": alive and not requests.closed,
        "paused": requests.paused,
        "closed": requests.closed,
        "worker_alive": alive,
        "adapters": len(pool.registered()),
        "resident": pool.resident_count(),
        "queue_depth": len(requests.queue),
        "running": len(requests.batch),
    }


def _metrics(pool: AdapterPool, requests: RequestQueue) -> dict[str, Any]:
    skip = ("source", "loaded_at")
    adapters = {n: {k: v for k, v in i.items() if k not in skip} for n, i in pool.snapshot().items()}
    c = requests.counters
    return {
        "adapters": adapters,
        "base": {"requests": c["base_requests"], "tokens": c["base_tokens"]},
        "active_versions": _newest_versions(adapters),
        "unloading": {e.name: sorted(e.holders) for e in pool.draining()},
        "aborted": dict(requests.aborted),
        "queue_depth": len(requests.queue),
        "running": len(requests.batch),
        "batches": c["batches"],
        "unloads": c["unloads"],
        "resident": pool.resident_count(),
        "paused": requests.paused,
    }


def _newest_versions(adapters: dict[str, dict[str, Any]]) -> dict[str, int]:
    """Run -> newest version among registered versioned adapters (name -> info with `version`)."""
    out: dict[str, int] = {}
    for name, info in adapters.items():
        run, version = adapter_run(name), info["version"]
        if run is not None and version is not None:
            out[run] = max(out.get(run, version), version)
    return out


def _checked_name(name: str) -> str:
    try:
        return check_adapter_name(name)
    except ValueError as exc:
        raise EngineError(str(exc)) from None
