"""What an HTTP client keeps about its own requests: the ones in flight, the abort reasons given for them,
and completion counts per adapter.

SGLang's `/abort_request` takes no reason and its aborted outputs carry prose, so the SGLang client
(`HTTPEngine`) remembers the reason given to `abort` (or `pause("abort")`) for each of its requests in flight
and sets it on the completion when the server names no reason of its own (`remote.wire.to_completion`). A
request keeps the
first reason given: a later abort or pause does not end an ended request again. Reasons are forgotten when
the request's call ends, whether or not it succeeded.

A request is sent under a rid (`/generate`'s `rid`, what `/abort_request` names): its own id, or a fresh one
when SGLang lost the call it was in (HTTP 499, `HTTPEngine._generate_chunk`) and it is sent again; `rid_of`
gives the rid in use, so an abort reaches the request in whichever call it is.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, defaultdict
from collections.abc import Collection, Iterable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from typing import Any

from lora_rl_core.engines.base import Completion, GenerationRequest
from lora_rl_core.errors import EngineError

MAX_UNEXPLAINED_LOSSES = 3
"""How many times SGLang may lose one batch call (HTTP 499) with no request of it aborted by this client
before `HTTPEngine.generate` gives up with an EngineError (each loss that this client's abort explains
ends that request, so those are bounded by the batch size)."""


class InFlightRequests:
    """One client's requests in flight, their kept abort reasons and per-adapter counts; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # notified when a request ends (`wait_drained`)
        self._wakers: dict[str, threading.Event] = {}  # request id -> the event its `wait_ended` waits on
        self._ids: set[str] = set()
        self._held: Counter[str] = Counter()  # adapter -> requests in flight naming it
        self._reasons: dict[str, str] = {}  # request id -> first reason given to `abort`
        self._rids: dict[str, str] = {}  # request id -> the rid it is sent under now (when not its own id)
        self._counters: defaultdict[str, Counter[str]] = defaultdict(Counter)

    def __len__(self) -> int:
        """How many requests are in flight now."""
        with self._lock:
            return len(self._ids)

    @contextmanager
    def tracking(self, requests: list[GenerationRequest]) -> Iterator[dict[str, str]]:
        """Mark `requests` in flight for the duration of their call. Yields a dict that, on exit, holds the
        reasons kept for them meanwhile (request id -> reason); they are forgotten here then."""
        ids = {r.request_id for r in requests}
        held = Counter(r.adapter for r in requests if r.adapter is not None)
        reasons: dict[str, str] = {}
        with self._lock:
            self._ids |= ids
            self._held.update(held)
        try:
            yield reasons
        finally:
            with self._lock:
                self._ids -= ids
                for i in ids:
                    self._rids.pop(i, None)
                self._held.subtract(held)
                self._held = +self._held  # drop the zeros
                reasons.update((i, self._reasons.pop(i)) for i in ids if i in self._reasons)
                self._changed.notify_all()

    def held(self) -> dict[str, int]:
        """Adapter name -> how many of this client's requests in flight name it."""
        with self._lock:
            return dict(self._held)

    def keep_reason(self, request_id: str | None, reason: str) -> set[str]:
        """Keep `reason` for request `request_id`, or for every request in flight when None, unless one
        was kept before. Returns the ids it ended: in flight and without a reason until now (empty for an
        id not in flight, or one aborted before)."""
        with self._lock:
            ids = set(self._ids) if request_id is None else {request_id} & self._ids
            ended = {rid for rid in ids if rid not in self._reasons}
            for rid in ended:
                self._reasons[rid] = reason
                if (wake := self._wakers.get(rid)) is not None:
                    wake.set()
        return ended

    def wait_ended(self, request_ids: Collection[str], call: Future[Any], deadline: float) -> dict[str, str] | None:
        """Wait until `call` (the call of `request_ids`) has answered (None is returned) or every one of them has
        a kept reason (all ended here: their reasons are returned, request id -> reason). At `deadline`
        (monotonic s) those without a reason get `timeout`. Woken only by this call's answer and by reasons kept
        for its own requests: hundreds of calls wait at once in front of SGLang, and waking all of them at every
        change kept our server's interpreter busy (the soak, docs/HOTSWAP.md)."""
        wake = threading.Event()
        call.add_done_callback(lambda _: wake.set())
        with self._lock:
            for i in request_ids:
                self._wakers[i] = wake
        try:
            while True:
                wake.clear()  # before the checks: a change after them sets it again, so none is missed
                with self._lock:
                    if call.done():
                        return None
                    if all(i in self._reasons for i in request_ids):
                        return {i: self._reasons[i] for i in request_ids}
                    left = deadline - time.monotonic()
                    if left <= 0:
                        for i in request_ids:
                            if i in self._ids:
                                self._reasons.setdefault(i, "timeout")
                        if all(i in self._reasons for i in request_ids):
                            return {i: self._reasons[i] for i in request_ids}
                        return None  # the call ended meanwhile: its answer is there
                wake.wait(min(left, 1.0))
        finally:
            with self._lock:
                for i in request_ids:
                    if self._wakers.get(i) is wake:
                        del self._wakers[i]

    def wait_drained(self, adapter: str, deadline: float) -> int:
        """Wait until no request in flight names `adapter`, at most until `deadline` (monotonic s); returns
        how many still do (0: drained)."""
        with self._lock:
            while self._held.get(adapter, 0) and (left := deadline - time.monotonic()) > 0:
                self._changed.wait(min(left, 0.25))
            return self._held.get(adapter, 0)

    def rid_of(self, request_id: str) -> str:
        """The rid request `request_id` is sent under now: its own id unless `resend_rids` gave it another."""
        with self._lock:
            return self._rids.get(request_id, request_id)

    def resend_rids(self, request_ids: list[str], attempt: int) -> tuple[dict[str, str], dict[str, str]]:
        """After a call lost `request_ids` (still in flight here): the reason kept for each one that has one
        (it was aborted: it ends with that reason), and a fresh rid (`<id>~<attempt>`) for each of the others,
        to send them again. Both in one step under the lock: an `abort` before it ends the request, one after
        it finds the new rid (`rid_of`)."""
        kept: dict[str, str] = {}
        fresh: dict[str, str] = {}
        with self._lock:
            for rid in request_ids:
                if rid in self._reasons:
                    kept[rid] = self._reasons[rid]
                else:
                    fresh[rid] = self._rids[rid] = f"{rid}~{attempt}"
        return kept, fresh

    def kept_reasons(self) -> dict[str, str]:
        """A copy of the reasons kept now (request id -> reason)."""
        with self._lock:
            return dict(self._reasons)

    def count(self, completions: list[Completion]) -> None:
        """Count each completion (and its tokens) under its adapter (`__base__` for the base model)."""
        with self._lock:
            for c in completions:
                self._counters[c.adapter or "__base__"].update(requests=1, tokens=len(c.completion_ids))

    def counts(self) -> dict[str, dict[str, int]]:
        """Per adapter: `{"requests", "tokens"}` counted so far."""
        with self._lock:
            return {name: dict(counts) for name, counts in self._counters.items()}


class RetiredAdapters:
    """Adapter names this client retired from a real SGLang server, which it refuses to send again.

    Why: SGLang 0.5.17 answers a `/generate` that names an unloaded adapter by loading it again from the
    path it remembers (`TokenizerManager.lora_ref_cache`, log line "Reloading evicted adapter"), with HTTP 200
    (docs/SGLANG.md, "Hazards"). A late request for a retired version would bring that version back
    resident and unnoticed. So the name is retired here before the unload is sent; a request naming it is
    refused at once as an unknown adapter, as the embedded engine and our server refuse one; and a retired name that the
    server lists again (another client revived it) is counted and logged, and stays listed so that the
    next `retire_stale` unloads it again. Names are never reused for other weights, so none comes back.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._names: set[str] = set()
        self.revived = 0
        """How many times a retired name was found listed again by the server."""

    def retire(self, name: str) -> None:
        """Refuse `name` from now on."""
        with self._lock:
            self._names.add(name)

    def refuses(self, name: str | None) -> bool:
        """True when `name` was retired (the base model, None, never is)."""
        with self._lock:
            return name is not None and name in self._names

    def revived_in(self, listed: Iterable[str]) -> list[str]:
        """The retired names among `listed` (what the server lists now); each sighting is counted."""
        with self._lock:
            back = sorted(n for n in listed if n in self._names)
            self.revived += len(back)
        return back

    def check(self, requests: list[GenerationRequest], url: str) -> None:
        """Refuse a batch that names a retired adapter, before anything reaches the server.

        Raises:
            EngineError: with SGLang's wording for an unknown adapter, as for a name never loaded.
        """
        refused = sorted({r.adapter for r in requests if r.adapter is not None and self.refuses(r.adapter)})
        if refused:
            raise EngineError(
                f"LoRA adapter {refused[0]!r} has never been loaded or was unloaded: this client retired it and "
                f"does not send it ({url} would load it again from its old path, docs/SGLANG.md)"
            )


class LostCalls:
    """What an SGLang client does when SGLang 0.5.17 fails a whole `/generate` batch call with HTTP 499
    (`resolve`), and how often that happened (`counts`: `calls` lost, requests `resent`)."""

    def __init__(self, requests: InFlightRequests) -> None:
        self.requests = requests
        self.counts: Counter[str] = Counter()
        self._lock = threading.Lock()

    def resolve(
        self,
        pending: list[GenerationRequest],
        rids: dict[str, str],
        lost: dict[str, str],
        message: str,
        attempt: int,
        deadline: float,
        unexplained: int,
        url: str,
    ) -> tuple[list[GenerationRequest], bool]:
        """After SGLang lost the call of `pending` (HTTP 499 `message`): the rows this client aborted (a reason
        kept by `abort` or `pause("abort")`) go into `lost` with that reason; the others get fresh rids in
        `rids` and are returned, to be sent again (with whether any row was this client's abort). SGLang
        0.5.17 raises the 499 before the batch reaches its scheduler (`TokenizerManager.
        _raise_if_logical_rid_aborted`) and drops every row's state with it, so the other rows never ran;
        fresh rids keep a resent row clear of anything the server may still hold under the old one.
        Rows left when the deadline has passed end aborted with reason `timeout`.

        Raises:
            EngineError: the call was lost `MAX_UNEXPLAINED_LOSSES` times with no row this client aborted
                (another client's aborts, or pauses in `abort` mode that keep coming).
        """
        kept, fresh = self.requests.resend_rids([r.request_id for r in pending], attempt)
        lost.update(kept)
        with self._lock:
            self.counts.update(calls=1, resent=len(fresh))
        if fresh and not kept and unexplained + 1 >= MAX_UNEXPLAINED_LOSSES:
            raise EngineError(
                f"{message} ({url}/generate: HTTP 499 {unexplained + 1} times for this batch with no request "
                f"aborted by this client; {len(fresh)} requests not sent again)"
            )
        if fresh and time.monotonic() >= deadline:  # no time left to send them again
            lost.update(dict.fromkeys(fresh, "timeout"))
            return [], bool(kept)
        rids.update(fresh)
        return [r for r in pending if r.request_id in fresh], bool(kept)
