"""What an HTTP client keeps about its own requests: the ones in flight, the abort reasons given for them,
and completion counts per adapter.

SGLang's `/abort_request` takes no reason and its aborted outputs carry prose, so `SGLangEngine` remembers
the reason given to `abort` (or `pause("abort")`) for each of its requests in flight and sets it on the
completion when the server names no reason of its own (`http_wire.to_completion`). A request keeps the
first reason given: a later abort or pause does not end an ended request again. Reasons are forgotten when
the request's call ends, whether or not it succeeded.
"""

from __future__ import annotations

import threading
from collections import Counter, defaultdict
from collections.abc import Iterator
from contextlib import contextmanager

from lora_rl_core.engines.base import Completion, GenerationRequest


class InFlightRequests:
    """One client's requests in flight, their kept abort reasons and per-adapter counts; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ids: set[str] = set()
        self._reasons: dict[str, str] = {}  # request id -> first reason given to `abort`
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
        reasons: dict[str, str] = {}
        with self._lock:
            self._ids |= ids
        try:
            yield reasons
        finally:
            with self._lock:
                self._ids -= ids
                reasons.update((i, self._reasons.pop(i)) for i in ids if i in self._reasons)

    def keep_reason(self, request_id: str | None, reason: str) -> set[str]:
        """Keep `reason` for request `request_id`, or for every request in flight when None, unless one
        was kept before. Returns the ids in flight it concerned (empty for an id not in flight)."""
        with self._lock:
            ids = set(self._ids) if request_id is None else {request_id} & self._ids
            for rid in ids:
                self._reasons.setdefault(rid, reason)
        return ids

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
