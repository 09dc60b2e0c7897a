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

Generation itself (`generation.py`) samples by inverse CDF and prefills a prompt repeated in one batch
(GRPO's group, SGLang's `n`) once. Left out: continuous batching (a batch runs to its end), streaming, a
prefix cache across batches, and SGLang's
tensor wire format for `load_lora_adapter_from_tensors` (the HTTP server's job).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import re
import threading
import time
import warnings
import weakref
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import Future, InvalidStateError
from concurrent.futures import wait as wait_futures
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import fsspec
import torch
from peft import LoraConfig, PeftModel, get_peft_model, set_peft_model_state_dict
from safetensors.torch import load as load_safetensors
from torch import nn
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from lora_rl_core.engines.base import (
    ABORT_REASONS,
    PAUSE_MODES,
    STORE_URI_PREFIX,
    Completion,
    GenerationRequest,
    adapter_run,
    adapter_version,
    check_adapter_name,
    unknown_adapter_message,
)
from lora_rl_core.engines.generation import BASE_ADAPTER, generate_batch
from lora_rl_core.engines.pool import AdapterPool
from lora_rl_core.engines.scheduler import BatchLimits, form_batch
from lora_rl_core.errors import EngineError, StoreError

log = logging.getLogger(__name__)

_IDLE_WAIT_S = 0.2  # how often an idle worker wakes to check for shutdown and free unloaded adapters
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")
_STORE_VERSION_DIR = re.compile(r"^(?P<root>.+)/(?P<run>[^/]+)/adapters/v(?P<version>\d{6,})$")

TensorsAndConfig = tuple[dict[str, torch.Tensor], dict[str, Any]]


@dataclass(eq=False)
class _Job:
    """One submitted request on its way through the engine."""

    request: GenerationRequest
    future: Future = field(default_factory=Future)
    version: int | None = None  # adapter version at admission
    held: bool = False  # counted in the pool's usage of its adapter
    owner: int | None = None  # thread that runs it (`generate(inline=True)`); None = the worker

    @property
    def rid(self) -> str:
        return self.request.request_id

    @property
    def adapter(self) -> str | None:
        return self.request.adapter


class EmbeddedEngine:
    """Batched sampling with per-request adapters on one in-process model; SGLang's LoRA semantics.

    Args:
        model: the base causal LM (not a PeftModel); the engine wraps it.
        tokenizer: its tokenizer (pad and EOS ids are read from it).
        max_batch_size: sequences per forward batch.
        keep_versions: versions of a run that `retire_stale` keeps loaded (`max_staleness + 1`).
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
        max_batch_size: int = 64,
        keep_versions: int = 2,
        max_loras_per_batch: int = 8,
        max_loaded_loras: int | None = None,
        eviction_policy: str = "lru",
        max_lora_rank: int | None = None,
        store: Any = None,
        default_timeout_s: float = 600.0,
    ) -> None:
        if min(max_batch_size, keep_versions, max_loras_per_batch) < 1:
            raise ValueError("max_batch_size, keep_versions and max_loras_per_batch must be >= 1")
        self._model: PreTrainedModel | PeftModel = model
        self._tokenizer = tokenizer
        self._eos_ids = _eos_ids(model, tokenizer)
        self._modules = _adaptable_modules(model)
        self._limits_cfg = (max_batch_size, max_loras_per_batch)
        self._keep = keep_versions
        self._max_rank = max_lora_rank
        self._store = store
        self._timeout = default_timeout_s
        self._pool = AdapterPool(
            max_loaded=max_loaded_loras, policy=eviction_policy, max_pinned=max_loras_per_batch - 1
        )
        self._cond = self._pool.cond  # one condition for registry, queue and flags
        self._model_lock = threading.Lock()  # forward passes and model changes
        self._queue: list[_Job] = []
        self._jobs: dict[str, _Job] = {}  # queued or running, until resolved
        self._batch: list[_Job] = []  # admitted, usage held, until the batch ends (aborted ones too)
        self._paused = False
        self._closed = False
        self._counters: Counter[str] = Counter()
        self._aborted: Counter[str] = Counter()
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
            self._closed = True
            self._abort_all("engine_closed")
            self._cond.notify_all()
        self._stop.set()
        if threading.current_thread() is not self._worker:
            self._worker.join(timeout_s)

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
        loader, source = self._loader(name, path, tensors, config)
        tensors, config = loader()
        self._validate(name, tensors, config)
        timeout = self._timeout if timeout_s is None else timeout_s
        with self._model_locked(timeout, f"load_adapter({name!r})"):
            self._pool.check_new(name, pinned=pinned)
            seconds = self._inject_with_room(name, tensors, config, keep=())
            self._pool.register(
                name, source=source, loader=loader, pinned=pinned, version=adapter_version(name), load_seconds=seconds
            )

    def _loader(
        self, name: str, path: str | None, tensors: dict | None, config: dict | None
    ) -> tuple[Callable[[], TensorsAndConfig], str]:
        """A function that (re)reads the adapter's weights and config, and a description of the source."""
        if path is not None and path.startswith(STORE_URI_PREFIX):
            return functools.partial(_read_store, self._store, path), path
        if path is not None:
            return functools.partial(read_adapter_folder, path), path
        if tensors is None or config is None:
            raise EngineError(f"load_adapter({name!r}) needs path=, or tensors= and config=")
        return (lambda: (tensors, config)), "tensors"

    def _validate(self, name: str, tensors: dict[str, torch.Tensor], config: dict[str, Any]) -> None:
        """Checks that need no model change: finite weights, LoRA config, rank, target modules."""
        _check_finite(name, tensors)
        lora_config = _lora_config(name, config)
        _check_rank(name, lora_config, self._max_rank)
        _check_targets(name, lora_config, self._modules)

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
            self._counters["unloads"] += 1
            if not self._pool.wait_unused(name, timeout_s):
                holders = self._pool.holders(name)
                raise EngineError(
                    f"unload_adapter({name!r}): {len(holders)} requests still hold it after {timeout_s:g} s: "
                    f"{holders}; it is unregistered and will be freed when they end"
                )
        self._reap(deadline - time.monotonic())

    def retire_stale(self, run_id: str, *, active: str) -> list[str]:
        """Unload `run_id`'s versions older than the newest `keep_versions`, except `active` and any that a
        queued or running request uses. Does nothing while paused (DESIGN.md: never unload while paused).

        Returns:
            The names unloaded, oldest first.
        """
        with self._cond:
            if self._paused:
                return []
            stale = self._stale(run_id, active)
            for name in stale:
                self._pool.unregister(name)
            self._counters["unloads"] += len(stale)
        self._reap(0.0)  # the worker frees them if a batch is running now
        return stale

    def _stale(self, run_id: str, active: str) -> list[str]:
        mine = sorted((e for e in self._pool.registered() if adapter_run(e.name) == run_id), key=lambda e: e.version)
        queued = {j.adapter for j in self._queue}
        old = mine[: max(0, len(mine) - self._keep)]
        return [e.name for e in old if e.name != active and not e.holders and e.name not in queued]

    def list_adapters(self) -> dict[str, dict[str, Any]]:
        """Loaded adapters: name -> {version, source, loaded_at (unix s), in_flight, pinned, resident}.

        `in_flight` counts running and queued requests (SGLang counts a request from its arrival), so a
        subscriber never retires a version that queued requests still name.
        """
        keys = ("version", "source", "loaded_at", "in_flight", "pinned", "resident")
        with self._cond:
            queued = Counter(j.adapter for j in self._queue)
            snapshot = self._pool.snapshot()
        return {
            n: {**{k: info[k] for k in keys}, "in_flight": info["in_flight"] + queued[n]}
            for n, info in snapshot.items()
        }

    # ----------------------------------------------------------------- requests
    def submit(self, request: GenerationRequest) -> Future[Completion]:
        """Queue one request (SGLang `/generate`); the future resolves to its Completion, or to an EngineError
        if its forward pass failed. `future.cancel()` works while it is queued; see also `abort`.

        Raises:
            EngineError: unknown adapter (SGLang's message), unreadable `store://` adapter, empty prompt,
                duplicate request id, or the engine is closed.
        """
        return self._enqueue([self._prepare(request)])[0].future

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
        self._enqueue(jobs)
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
        with self._cond:
            job = self._jobs.get(request_id) if request_id is not None else None
            jobs = list(self._jobs.values()) if request_id is None else [job] if job else []
            for j in jobs:
                self._abort(j, reason)
            self._cond.notify_all()
            return len(jobs)

    def _prepare(self, request: GenerationRequest) -> _Job:
        """Check one request and resolve a `store://` adapter to its versioned name (loading it if new)."""
        if not request.prompt_ids:
            raise EngineError(f"request {request.request_id}: empty prompt")
        if request.sampling.max_new_tokens < 1:
            raise EngineError(f"request {request.request_id}: max_new_tokens must be >= 1")
        if request.adapter is not None and request.adapter.startswith(STORE_URI_PREFIX):
            request = dataclasses.replace(request, adapter=self._auto_load(request.adapter))
        return _Job(request)

    def _auto_load(self, uri: str) -> str:
        """Load the store version `uri` names (first use) and return its versioned adapter name."""
        if self._store is None:
            raise EngineError(f"adapter {uri!r}: store URIs need EmbeddedEngine(store=AdapterStore(...))")
        try:
            ref = self._store.resolve(uri[len(STORE_URI_PREFIX) :])
        except StoreError as exc:
            raise EngineError(f"adapter {uri!r}: {exc}") from None
        if self._pool.get(ref.name) is None:
            try:
                self.load_adapter(ref.name, path=f"{STORE_URI_PREFIX}{ref.run_id}@{ref.version}")
            except EngineError:
                if self._pool.get(ref.name) is None:  # else another caller loaded it first
                    raise
        return ref.name

    def _enqueue(self, jobs: list[_Job]) -> list[_Job]:
        with self._cond:
            self._check_admissible(jobs)
            for job in jobs:
                self._jobs[job.rid] = job
            self._queue.extend(jobs)
            self._cond.notify_all()
        return jobs

    def _check_admissible(self, jobs: list[_Job]) -> None:
        if self._closed:
            raise EngineError("engine is closed")
        for job in jobs:
            if job.adapter is not None and self._pool.get(job.adapter) is None:
                raise EngineError(unknown_adapter_message(job.adapter, [e.name for e in self._pool.registered()]))
        counts = Counter(j.rid for j in jobs)
        running = {j.rid for j in self._batch}  # an aborted request keeps its id until its batch ends
        dup = sorted(rid for rid in counts if counts[rid] > 1 or rid in self._jobs or rid in running)
        if dup:
            raise EngineError(f"duplicate request ids (each request needs its own): {dup[:5]}")

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
            self._paused = True
            if mode == "abort":
                self._abort_all("paused")
            self._cond.notify_all()

    def resume(self) -> None:
        """Admit requests again (SGLang `/continue_generation`); queued requests run in order."""
        with self._cond:
            self._paused = False
            self._cond.notify_all()

    def flush_cache(self) -> bool:
        """No-op (this engine keeps no KV or prefix cache between batches); returns True."""
        return True

    def health(self) -> dict[str, Any]:
        """`{"ok", "paused", "closed", "worker_alive", "adapters", "resident", "queue_depth", "running"}`;
        ok = the worker is alive and the engine not closed."""
        with self._cond:
            alive = self._worker.is_alive()
            return {
                "ok": alive and not self._closed,
                "paused": self._paused,
                "closed": self._closed,
                "worker_alive": alive,
                "adapters": len(self._pool.registered()),
                "resident": self._pool.resident_count(),
                "queue_depth": len(self._queue),
                "running": len(self._batch),
            }

    def metrics(self) -> dict[str, Any]:
        """Counters and gauges as plain values (ready for Prometheus labels).

        Returns:
            `adapters`: name -> {version, pinned, resident, in_flight, requests, tokens (completion tokens),
            loads (injections), evictions, load_seconds_last, load_seconds_total}; `base`: {requests, tokens};
            `active_versions`: run -> newest loaded version; `unloading`: name -> request ids holding it;
            `aborted`: reason -> count; `queue_depth`, `running`, `batches`, `unloads`, `resident`, `paused`.
        """
        skip = ("source", "loaded_at")
        with self._cond:
            adapters = {n: {k: v for k, v in i.items() if k not in skip} for n, i in self._pool.snapshot().items()}
            c = self._counters
            return {
                "adapters": adapters,
                "base": {"requests": c["base_requests"], "tokens": c["base_tokens"]},
                "active_versions": self._active_versions(),
                "unloading": {e.name: sorted(e.holders) for e in self._pool.draining()},
                "aborted": dict(self._aborted),
                "queue_depth": len(self._queue),
                "running": len(self._batch),
                "batches": c["batches"],
                "unloads": c["unloads"],
                "resident": self._pool.resident_count(),
                "paused": self._paused,
            }

    def _active_versions(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for e in self._pool.registered():
            run = adapter_run(e.name)
            if run is not None and e.version is not None:
                out[run] = max(out.get(run, e.version), e.version)
        return out

    def _drive(self, jobs: list[_Job], deadline: float, owner: int | None) -> None:
        """Run `owner`'s queued jobs on the calling thread until they end or the deadline passes."""
        while not all(j.future.done() for j in jobs) and time.monotonic() < deadline:
            with self._cond:
                batch = self._admit(owner) if self._ready(owner) else []
                if not batch:
                    self._cond.wait(min(_IDLE_WAIT_S, max(0.0, deadline - time.monotonic())))
                    continue
            self._run_batch(batch)

    # ------------------------------------------------------------------- worker
    def _step(self) -> bool:
        """One worker turn: wait briefly for work, admit a batch and run it. False once closed."""
        with self._cond:
            if not self._ready():
                self._cond.wait(_IDLE_WAIT_S)
            if self._closed:
                return False
            jobs = self._admit() if self._ready() else []
        if jobs:
            self._run_batch(jobs)
        elif self._pool.reapable():
            self._reap(0.0)
        return True

    def _ready(self, owner: int | None = None) -> bool:
        return not self._paused and any(j.owner == owner for j in self._queue)

    def _admit(self, owner: int | None = None) -> list[_Job]:
        """Take the next batch of `owner`'s jobs off the queue and admit its requests (condition held)."""
        for job in [j for j in self._queue if j.future.cancelled()]:
            self._jobs.pop(job.rid, None)
        self._queue = [j for j in self._queue if not j.future.cancelled()]
        mine = [j for j in self._queue if j.owner == owner]
        chosen = [mine[i] for i in form_batch([(j.adapter, j.request.sampling) for j in mine], self._batch_limits())]
        taken = {id(j) for j in chosen}
        self._queue = [j for j in self._queue if id(j) not in taken]
        admitted = [j for j in chosen if self._start(j)]
        self._batch.extend(admitted)
        return admitted

    def _batch_limits(self) -> BatchLimits:
        pinned = frozenset(e.name for e in self._pool.registered() if e.pinned)
        cap = self._pool.max_loaded
        unpinned = None if cap is None else max(1, cap - len(pinned))
        return BatchLimits(*self._limits_cfg, max_unpinned=unpinned, pinned=pinned)

    def _start(self, job: _Job) -> bool:
        """Admit one job: count its adapter usage and record the version. False if it ended instead."""
        if not job.future.set_running_or_notify_cancel():
            self._jobs.pop(job.rid, None)
            return False
        if job.adapter is None:
            return True
        entry = self._pool.get(job.adapter)
        if entry is None:
            self._abort(job, "adapter_unloaded")
            return False
        self._pool.acquire(job.adapter, job.rid)
        job.version, job.held = entry.version, True
        return True

    def _run_batch(self, jobs: list[_Job]) -> None:
        """Run one admitted batch; every job ends (completion or error) and is released exactly once."""
        results: dict[str, Completion | BaseException] = {}
        try:
            results = self._forward(jobs)
        except Exception as exc:
            log.exception("embedded engine: forward batch failed")
            error = EngineError(f"generation failed: {type(exc).__name__}: {exc}")
            results = {j.rid: error for j in jobs}
        finally:
            self._release(jobs, results)
            for job in jobs:
                self._resolve(job, results.get(job.rid, EngineError("generation was interrupted")))

    @torch.no_grad()
    def _forward(self, jobs: list[_Job]) -> dict[str, Completion | BaseException]:
        """Make the batch's adapters resident and generate (model lock held), then build completions."""
        with self._model_locked(self._timeout, "forward batch"):
            self._reap_locked()
            failed = self._make_resident({j.adapter for j in jobs if j.adapter is not None})
            rows = [j for j in jobs if j.adapter not in failed]
            raw = self._generate_rows([j.request for j in rows]) if rows else None
        results: dict[str, Completion | BaseException] = {j.rid: failed[j.adapter] for j in jobs if j.adapter in failed}
        if raw is not None:
            results.update(self._completions(rows, *raw))
        return results

    def _release(self, jobs: list[_Job], results: dict[str, Completion | BaseException]) -> None:
        """Release each job's adapter usage (once) and count completed tokens."""
        with self._cond:
            for job in jobs:
                if job.held:
                    self._pool.release(job.adapter, job.rid)
                    job.held = False
                out = results.get(job.rid)
                if isinstance(out, Completion) and self._jobs.get(job.rid) is job:
                    self._record(job, out)
            ended = {id(j) for j in jobs}
            self._batch = [j for j in self._batch if id(j) not in ended]
            self._counters["batches"] += 1
            self._cond.notify_all()

    def _record(self, job: _Job, out: Completion) -> None:
        if job.adapter is None:
            self._counters["base_requests"] += 1
            self._counters["base_tokens"] += len(out.completion_ids)
        else:
            self._pool.record(job.adapter, len(out.completion_ids))

    def _abort(self, job: _Job, reason: str) -> None:
        """End `job` as aborted now (condition held); a running batch keeps its usage until it ends."""
        if job in self._queue:
            self._queue.remove(job)
        self._aborted[reason] += 1
        version = job.version if job.version is not None else adapter_version(job.adapter)
        self._resolve(job, _aborted_completion(job.request, version, reason))

    def _abort_all(self, reason: str) -> None:
        for job in list(self._jobs.values()):
            self._abort(job, reason)

    def _resolve(self, job: _Job, value: Completion | BaseException) -> None:
        """Deliver `value` to the job's future once; later calls (or a cancelled future) are no-ops."""
        with self._cond:
            if self._jobs.get(job.rid) is not job:
                return
            del self._jobs[job.rid]
            try:
                if isinstance(value, BaseException):
                    job.future.set_exception(value)
                else:
                    job.future.set_result(value)
            except InvalidStateError:  # cancelled by its caller meanwhile
                pass

    # --------------------------------------------------------------- model ops
    @contextmanager
    def _model_locked(self, timeout_s: float, what: str) -> Iterator[None]:
        if not self._model_lock.acquire(timeout=max(0.0, timeout_s)):
            raise EngineError(f"{what}: timed out after {timeout_s:g} s waiting for the running batch")
        try:
            yield
        finally:
            self._model_lock.release()

    def _make_resident(self, names: set[str]) -> dict[str, EngineError]:
        """Inject the batch's non-resident adapters (model lock held); returns those that failed."""
        failed: dict[str, EngineError] = {}
        for name in sorted(names):
            entry = self._pool.entry(name)
            if entry is None or entry.resident or entry.loader is None:
                continue
            try:
                tensors, config = entry.loader()
                self._validate(name, tensors, config)
                self._pool.mark_resident(name, self._inject_with_room(name, tensors, config, keep=names))
            except EngineError as exc:
                failed[name] = EngineError(f"adapter {name!r} could not be made resident: {exc}")
        return failed

    def _inject_with_room(self, name: str, tensors: dict, config: dict, *, keep: Any) -> float:
        """Evict what the pool policy chooses, inject `name`; returns the injection time (s). Model lock held."""
        self._drop(self._pool.evict_for(1, keep=keep))
        start = time.perf_counter()
        self._inject(name, tensors, config)
        return time.perf_counter() - start

    def _inject(self, name: str, tensors: dict[str, torch.Tensor], config: dict[str, Any]) -> None:
        lora_config = _lora_config(name, config)
        try:
            if isinstance(self._model, PeftModel):
                self._model.add_adapter(name, lora_config)
            else:
                self._model = get_peft_model(self._model, lora_config, adapter_name=name)
            _set_weights(self._model, name, tensors)
        except (RuntimeError, ValueError, KeyError, EngineError) as exc:
            self._drop([name])
            reason = " ".join(line.strip() for line in str(exc).splitlines()[:2])  # torch puts the cause on line 2
            raise EngineError(f"adapter {name!r} rejected: {reason}") from None
        self._model.eval()

    def _drop(self, names: list[str]) -> None:
        """Delete adapters from the model (model lock held) and forget those that are fully unloaded."""
        for name in names:
            if isinstance(self._model, PeftModel) and name in self._model.peft_config:
                self._delete_adapter(name)
            self._pool.forget(name)

    def _delete_adapter(self, name: str) -> None:
        if len(self._model.peft_config) == 1:
            self._model = self._model.unload()  # PEFT keeps at least one adapter: unwrap to the base model
            return
        with warnings.catch_warnings():  # PEFT warns when the "active" adapter goes; we never rely on it
            warnings.simplefilter("ignore", UserWarning)
            self._model.delete_adapter(name)

    def _reap(self, timeout_s: float) -> None:
        """Free unloaded adapters that no request holds, if the model lock comes within `timeout_s`
        (otherwise the worker does it before its next batch)."""
        if self._model_lock.acquire(timeout=max(0.0, timeout_s)):
            try:
                self._reap_locked()
            finally:
                self._model_lock.release()

    def _reap_locked(self) -> None:
        names = self._pool.reapable()
        if names:
            self._drop(names)

    # --------------------------------------------------------------- generation
    def _generate_rows(self, requests: list[GenerationRequest]) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """One generate call over requests with equal sampling params: new tokens `[B, T]` and per-step logits
        (`generation.generate_batch`: inverse-CDF sampling, shared prefill of repeated prompts)."""
        adapters = None
        if isinstance(self._model, PeftModel):
            adapters = [r.adapter or BASE_ADAPTER for r in requests]
        return generate_batch(
            self._model,
            [r.prompt_ids for r in requests],
            adapters,
            requests[0].sampling,
            pad_id=self._tokenizer.pad_token_id,
            eos_ids=self._eos_ids,
        )

    def _completions(
        self, jobs: list[_Job], tokens_BT: torch.Tensor, step_logits: tuple[torch.Tensor, ...]
    ) -> dict[str, Completion]:
        """Completions of one batch from its new tokens `[B, T]` and per-step logits (no lock held)."""
        logprobs_BT = _token_logprobs(step_logits, tokens_BT, jobs[0].request.sampling.temperature)
        return {j.rid: self._completion(j, tokens_BT[i], logprobs_BT[i]) for i, j in enumerate(jobs)}

    def _completion(self, job: _Job, tokens: torch.Tensor, logprobs: torch.Tensor) -> Completion:
        is_eos = torch.isin(tokens, torch.tensor(self._eos_ids))
        stop = int(is_eos.nonzero()[0, 0]) + 1 if bool(is_eos.any()) else None
        n = stop if stop is not None else len(tokens)
        return Completion(
            request_id=job.rid,
            prompt_ids=list(job.request.prompt_ids),
            completion_ids=tokens[:n].tolist(),
            logprobs=logprobs[:n].tolist(),
            finish_reason="stop" if stop is not None else "length",
            adapter=job.adapter,
            adapter_version=job.version,
        )


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


def _aborted_completion(request: GenerationRequest, version: int | None, reason: str) -> Completion:
    return Completion(
        request_id=request.request_id,
        prompt_ids=list(request.prompt_ids),
        completion_ids=[],
        logprobs=[],
        finish_reason="abort",
        adapter=request.adapter,
        adapter_version=version,
        abort_reason=reason,
    )


# ---------------------------------------------------------------------- adapters
def read_adapter_folder(path: str) -> TensorsAndConfig:
    """Read a PEFT adapter folder (local path or fsspec URI): safetensors weights + config. A store version
    folder (`<store>/<run>/adapters/vNNNNNN` with a `manifest.json`, `AdapterRef.uri`) is read through the
    store, sha256-verified.

    Raises:
        EngineError: a file is missing, the config is not JSON, only a pickle checkpoint is offered,
            or a store version fails its checks.
    """
    fs, root = fsspec.core.url_to_fs(path)
    if not fs.exists(f"{root}/adapter_config.json") and fs.exists(f"{root}/manifest.json"):
        return _read_store_version(path)
    if not fs.exists(f"{root}/adapter_model.safetensors"):
        pickles = [f"adapter_model{s}" for s in _PICKLE_SUFFIXES if fs.exists(f"{root}/adapter_model{s}")]
        if pickles:
            raise EngineError(f"{path}: {pickles[0]} is a pickle checkpoint; only safetensors is accepted")
    try:
        config = json.loads(fs.cat_file(f"{root}/adapter_config.json"))
        tensors = load_safetensors(fs.cat_file(f"{root}/adapter_model.safetensors"))
    except FileNotFoundError as exc:
        raise EngineError(
            f"{path}: missing {exc.filename or exc}: "
            "an adapter folder needs adapter_config.json and adapter_model.safetensors"
        ) from None
    except Exception as exc:  # bad JSON; safetensors raises its own error types
        raise EngineError(f"{path}: unreadable adapter: {str(exc).splitlines()[0]}") from None
    return tensors, config


def _read_store_version(path: str) -> TensorsAndConfig:
    """Weights and config of a store version folder URI, through `AdapterStore.load_tensors` (verified)."""
    from lora_rl_core.store import AdapterStore  # lazy: the engine needs no store unless given one

    match = _STORE_VERSION_DIR.match(path.rstrip("/"))
    if match is None:
        raise EngineError(
            f"{path}: has a manifest.json but is not a store version folder <store>/<run>/adapters/vNNNNNN"
        )
    try:
        return AdapterStore(match["root"]).load_tensors(match["run"], int(match["version"]))
    except StoreError as exc:
        raise EngineError(f"{path}: {exc}") from None


def _read_store(store: Any, uri: str) -> TensorsAndConfig:
    """Weights and config of the store version `store://RUN@VERSION` (sha256-verified by the store)."""
    if store is None:
        raise EngineError(f"{uri}: store URIs need EmbeddedEngine(store=AdapterStore(...))")
    try:
        ref = store.resolve(uri[len(STORE_URI_PREFIX) :])
        return store.load_tensors(ref.run_id, ref.version)
    except StoreError as exc:
        raise EngineError(f"{uri}: {exc}") from None


def _checked_name(name: str) -> str:
    try:
        return check_adapter_name(name)
    except ValueError as exc:
        raise EngineError(str(exc)) from None


def _lora_config(name: str, config: dict[str, Any]) -> LoraConfig:
    if config.get("peft_type", "LORA") != "LORA":
        raise EngineError(f"adapter {name!r}: peft_type {config.get('peft_type')!r} is not LORA")
    if config.get("use_dora"):
        raise EngineError(f"adapter {name!r}: DoRA adapters are not supported by mixed-adapter batches")
    fields = set(LoraConfig.__dataclass_fields__)
    clean = {
        k: v for k, v in config.items() if k in fields and k not in {"peft_type", "base_model_name_or_path", "revision"}
    }
    clean.update(inference_mode=True, lora_dropout=0.0)
    try:
        return LoraConfig(**clean)
    except (TypeError, ValueError) as exc:
        raise EngineError(f"adapter {name!r}: bad adapter_config: {exc}") from None


def _check_finite(name: str, tensors: dict[str, torch.Tensor]) -> None:
    for key, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise EngineError(f"adapter {name!r}: {key} is a {type(t).__name__}, not a tensor")
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise EngineError(f"adapter {name!r}: tensor {key} has NaN or Inf values")


def _check_rank(name: str, config: LoraConfig, max_rank: int | None) -> None:
    rank = max([config.r, *(config.rank_pattern or {}).values()])
    if max_rank is not None and rank > max_rank:
        raise EngineError(
            f"adapter {name!r}: LoRA rank {rank} exceeds this engine's max_lora_rank={max_rank} "
            "(SGLang: --max-lora-rank); start the engine with a larger max_lora_rank"
        )


def _check_targets(name: str, config: LoraConfig, modules: list[str]) -> None:
    """Every target module suffix (or the target regex) must match a module of the model."""
    targets = config.target_modules
    if targets is None or targets == "all-linear":
        return
    if isinstance(targets, str):
        missing = [] if any(re.fullmatch(targets, m) for m in modules) else [targets]
    else:
        missing = sorted(t for t in targets if not any(m == t or m.endswith(f".{t}") for m in modules))
    if missing:
        have = sorted({m.rsplit(".", 1)[-1] for m in modules})
        raise EngineError(
            f"adapter {name!r}: target modules {missing} are not in the model (SGLang: --lora-target-modules); "
            f"it has {have}"
        )


def _adaptable_modules(model: nn.Module) -> list[str]:
    """Full names of the modules PEFT LoRA can adapt (linear, embedding, conv)."""
    kinds = (nn.Linear, nn.Embedding, nn.Conv1d, nn.Conv2d)
    return [n for n, m in model.named_modules() if n and (isinstance(m, kinds) or type(m).__name__ == "Conv1D")]


def _set_weights(model: PeftModel, name: str, tensors: dict[str, torch.Tensor]) -> None:
    """Load the adapter's state dict; every key must be used and every LoRA weight of `name` set."""
    result = set_peft_model_state_dict(model, tensors, adapter_name=name)
    missing = [k for k in result.missing_keys if f".{name}." in k or k.endswith(f".{name}")]
    if result.unexpected_keys or missing:
        raise EngineError(
            f"adapter {name!r} does not fit the model: unexpected {result.unexpected_keys[:3]}, missing {missing[:3]}"
        )


def _eos_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    ids = {tokenizer.eos_token_id}
    gen_eos = getattr(model.generation_config, "eos_token_id", None)
    ids.update(gen_eos if isinstance(gen_eos, list) else [gen_eos])
    return sorted(i for i in ids if i is not None)


def _token_logprobs(step_logits: tuple[torch.Tensor, ...], tokens_BT: torch.Tensor, temperature: float) -> torch.Tensor:
    """Log-probs `[B, T]` of the sampled tokens under softmax(logits / temperature); one step at a time
    so the `[B, T, V]` tensor is never built."""
    temp = temperature if temperature > 0 else 1.0
    if not step_logits:
        return torch.empty(tokens_BT.shape, dtype=torch.float32)
    tokens = tokens_BT.to(step_logits[0].device)
    out = torch.empty(tokens.shape, dtype=torch.float32, device=tokens.device)
    for t, logits_BV in enumerate(step_logits):  # on the logits' device: only [B, T] floats cross to the host
        scaled = logits_BV.float() / temp
        out[:, t] = scaled.gather(1, tokens[:, t : t + 1]).squeeze(1) - torch.logsumexp(scaled, dim=-1)
    return out.cpu()
