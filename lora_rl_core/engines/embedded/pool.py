"""Adapter registry and resident pool of the embedded engine: names, usage counts, eviction, pinning.

Pure Python (no torch), so the policy is testable without a model. Every method takes the pool's
condition (`pool.cond`, re-entrant): the engine shares that one condition for its request queue, and
waiters (`wait_unused`) release it while they wait, so an unload that waits never blocks a load.

Mirrors SGLang: `sglang/srt/lora/lora_registry.py` (`LoRARegistry`: register, unregister, acquire,
release, wait_for_unload; usage counted per request) and `sglang/srt/lora/mem_pool.py` with
`sglang/srt/lora/eviction_policy.py` (a bounded pool of resident adapters, `lru` or `fifo` eviction,
pinned adapters never evicted, at most `max_loras_per_batch - 1` pinned).

Choices made here:

* "Known" = registered under its name; "resident" = injected into the model (SGLang's GPU pool).
  `max_loaded` caps resident adapters; an evicted adapter stays known and is re-injected on demand
  from its `loader` (its path, its store version, or the CPU tensors it was loaded from).
* Usage is a set of request ids per adapter, so releasing a request twice is a no-op: each request
  is released exactly once, whatever way it ended (sglang PR #31808 / #34205: drifting counters).
* Unload unregisters first (new requests fail as unknown), then waits for the holders with a deadline
  (SGLang waits forever: sglang#36894). Until its last holder releases, the entry stays resident as
  "draining"; `reapable()` lists draining entries that are free to delete from the model.
* LRU clock ticks when an adapter is loaded and whenever a request is admitted with it;
  FIFO clock ticks whenever it is injected.

Left out: SGLang's separate CPU-resident cache (its `--max-loaded-loras`); here non-resident adapters
are re-read from their source when needed.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from lora_rl_core.config import ENGINE_DEFAULTS, EvictionPolicy
from lora_rl_core.engines.base import unknown_adapter_message
from lora_rl_core.errors import EngineError


@dataclass
class AdapterStats:
    """Counters of one adapter: completed requests, their completion tokens, injections, evictions,
    and injection time in seconds (last and total)."""

    requests: int = 0
    tokens: int = 0
    loads: int = 0
    evictions: int = 0
    load_seconds_last: float = 0.0
    load_seconds_total: float = 0.0


@dataclass(eq=False)
class AdapterEntry:
    """One known adapter.

    Attributes:
        name: adapter name (usually `<run>-v<NNNNNN>`).
        source: where it came from (folder, URI, `store://RUN@V` or `tensors`), for humans.
        loader: returns `(tensors, config)` to re-inject it after eviction.
        pinned: never evicted.
        version: version parsed from the name (None for unversioned names).
        loaded_at: unix time (s) of registration.
        resident: injected into the model now.
        registered: False once unload has begun (draining).
        last_used / injected_at: LRU and FIFO clock values.
        holders: ids of admitted requests that have not been released.
    """

    name: str
    source: str
    loader: Callable[[], Any] | None
    pinned: bool
    version: int | None
    loaded_at: float = field(default_factory=time.time)
    resident: bool = False
    registered: bool = True
    last_used: int = 0
    injected_at: int = 0
    holders: set[str] = field(default_factory=set)
    stats: AdapterStats = field(default_factory=AdapterStats)


class AdapterPool:
    """Known adapters, their usage counts, and which of them are resident.

    Args:
        max_loaded: cap on resident adapters (None = no cap); SGLang's `--max-loaded-loras`.
        policy: `lru` or `fifo`: which resident adapter to evict; SGLang's `--lora-eviction-policy`.
        max_pinned: cap on pinned adapters (SGLang: `max_loras_per_batch - 1`).
        cond: the condition guarding the pool (a new re-entrant one by default).

    Raises:
        ValueError: caps below 1 / 0 (the policy is checked by `EngineConfig`).
    """

    def __init__(
        self,
        *,
        max_loaded: int | None = None,
        policy: EvictionPolicy = ENGINE_DEFAULTS.eviction_policy,
        max_pinned: int = 7,
        cond: threading.Condition | None = None,
    ) -> None:
        if (max_loaded is not None and max_loaded < 1) or max_pinned < 0:
            raise ValueError(f"max_loaded must be >= 1 and max_pinned >= 0, got {max_loaded}, {max_pinned}")
        self.max_loaded = max_loaded
        self.policy = policy
        self.max_pinned = max_pinned if max_loaded is None else min(max_pinned, max_loaded - 1)
        self.cond = cond or threading.Condition(threading.RLock())
        self._entries: dict[str, AdapterEntry] = {}  # registered and draining
        self._clock = itertools.count(1)

    # ----------------------------------------------------------------- registry
    def check_new(self, name: str, *, pinned: bool = False) -> None:
        """Raise EngineError if `name` cannot be registered now (taken, draining, or pinned cap reached)."""
        with self.cond:
            entry = self._entries.get(name)
            if entry is not None and entry.registered:
                raise EngineError(f"adapter {name!r} is already loaded; load new weights under a new versioned name")
            if entry is not None:
                raise EngineError(f"adapter {name!r} is being unloaded ({len(entry.holders)} requests still hold it)")
            if pinned and self.pinned_count() >= self.max_pinned:
                raise EngineError(
                    f"cannot pin {name!r}: {self.pinned_count()} adapters are pinned and at most {self.max_pinned} "
                    "may be (max_loras_per_batch - 1, and fewer than max_loaded_loras)"
                )

    def register(
        self,
        name: str,
        *,
        source: str,
        loader: Callable[[], Any] | None = None,
        pinned: bool = False,
        version: int | None = None,
        load_seconds: float = 0.0,
    ) -> AdapterEntry:
        """Register `name` as known and resident (the caller has injected it, in `load_seconds` s).

        Raises:
            EngineError: as `check_new`.
        """
        with self.cond:
            self.check_new(name, pinned=pinned)
            entry = AdapterEntry(name, source, loader, pinned, version, last_used=next(self._clock))
            self._entries[name] = entry
            self.mark_resident(name, load_seconds)
            return entry

    def get(self, name: str) -> AdapterEntry | None:
        """The registered entry of `name` (None if unknown or being unloaded)."""
        with self.cond:
            entry = self._entries.get(name)
            return entry if entry is not None and entry.registered else None

    def entry(self, name: str) -> AdapterEntry | None:
        """The entry of `name`, registered or draining."""
        with self.cond:
            return self._entries.get(name)

    def registered(self) -> list[AdapterEntry]:
        """Registered entries, in registration order."""
        with self.cond:
            return [e for e in self._entries.values() if e.registered]

    def draining(self) -> list[AdapterEntry]:
        """Entries being unloaded (unregistered, still tracked until free)."""
        with self.cond:
            return [e for e in self._entries.values() if not e.registered]

    def pinned_count(self) -> int:
        """Registered pinned adapters."""
        with self.cond:
            return sum(1 for e in self.registered() if e.pinned)

    # -------------------------------------------------------------------- usage
    def acquire(self, name: str, request_id: str) -> AdapterEntry:
        """Count `request_id` as using `name` (at admission); touches the LRU clock.

        Raises:
            EngineError: `name` is not registered (SGLang's "not loaded" message).
        """
        with self.cond:
            entry = self.get(name)
            if entry is None:
                raise EngineError(unknown_adapter_message(name, [e.name for e in self.registered()]))
            entry.holders.add(request_id)
            entry.last_used = next(self._clock)
            return entry

    def release(self, name: str, request_id: str) -> bool:
        """Stop counting `request_id` on `name`; False if it was not counted (a second release is a no-op)."""
        with self.cond:
            entry = self._entries.get(name)
            if entry is None or request_id not in entry.holders:
                return False
            entry.holders.discard(request_id)
            self.cond.notify_all()
            return True

    def in_flight(self, name: str) -> int:
        """Requests admitted with `name` and not yet released (0 for unknown names)."""
        with self.cond:
            entry = self._entries.get(name)
            return len(entry.holders) if entry is not None else 0

    def holders(self, name: str) -> list[str]:
        """Sorted ids of the requests holding `name`."""
        with self.cond:
            entry = self._entries.get(name)
            return sorted(entry.holders) if entry is not None else []

    def record(self, name: str, tokens: int) -> None:
        """Count one completed request of `tokens` completion tokens on `name`."""
        with self.cond:
            entry = self._entries.get(name)
            if entry is not None:
                entry.stats.requests += 1
                entry.stats.tokens += tokens

    # ------------------------------------------------------------------- unload
    def unregister(self, name: str) -> AdapterEntry:
        """Begin unloading `name`: new requests can no longer acquire it (it is draining).

        Raises:
            EngineError: `name` is not registered.
        """
        with self.cond:
            entry = self.get(name)
            if entry is None:
                raise EngineError(
                    f"adapter {name!r} is not loaded (loaded: {sorted(e.name for e in self.registered())})"
                )
            entry.registered = False
            self.cond.notify_all()
            return entry

    def wait_unused(self, name: str, timeout_s: float) -> bool:
        """Wait up to `timeout_s` seconds until no request holds `name`; True if none does.
        Releases the condition while waiting, so loads and other unloads go on."""
        with self.cond:
            return self.cond.wait_for(lambda: self.in_flight(name) == 0, timeout=max(0.0, timeout_s))

    def reapable(self) -> list[str]:
        """Draining adapters that no request holds: ready to delete from the model (if resident) and forget."""
        with self.cond:
            return [e.name for e in self.draining() if not e.holders]

    def forget(self, name: str) -> None:
        """Drop a draining entry for good (after the model no longer holds it)."""
        with self.cond:
            entry = self._entries.get(name)
            if entry is not None and not entry.registered and not entry.holders:
                del self._entries[name]
                self.cond.notify_all()

    # ---------------------------------------------------------------- residency
    def resident_count(self) -> int:
        """Adapters injected into the model now (draining ones included)."""
        with self.cond:
            return sum(1 for e in self._entries.values() if e.resident)

    def mark_resident(self, name: str, load_seconds: float = 0.0) -> None:
        """Record that `name` was injected, taking `load_seconds`; ticks the FIFO clock."""
        with self.cond:
            entry = self._entries[name]
            entry.resident = True
            entry.injected_at = next(self._clock)
            entry.stats.loads += 1
            entry.stats.load_seconds_last = load_seconds
            entry.stats.load_seconds_total += load_seconds

    def evict_for(self, count: int, *, keep: Iterable[str] = ()) -> list[str]:
        """Free room for `count` more resident adapters: choose victims, mark them non-resident and
        return them (the caller deletes them from the model). Idle draining adapters go first, then
        registered ones by policy; pinned, held and `keep` adapters are never chosen.

        Raises:
            EngineError: not enough adapters can be evicted; names what holds the pool.
        """
        with self.cond:
            short = self._shortfall(count)
            if short == 0:
                return []
            victims = self._candidates(set(keep))[:short]
            if len(victims) < short:
                raise EngineError(self._full_message(count))
            for entry in victims:
                entry.resident = False
                if entry.registered:
                    entry.stats.evictions += 1
            return [e.name for e in victims]

    def _shortfall(self, count: int) -> int:
        if self.max_loaded is None:
            return 0
        return max(0, self.resident_count() + count - self.max_loaded)

    def _candidates(self, keep: set[str]) -> list[AdapterEntry]:
        free = [e for e in self._entries.values() if e.resident and not e.holders and not e.pinned]
        free = [e for e in free if e.name not in keep]
        key = (lambda e: e.last_used) if self.policy == "lru" else (lambda e: e.injected_at)
        return sorted(free, key=lambda e: (e.registered, key(e)))

    def _full_message(self, count: int) -> str:
        held = {e.name: ("pinned" if e.pinned else f"{len(e.holders)} in flight") for e in self._entries.values()}
        return (
            f"adapter pool full: {self.resident_count()} of max_loaded_loras={self.max_loaded} resident and "
            f"{count} more needed, but none can be evicted ({held}); raise max_loaded_loras or unload adapters"
        )

    # ------------------------------------------------------------------ reports
    def snapshot(self) -> dict[str, dict[str, Any]]:
        """Registered adapters: name -> counters and state (plain values, for metrics)."""
        with self.cond:
            return {e.name: _entry_info(e) for e in self.registered()}


def _entry_info(e: AdapterEntry) -> dict[str, Any]:
    s = e.stats
    return {
        "version": e.version,
        "source": e.source,
        "loaded_at": e.loaded_at,
        "pinned": e.pinned,
        "resident": e.resident,
        "in_flight": len(e.holders),
        "requests": s.requests,
        "tokens": s.tokens,
        "loads": s.loads,
        "evictions": s.evictions,
        "load_seconds_last": s.load_seconds_last,
        "load_seconds_total": s.load_seconds_total,
    }
