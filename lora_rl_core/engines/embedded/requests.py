"""Queued and running requests of the embedded engine: admission, adapter usage, abort, futures.

`RequestQueue` is the engine's request state machine. A request is *queued* (submitted, in `queue`),
then *admitted* into a forward batch (`admit`: its adapter must still be registered, its usage is taken
and its adapter version recorded), then *ended* exactly once (`resolve`): completed, failed or aborted.
Its adapter usage is released exactly once, when its batch ends (`release`), whatever way it ended.

All state is guarded by the pool's re-entrant condition (`cond`), shared with the adapter registry;
methods that don't take it themselves say "condition held". The engine (`embedded.py`) owns the worker,
deadlines and pausing; the model (`peft_model.py`) runs the batches.
"""

from __future__ import annotations

from collections import Counter
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field

from lora_rl_core.adapters import adapter_version
from lora_rl_core.engines.base import Completion, GenerationRequest, aborted_completion, unknown_adapter_message
from lora_rl_core.engines.embedded.pool import AdapterPool
from lora_rl_core.engines.embedded.scheduler import BatchLimits, form_batch
from lora_rl_core.errors import EngineError


@dataclass(eq=False)
class Job:
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


class RequestQueue:
    """Queued jobs, the running batch, and the counters of how requests ended.

    Args:
        pool: the engine's adapter pool; its condition guards this queue too.
        max_batch_size: sequences per forward batch.
        max_loras_per_batch: distinct adapters per forward batch, the base model counted.
    """

    def __init__(self, pool: AdapterPool, *, max_batch_size: int, max_loras_per_batch: int) -> None:
        self.cond = pool.cond
        self._pool = pool
        self._limits = (max_batch_size, max_loras_per_batch)
        self.queue: list[Job] = []
        self.jobs: dict[str, Job] = {}  # queued or running, until resolved
        self.batch: list[Job] = []  # admitted, usage held, until the batch ends (aborted ones too)
        self.paused = False
        self.closed = False
        self.counters: Counter[str] = Counter()  # batches, unloads, base_requests, base_tokens
        self.aborted: Counter[str] = Counter()  # abort reason -> count

    # ---------------------------------------------------------------- queueing
    def enqueue(self, jobs: list[Job]) -> list[Job]:
        """Queue `jobs` (all or none) and wake the worker.

        Raises:
            EngineError: the engine is closed, an adapter is not registered (SGLang's message), or a request
                id is repeated or still in use.
        """
        with self.cond:
            self._check_admissible(jobs)
            for job in jobs:
                self.jobs[job.rid] = job
            self.queue.extend(jobs)
            self.cond.notify_all()
        return jobs

    def _check_admissible(self, jobs: list[Job]) -> None:
        if self.closed:
            raise EngineError("engine is closed")
        for job in jobs:
            if job.adapter is not None and self._pool.get(job.adapter) is None:
                raise EngineError(unknown_adapter_message(job.adapter, [e.name for e in self._pool.registered()]))
        counts = Counter(j.rid for j in jobs)
        running = {j.rid for j in self.batch}  # an aborted request keeps its id until its batch ends
        dup = sorted(rid for rid in counts if counts[rid] > 1 or rid in self.jobs or rid in running)
        if dup:
            raise EngineError(f"duplicate request ids (each request needs its own): {dup[:5]}")

    def queued_per_adapter(self) -> Counter[str | None]:
        """Queued requests per adapter name (condition held)."""
        return Counter(j.adapter for j in self.queue)

    # ---------------------------------------------------------------- admission
    def ready(self, owner: int | None = None) -> bool:
        """Whether `owner`'s jobs may form a batch now: not paused and one is queued (condition held)."""
        return not self.paused and any(j.owner == owner for j in self.queue)

    def admit(self, owner: int | None = None) -> list[Job]:
        """Take the next batch of `owner`'s jobs off the queue and admit its requests (condition held)."""
        for job in [j for j in self.queue if j.future.cancelled()]:
            self.jobs.pop(job.rid, None)
        self.queue = [j for j in self.queue if not j.future.cancelled()]
        mine = [j for j in self.queue if j.owner == owner]
        chosen = [mine[i] for i in form_batch([(j.adapter, j.request.sampling) for j in mine], self._batch_limits())]
        taken = {id(j) for j in chosen}
        self.queue = [j for j in self.queue if id(j) not in taken]
        admitted = [j for j in chosen if self._start(j)]
        self.batch.extend(admitted)
        return admitted

    def _batch_limits(self) -> BatchLimits:
        pinned = frozenset(e.name for e in self._pool.registered() if e.pinned)
        cap = self._pool.max_loaded
        unpinned = None if cap is None else max(1, cap - len(pinned))
        return BatchLimits(*self._limits, max_unpinned=unpinned, pinned=pinned)

    def _start(self, job: Job) -> bool:
        """Admit one job: count its adapter usage and record the version. False if it ended instead."""
        if not job.future.set_running_or_notify_cancel():
            self.jobs.pop(job.rid, None)
            return False
        if job.adapter is None:
            return True
        entry = self._pool.get(job.adapter)
        if entry is None:
            self.abort(job, "adapter_unloaded")
            return False
        self._pool.acquire(job.adapter, job.rid)
        job.version, job.held = entry.version, True
        return True

    def release(self, jobs: list[Job], results: dict[str, Completion | BaseException]) -> None:
        """End a batch: release each job's adapter usage (once) and count completed tokens."""
        with self.cond:
            for job in jobs:
                if job.held and job.adapter is not None:
                    self._pool.release(job.adapter, job.rid)
                    job.held = False
                out = results.get(job.rid)
                if isinstance(out, Completion) and self.jobs.get(job.rid) is job:
                    self._record(job, out)
            ended = {id(j) for j in jobs}
            self.batch = [j for j in self.batch if id(j) not in ended]
            self.counters["batches"] += 1
            self.cond.notify_all()

    def _record(self, job: Job, out: Completion) -> None:
        if job.adapter is None:
            self.counters["base_requests"] += 1
            self.counters["base_tokens"] += len(out.completion_ids)
        else:
            self._pool.record(job.adapter, len(out.completion_ids))

    # ---------------------------------------------------------------- endings
    def abort_ids(self, request_id: str | None, reason: str) -> int:
        """Abort the job with `request_id`, or every job when None; returns how many were aborted."""
        with self.cond:
            job = self.jobs.get(request_id) if request_id is not None else None
            jobs = list(self.jobs.values()) if request_id is None else [job] if job else []
            for j in jobs:
                self.abort(j, reason)
            self.cond.notify_all()
            return len(jobs)

    def abort(self, job: Job, reason: str) -> None:
        """End `job` as aborted now (condition held); a running batch keeps its usage until it ends."""
        if job in self.queue:
            self.queue.remove(job)
        self.aborted[reason] += 1
        version = job.version if job.version is not None else adapter_version(job.adapter)
        self.resolve(job, aborted_completion(job.request, version, reason))

    def abort_all(self, reason: str) -> None:
        """Abort every queued and running job (condition held)."""
        for job in list(self.jobs.values()):
            self.abort(job, reason)

    def resolve(self, job: Job, value: Completion | BaseException) -> None:
        """Deliver `value` to the job's future once; later calls (or a cancelled future) are no-ops."""
        with self.cond:
            if self.jobs.get(job.rid) is not job:
                return
            del self.jobs[job.rid]
            try:
                if isinstance(value, BaseException):
                    job.future.set_exception(value)
                else:
                    job.future.set_result(value)
            except InvalidStateError:  # cancelled by its caller meanwhile
                pass


def check_request(request: GenerationRequest) -> None:
    """Refuse a request that can't run: an empty prompt or `max_new_tokens < 1`.

    Raises:
        EngineError: naming the request id.
    """
    if not request.prompt_ids:
        raise EngineError(f"request {request.request_id}: empty prompt")
    if request.sampling.max_new_tokens < 1:
        raise EngineError(f"request {request.request_id}: max_new_tokens must be >= 1")
