"""The hot-swap stress run's records and checks: settings, the report, what the threads record, the invariants.

`lora_rl_testing/stress.py` runs the threads (its docstring lists the invariants); this module holds what they
share (`Shared`: settings, the event log, the groups sent, counters) and turns it into a `StressReport`.
"""

from __future__ import annotations

import dataclasses
import itertools
import statistics
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from lora_rl_core.adapters import adapter_version

DEADLINE_GRACE_S = 5.0  # a call that returns later than its deadline plus this is counted as a hang


@dataclass(frozen=True)
class StressSettings:
    """The knobs of one stress run (see the module docstring); times in seconds."""

    swaps: int = 200
    clients: int = 32
    n: int = 4
    deadline_s: float = 600.0
    abort_prob: float = 0.1
    pause_prob: float = 0.1
    seed: int = 0
    run_id: str = "stress"
    keep: int = 2
    vocab_size: int = 64
    prompt_len: tuple[int, int] = (3, 12)
    max_new_tokens: tuple[int, ...] = (4, 8)
    swap_interval_s: float = 0.05
    pause_tick_s: float = 0.1
    max_pause_s: float = 0.3
    max_abort_delay_s: float = 0.2
    request_timeout_s: float = 60.0
    control_timeout_s: float = 30.0
    samples: Literal["group", "n"] | None = None
    bounded: bool = False
    """Retire before each load, draining versions in use, so at most `keep` versions are ever loaded (what
    `lora-rl subscribe` does: `sync_version(..., bounded=True)`); else retire after the load (the training flow)."""
    duration_s: float = 0.0
    """> 0: swap for this many seconds, however many swaps that makes (a soak; `swaps` is no cap then, the
    caller checks it as a minimum); 0: stop after `swaps`. Keep `deadline_s` some seconds longer, for the
    requests in flight when swapping stops."""


@dataclass
class StressReport:
    """Counts of one stress run; `violations()` are the invariants (all must be 0), `ok` says they are."""

    target: str
    samples: str
    settings: dict[str, Any]
    wall_s: float = 0.0
    swaps: int = 0
    swap_failures: int = 0
    retired: int = 0
    pauses: dict[str, int] = field(default_factory=dict)
    groups: int = 0
    requests: int = 0
    completed: int = 0
    aborted: dict[str, int] = field(default_factory=dict)
    rejected: int = 0
    abort_calls: int = 0
    aborts_acknowledged: int = 0
    abort_failures: int = 0
    latency_mean_s: float = 0.0
    latency_p50_s: float = 0.0
    latency_p99_s: float = 0.0
    latency_max_s: float = 0.0
    swap_phase_p50_s: dict[str, float] = field(default_factory=dict)  # adapter, room, load: where a swap's time goes
    lost: int = 0
    missing_reason: int = 0
    unexpected_rejections: int = 0
    unaccounted_aborts: int = 0
    errors: int = 0
    version_mismatches: int = 0
    mixed_groups: int = 0
    not_loaded_at_admission: int = 0
    unloads_while_paused: int = 0
    late_calls: int = 0
    hangs: int = 0
    leaked_in_flight: int = 0
    final_probe_failed: int = 0
    revived_adapters: int = 0
    examples: list[str] = field(default_factory=list)

    VIOLATIONS = (
        "swap_failures",
        "lost",
        "missing_reason",
        "unexpected_rejections",
        "unaccounted_aborts",
        "errors",
        "version_mismatches",
        "mixed_groups",
        "not_loaded_at_admission",
        "unloads_while_paused",
        "late_calls",
        "hangs",
        "leaked_in_flight",
        "final_probe_failed",
        "revived_adapters",
    )

    def violations(self) -> dict[str, int]:
        """Invariant name -> count of breaches (all 0 in a passing run)."""
        return {k: getattr(self, k) for k in self.VIOLATIONS}

    @property
    def ok(self) -> bool:
        """No invariant was breached."""
        return not any(self.violations().values())

    def as_dict(self) -> dict[str, Any]:
        """A JSON-safe dict of every count, plus `ok` and `violations`."""
        return {**dataclasses.asdict(self), "ok": self.ok, "violations": self.violations()}


# ----------------------------------------------------------------------------- records


@dataclass
class Sample:
    """One sample's outcome as the engine reported it."""

    request_id: str
    finish: str
    adapter: str | None
    version: int | None
    abort_reason: str | None


@dataclass
class Group:
    """One client call: `n` samples of one prompt naming one version."""

    rid: str
    name: str
    n: int
    submit_seq: int = -1
    end_seq: int = -1
    seconds: float = 0.0
    samples: list[Sample] = field(default_factory=list)
    error: str | None = None
    rejected: bool = False


class EventLog:
    """Sequence-numbered control events (load, activate, retire, pause, resume) shared by all threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seq = itertools.count()
        self.events: list[tuple[int, str, str | None]] = []

    def mark(self, kind: str, name: str | None = None) -> int:
        """Record one event; returns its sequence number (a total order over all threads)."""
        with self._lock:
            seq = next(self._seq)
            self.events.append((seq, kind, name))
            return seq

    def tick(self) -> int:
        """A sequence number without an event (to place client calls in the same order)."""
        with self._lock:
            return next(self._seq)

    def first(self, kind: str) -> dict[str, int]:
        """name -> sequence number of its first `kind` event."""
        out: dict[str, int] = {}
        for seq, k, name in self.events:
            if k == kind and name is not None:
                out.setdefault(name, seq)
        return out

    def paused_after(self, seq: int, mode: str) -> bool:
        """Whether a pause in `mode` was in force at some point after event `seq`: one marked (`pause`, named
        by its mode) before now whose `resume` comes after `seq`, or has not come yet."""
        with self._lock:
            events = list(self.events)
        opened: str | None = None
        for at, kind, name in events:
            if kind == "pause" and opened is None:
                opened = name
            elif kind == "resume" and opened is not None:
                if opened == mode and at > seq:
                    return True
                opened = None
        return opened == mode

    def intervals(self, start: str, end: str) -> list[tuple[int, int]]:
        """(start, end) sequence pairs of alternating `start`/`end` events; an open one ends at infinity."""
        out, opened = [], None
        for seq, k, _ in self.events:
            if k == start and opened is None:
                opened = seq
            elif k == end and opened is not None:
                out.append((opened, seq))
                opened = None
        return out + ([(opened, 1 << 62)] if opened is not None else [])


@dataclass
class Shared:
    """State the threads share."""

    settings: StressSettings
    log: EventLog = field(default_factory=EventLog)
    control: threading.Lock = field(default_factory=threading.Lock)  # pause transitions vs. retiring
    stop: threading.Event = field(default_factory=threading.Event)
    active: str | None = None
    groups: list[Group] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    late: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    counts: Counter[str] = field(default_factory=Counter)
    retire_started: dict[str, int] = field(default_factory=dict)  # name -> sequence of the retire call's start
    deadline: float = 0.0
    phase_s: dict[str, list[float]] = field(default_factory=dict)  # swap phase -> seconds of each swap

    def phase(self, name: str, fn: Callable[[], Any]) -> Any:
        """Call `fn` and record its seconds under swap phase `name`."""
        start = time.monotonic()
        try:
            return fn()
        finally:
            with self.lock:
                self.phase_s.setdefault(name, []).append(time.monotonic() - start)

    def count(self, **increments: int) -> None:
        """Add to the run's counters (thread-safe)."""
        with self.lock:
            self.counts.update(increments)

    def fail(self, what: str, exc: BaseException) -> None:
        """Record a control call or thread that failed (reported under `errors`)."""
        with self.lock:
            self.counts["errors"] += 1
            self.failures.append(f"{what}: {type(exc).__name__}: {exc}")

    def timed(self, what: str, limit_s: float, fn: Callable[[], Any]) -> Any:
        """Call `fn`, and count a late call when it returns after `limit_s` + the grace."""
        start = time.monotonic()
        try:
            return fn()
        finally:
            took = time.monotonic() - start
            if took > limit_s + DEADLINE_GRACE_S:
                with self.lock:
                    self.late.append(f"{what} took {took:.1f} s (deadline {limit_s:g} s)")


# ----------------------------------------------------------------------------- checks


def build_report(target: str, samples: str, shared: Shared, wall_s: float) -> StressReport:
    """The report of a finished run: the counters, then every group and the event log checked.

    Args:
        target: what was stressed (a URL, or the engine's class name).
        samples: how groups were sent (`"group"`: n requests; `"n"`: SGLang's `sampling_params.n`).
        shared: the run's records.
        wall_s: the run's wall time (s).
    """
    report = StressReport(target=target, samples=samples, settings=dataclasses.asdict(shared.settings), wall_s=wall_s)
    c = shared.counts
    report.swaps, report.swap_failures, report.retired = c["swaps"], c["swap_failures"], c["retired"]
    report.pauses = {k.split(":", 1)[1]: v for k, v in sorted(c.items()) if k.startswith("pause:")}
    report.abort_calls, report.aborts_acknowledged = c["abort_calls"], c["aborts_acknowledged"]
    report.abort_failures = c["abort_failures"]
    report.late_calls = len(shared.late)
    report.errors = c["errors"]
    report.examples += shared.late[:5] + shared.failures[:5]
    _check_groups(report, shared)
    report.unloads_while_paused = _unloads_while_paused(shared.log, report)
    report.unaccounted_aborts = abs(report.aborts_acknowledged - report.aborted.get("aborted", 0))
    return report


def _check_groups(report: StressReport, shared: Shared) -> None:
    loaded = shared.log.first("load_done")
    unloaded = shared.log.first("unloaded")
    aborted: Counter[str] = Counter()
    latencies = [g.seconds for g in shared.groups]
    for g in shared.groups:
        report.groups += 1
        report.requests += g.n
        if g.error is not None:
            _check_refused(report, g, shared.retire_started)
            continue
        _check_samples(report, g, loaded, unloaded, aborted)
    report.aborted = dict(sorted(aborted.items()))
    if latencies:
        report.latency_mean_s = statistics.fmean(latencies)
        report.latency_max_s = max(latencies)
        report.latency_p50_s = statistics.median(latencies)
        report.latency_p99_s = sorted(latencies)[min(len(latencies) - 1, int(0.99 * len(latencies)))]
    report.swap_phase_p50_s = {k: round(statistics.median(v), 4) for k, v in shared.phase_s.items() if v}


def _check_refused(report: StressReport, g: Group, retire_started: dict[str, int]) -> None:
    """A refused group: expected only when the retire call that unloaded its version began before it ended."""
    if not g.rejected:
        report.errors += 1
        report.examples.append(f"group {g.rid} on {g.name} failed: {g.error}")
        return
    report.rejected += g.n
    if retire_started.get(g.name, 1 << 62) > g.end_seq:
        report.unexpected_rejections += 1
        report.examples.append(f"group {g.rid} refused although {g.name} was not retired: {g.error}")


def _check_samples(
    report: StressReport, g: Group, loaded: dict[str, int], unloaded: dict[str, int], aborted: Counter[str]
) -> None:
    named = adapter_version(g.name)
    if len(g.samples) != g.n:
        report.lost += abs(g.n - len(g.samples))
        report.examples.append(f"group {g.rid}: {len(g.samples)} samples back for n={g.n}")
    versions = set()
    for sample in g.samples:
        if sample.finish == "abort":
            aborted[sample.abort_reason or ""] += 1
            report.missing_reason += int(not sample.abort_reason)
            continue
        if sample.finish not in ("stop", "eos", "length"):
            report.lost += 1
            report.examples.append(f"sample {sample.request_id}: finish {sample.finish!r}")
            continue
        report.completed += 1
        versions.add(sample.version)
        if sample.version != named or sample.adapter != g.name:
            report.version_mismatches += 1
            report.examples.append(f"sample {sample.request_id}: named {g.name}, served {sample.adapter}")
        name = f"{g.name.rsplit('-v', 1)[0]}-v{sample.version:06d}" if sample.version is not None else g.name
        if loaded.get(name, 1 << 62) > g.submit_seq or unloaded.get(name, 1 << 62) < g.submit_seq:
            report.not_loaded_at_admission += 1
            report.examples.append(f"sample {sample.request_id}: {name} was not loaded when it was sent")
    report.mixed_groups += int(len(versions) > 1)


def _unloads_while_paused(log: EventLog, report: StressReport) -> int:
    """Unload events inside a paused interval (pause marked before the call, resume after it)."""
    paused = log.intervals("pause", "resume")
    bad = [(seq, name) for seq, kind, name in log.events if kind == "unloaded" and _inside(seq, paused)]
    report.examples += [f"{name} unloaded while paused (event {seq})" for seq, name in bad[:5]]
    return len(bad)


def _inside(seq: int, intervals: list[tuple[int, int]]) -> bool:
    return any(a < seq < b for a, b in intervals)
