"""Hot-swap stress: adapter swaps under concurrent sampling, aborts and pauses, with the invariants checked.

The hot-swap issue's acceptance run (DESIGN.md, "Adapter versions: naming and the hot-swap protocol"); the CI
test (`tests/integration/test_hotswap_stress.py`, reduced size) and the benchmark (`benchmarks/hotswap_stress.py`,
full size) both call `run_hotswap_stress`.

Threads:

* swapper: `swaps` times, loads `<run>-v000001, ...` from fresh random LoRA tensors (the tensor path), each
  under a new name, makes it the active version, then retires stale versions with `subscriber.retire_stale`
  (what `sync_version` runs; or the engine's own `retire_stale`) under the control lock, so no unload can
  overlap a pause: that function skips engines that report generation paused (the protocol under test).
* `clients` clients: send groups of `n` samples of one random prompt naming the active version, over and over.
* aborter: aborts random requests of random groups by id after a random delay (`abort_prob` per group).
* pauser: every `pause_tick_s`, with probability `pause_prob`, pauses (mode abort | retract | in_place) under
  the control lock, waits up to `max_pause_s`, and resumes.

Every engine call has a deadline, and so does the run. Checked afterwards (`StressReport.violations`):

* lost: a sample that did not end completed (stop/length), aborted with a reason, or rejected at submit;
* rejections: a group may be refused at submit only because its version was retired meanwhile;
* version mismatch: a completion whose adapter or version differs from what its request named (a request
  names one version, so a group whose samples differ is counted here too, and in `mixed_groups`);
* not loaded at admission: a completion whose version's load had not finished when its group was sent, or
  whose unload had already finished then (the admission record itself is the engine's: it aborts a request
  whose adapter is unregistered at admission with `adapter_unloaded`);
* unaccounted aborts: the requests that `abort` calls report aborted must be exactly the samples that come
  back aborted with reason `aborted`;
* unloads while paused, failed loads or control calls (and crashed threads), calls past their deadline
  (+ a grace), threads still alive at the run deadline, usage counts still held once everything ended,
  and a final 1-token request on the active version.

Aborts with reason `adapter_unloaded` are allowed (not lost: they end with a reason): the engine admits a
queued request only while its adapter is registered, and `subscriber.retire_stale` retires versions that no
*admitted* request holds, so requests still queued for a retired version end that way. `retire="engine"`
(`EmbeddedEngine.retire_stale`, which also spares queued requests) gives none.

Targets: an in-process engine (`EmbeddedEngine`; a group is `n` requests sharing the prompt, through
`generate`), or our engine server over HTTP (a `ServerEngine` or its URL): a group is one SGLang `/generate`
with `sampling_params.n` (`samples="n"`, the default there), whose per-sample `meta_info.weight_version` is
the version the server admitted the sample with; or `samples="group"`, `n` requests through
`ServerEngine.generate` (the rollout path), whose completions derive the version from the adapter name, so
the version check is weaker there.

Left out: real SGLang (its unload hangs, sglang#36894, are what the protocol avoids), several engines,
store-path loads (`benchmarks/sync_latency.py` times those).
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import random
import statistics
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

from lora_rl_core.engines.base import PAUSE_MODES, GenerationRequest, SamplingParams, adapter_version
from lora_rl_core.errors import EngineError, LoraRLError

AdapterFactory = Callable[[int], tuple[dict[str, torch.Tensor], dict[str, Any]]]
"""version -> (PEFT-keyed LoRA state dict, PEFT config dict)."""

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
    retire: Literal["subscriber", "engine"] = "subscriber"


@dataclass
class StressReport:
    """Counts of one stress run; `violations()` are the invariants (all must be 0), `ok` says they are."""

    target: str
    samples: str
    retire: str
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
    latency_p99_s: float = 0.0
    latency_max_s: float = 0.0
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
class _Sample:
    """One sample's outcome as the engine reported it."""

    request_id: str
    finish: str
    adapter: str | None
    version: int | None
    abort_reason: str | None


@dataclass
class _Group:
    """One client call: `n` samples of one prompt naming one version."""

    rid: str
    name: str
    n: int
    submit_seq: int = -1
    end_seq: int = -1
    seconds: float = 0.0
    samples: list[_Sample] = field(default_factory=list)
    error: str | None = None
    rejected: bool = False


class _EventLog:
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
class _Shared:
    """State the threads share."""

    settings: StressSettings
    log: _EventLog = field(default_factory=_EventLog)
    control: threading.Lock = field(default_factory=threading.Lock)  # pause transitions vs. retiring
    stop: threading.Event = field(default_factory=threading.Event)
    active: str | None = None
    groups: list[_Group] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    late: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    counts: Counter[str] = field(default_factory=Counter)
    retire_started: dict[str, int] = field(default_factory=dict)  # name -> sequence of the retire call's start
    deadline: float = 0.0

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


# ----------------------------------------------------------------------------- targets


class _Target:
    """The engine calls the stress run makes; `_InProcess` and `_Http` fill in how."""

    samples = "group"

    def __init__(self, engine: Any, settings: StressSettings) -> None:
        self.engine = engine
        self.settings = settings

    def send(self, group: _Group, prompt: list[int], params: SamplingParams) -> list[_Sample]:
        """`n` requests sharing the prompt through `engine.generate` (raises EngineError when refused)."""
        requests = [
            GenerationRequest(prompt, group.name, params, request_id=f"{group.rid}-{j}") for j in range(group.n)
        ]
        done = self.engine.generate(requests, timeout_s=self.settings.request_timeout_s)
        return [_Sample(c.request_id, c.finish_reason, c.adapter, c.adapter_version, c.abort_reason) for c in done]

    def abort_ids(self, group: _Group, which: int | None) -> list[str]:
        """Request ids to abort: sample `which` of the group, or all of them (None)."""
        return [f"{group.rid}-{j}" for j in range(group.n) if which is None or j == which]

    def load(self, name: str, tensors: dict, config: dict) -> None:
        """Load one version from tensors (the tensor path)."""
        self.engine.load_adapter(name, tensors=tensors, config=config, timeout_s=self.settings.control_timeout_s)

    def retire(self, active: str) -> list[str]:
        """Unload stale versions: `subscriber.retire_stale` (skips a paused engine) or the engine's own."""
        s = self.settings
        if s.retire == "engine":
            return self.engine.retire_stale(s.run_id, active=active)
        from lora_rl_core.subscriber import retire_stale  # lazy: the store (pydantic) only when used

        return retire_stale(self.engine, s.run_id, keep=s.keep, protect={active})

    def in_flight(self) -> int:
        """Requests holding an adapter now (sum over adapters)."""
        return sum(int(info.get("in_flight") or 0) for info in self.engine.list_adapters().values())

    def close(self) -> None:
        """Release what the target opened."""


class _InProcess(_Target):
    """An `EmbeddedEngine` in this process."""


class _Http(_Target):
    """Our engine server over HTTP through `ServerEngine`; `samples="n"` sends SGLang's `n` itself."""

    def __init__(self, engine: Any, settings: StressSettings) -> None:
        super().__init__(engine, settings)
        import httpx

        self.samples = settings.samples or "n"
        limits = httpx.Limits(max_connections=settings.clients + 8)
        self._http = httpx.Client(base_url=engine.url, timeout=settings.request_timeout_s, limits=limits)

    def send(self, group: _Group, prompt: list[int], params: SamplingParams) -> list[_Sample]:
        """One `/generate` with `sampling_params.n` (or the group path); versions from `weight_version`."""
        if self.samples == "group":
            return super().send(group, prompt, params)
        sampling = {"max_new_tokens": params.max_new_tokens, "temperature": params.temperature, "n": group.n}
        body = {"input_ids": prompt, "sampling_params": sampling, "lora_path": group.name, "rid": group.rid}
        response = self._http.post("/generate", json=body)
        if response.status_code >= 400:
            raise EngineError(f"HTTP {response.status_code}: {response.text[:300]}")
        outs = response.json()
        return [_http_sample(o) for o in (outs if isinstance(outs, list) else [outs])]

    def abort_ids(self, group: _Group, which: int | None) -> list[str]:
        """With SGLang's n the server maps the group's rid to all its samples; single samples are `rid-j`."""
        if self.samples == "n" and which is None:
            return [group.rid]
        return super().abort_ids(group, which)

    def close(self) -> None:
        """Close the HTTP connections opened for `samples="n"`."""
        self._http.close()


def _http_sample(out: dict[str, Any]) -> _Sample:
    meta = out.get("meta_info") or {}
    finish = meta.get("finish_reason") or {}
    kind = finish.get("type") if isinstance(finish, dict) else finish
    reason = finish.get("message") if isinstance(finish, dict) and kind == "abort" else None
    return _Sample(str(meta.get("id")), str(kind), meta.get("lora_path"), meta.get("weight_version"), reason)


def _target(engine: Any, settings: StressSettings) -> tuple[_Target, bool]:
    """The target for an engine or URL; True when this function opened the client (and must close it)."""
    owned = isinstance(engine, str)
    if owned:
        from lora_rl_core.engines.http import ServerEngine

        engine = ServerEngine(
            engine, timeout_s=settings.request_timeout_s, control_timeout_s=settings.control_timeout_s
        )
    if hasattr(engine, "url"):
        if settings.retire == "engine":
            raise EngineError("retire='engine' calls EmbeddedEngine.retire_stale: in-process only")
        return _Http(engine, settings), owned
    if settings.samples == "n":
        raise EngineError("samples='n' (SGLang's n) needs an HTTP target; in-process groups are n requests")
    return _InProcess(engine, settings), False


# ----------------------------------------------------------------------------- threads


def _swapper(target: _Target, shared: _Shared, make_adapter: AdapterFactory) -> None:
    s = shared.settings
    rng = random.Random(s.seed)
    for version in range(1, s.swaps + 1):
        if time.monotonic() > shared.deadline:
            break
        name = f"{s.run_id}-v{version:06d}"
        tensors, config = make_adapter(version)
        shared.log.mark("load_start", name)
        try:
            shared.timed(f"load {name}", s.control_timeout_s, lambda: target.load(name, tensors, config))  # noqa: B023
        except LoraRLError as exc:
            shared.count(swap_failures=1)
            shared.fail(f"load {name}", exc)
            continue
        shared.log.mark("load_done", name)
        shared.active = name
        shared.count(swaps=1)
        _retire(target, shared, name)
        time.sleep(rng.uniform(0, 2 * s.swap_interval_s))


def _retire(target: _Target, shared: _Shared, active: str) -> None:
    """Retire under the control lock, so no pause transition happens while an unload is being decided."""
    limit = shared.settings.control_timeout_s * (shared.settings.keep + 1)
    with shared.control:
        start = shared.log.mark("retire_start")
        try:
            retired = shared.timed("retire", limit, lambda: target.retire(active))
        except LoraRLError as exc:
            shared.fail("retire", exc)
            return
        for name in retired:
            shared.retire_started.setdefault(name, start)
            shared.log.mark("unloaded", name)
    shared.count(retired=len(retired))


def _client(index: int, target: _Target, shared: _Shared, aborts: _Aborter) -> None:
    s = shared.settings
    rng = random.Random(s.seed * 1000 + index)
    while not shared.stop.is_set() and time.monotonic() < shared.deadline:
        name = shared.active
        if name is None:
            time.sleep(0.01)
            continue
        prompt = [rng.randrange(4, s.vocab_size) for _ in range(rng.randint(*s.prompt_len))]
        params = SamplingParams(max_new_tokens=rng.choice(s.max_new_tokens), temperature=1.0)
        group = _Group(rid=uuid.uuid4().hex[:16], name=name, n=s.n)
        if rng.random() < s.abort_prob:
            which = None if rng.random() < 0.3 else rng.randrange(s.n)
            aborts.schedule(rng.uniform(0, s.max_abort_delay_s), target.abort_ids(group, which))
        _send(target, shared, group, prompt, params)


def _send(target: _Target, shared: _Shared, group: _Group, prompt: list[int], params: SamplingParams) -> None:
    limit = shared.settings.request_timeout_s
    group.submit_seq = shared.log.tick()
    start = time.monotonic()
    try:
        group.samples = shared.timed(f"generate {group.rid}", limit, lambda: target.send(group, prompt, params))
    except LoraRLError as exc:
        group.error, group.rejected = str(exc), _is_unknown_adapter(str(exc))
    except Exception as exc:  # an HTTP transport error, a bug: recorded as an error, never swallowed silently
        group.error = f"{type(exc).__name__}: {exc}"
    group.seconds = time.monotonic() - start
    group.end_seq = shared.log.tick()
    with shared.lock:
        shared.groups.append(group)


def _is_unknown_adapter(message: str) -> bool:
    return "has never been loaded or was unloaded" in message


class _Aborter:
    """Aborts request ids at scheduled times: one thread keeps a heap of due times and hands each due abort
    to a small pool, so slow abort calls (HTTP) don't make later aborts late."""

    def __init__(self, target: _Target, shared: _Shared, workers: int = 4) -> None:
        self.target, self.shared = target, shared
        self._heap: list[tuple[float, int, list[str]]] = []
        self._cond = threading.Condition()
        self._order = itertools.count()
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="stress-abort")

    def schedule(self, delay_s: float, request_ids: list[str]) -> None:
        """Abort `request_ids` after `delay_s` seconds (they may have ended by then: a no-op)."""
        with self._cond:
            heapq.heappush(self._heap, (time.monotonic() + delay_s, next(self._order), request_ids))
            self._cond.notify()

    def run(self) -> None:
        """Until stop: wait for the next due abort and send it; then wait for the sends in progress."""
        while not self.shared.stop.is_set():
            with self._cond:
                wait = self._heap[0][0] - time.monotonic() if self._heap else 0.1
                if wait > 0:
                    self._cond.wait(min(wait, 0.1))
                    continue
                _, _, ids = heapq.heappop(self._heap)
            self._pool.submit(self._abort, ids)
        self._pool.shutdown(wait=True, cancel_futures=True)

    def _abort(self, ids: list[str]) -> None:
        limit = self.shared.settings.control_timeout_s
        for rid in ids:
            try:
                hits = self.shared.timed(f"abort {rid}", limit, lambda: self.target.engine.abort(rid))  # noqa: B023
            except LoraRLError:
                hits, failed = 0, 1
            else:
                failed = 0
            self.shared.count(abort_calls=1, aborts_acknowledged=int(hits), abort_failures=failed)


def _pauser(target: _Target, shared: _Shared) -> None:
    s = shared.settings
    rng = random.Random(s.seed + 7)
    while not shared.stop.is_set() and time.monotonic() < shared.deadline:
        shared.stop.wait(s.pause_tick_s)
        if rng.random() >= s.pause_prob or shared.stop.is_set():
            continue
        mode = rng.choice(PAUSE_MODES)
        try:
            _toggle(shared, f"pause:{mode}", lambda: target.engine.pause(mode))  # noqa: B023
            shared.stop.wait(rng.uniform(0, s.max_pause_s))
        finally:  # resume even when the pause call failed: it may have taken effect
            _toggle(shared, "resume", target.engine.resume)


def _toggle(shared: _Shared, kind: str, call: Callable[[], Any]) -> None:
    """Pause or resume under the control lock; the paused interval is marked conservatively wide (pause
    marked before the call, resume after it). A failed call is recorded, not raised."""
    with shared.control:
        if kind != "resume":
            shared.log.mark("pause")
            shared.count(**{kind: 1})
        try:
            shared.timed(kind, shared.settings.control_timeout_s, call)
        except LoraRLError as exc:
            shared.fail(kind, exc)
        if kind == "resume":
            shared.log.mark("resume")


# ----------------------------------------------------------------------------- run + check


def run_hotswap_stress(
    engine: Any,
    make_adapter: AdapterFactory,
    *,
    swaps: int = 200,
    clients: int = 32,
    n: int = 4,
    deadline_s: float = 600.0,
    abort_prob: float = 0.1,
    pause_prob: float = 0.1,
    seed: int = 0,
    **options: Any,
) -> StressReport:
    """Swap `swaps` adapter versions while `clients` threads sample groups of `n`, with random aborts and
    pauses; then check the invariants (see the module docstring).

    Args:
        engine: an `EmbeddedEngine` (in-process), a `ServerEngine`, or our engine server's URL.
        make_adapter: version -> (PEFT-keyed LoRA tensors, PEFT config) for that version's weights;
            `random_lora_factory(model)` makes small random ones.
        swaps, clients, n: versions loaded, client threads, samples per group.
        deadline_s: the whole run's deadline (s): threads still alive then are hangs.
        abort_prob: probability that a group gets an abort (of one sample, or of the whole group).
        pause_prob: probability per pauser tick (`pause_tick_s`) of a pause.
        seed: seeds prompts, sampling of delays and modes (thread timing is not reproducible).
        options: other `StressSettings` fields (e.g. `vocab_size`, `keep`, `samples`, `retire`).

    Returns:
        The `StressReport`; `report.ok` is True when no invariant was breached. Never raises for a breach.
    """
    settings = StressSettings(
        swaps=swaps, clients=clients, n=n, deadline_s=deadline_s, abort_prob=abort_prob, pause_prob=pause_prob,
        seed=seed, **options,
    )  # fmt: skip
    target, owned = _target(engine, settings)
    try:
        return _run(target, settings, make_adapter)
    finally:
        target.close()
        if owned:
            target.engine.close()


def _run(target: _Target, settings: StressSettings, make_adapter: AdapterFactory) -> StressReport:
    shared = _Shared(settings)
    start = time.monotonic()
    shared.deadline = start + settings.deadline_s
    aborter = _Aborter(target, shared)
    swapper = _thread(shared, "swapper", _swapper, target, shared, make_adapter)
    threads = [_thread(shared, f"client-{i}", _client, i, target, shared, aborter) for i in range(settings.clients)]
    threads += [_thread(shared, "pauser", _pauser, target, shared), _thread(shared, "aborter", aborter.run)]
    swapper.join(max(0.0, shared.deadline - time.monotonic()))
    time.sleep(min(1.0, max(0.0, shared.deadline - time.monotonic())))  # let the last version serve a while
    shared.stop.set()
    for t in [swapper, *threads]:
        t.join(max(0.1, shared.deadline - time.monotonic()))
    hung = [t.name for t in [swapper, *threads] if t.is_alive()]
    report = _report(target, shared, time.monotonic() - start)
    report.hangs = len(hung)
    report.examples += [f"thread alive at the deadline: {name}" for name in hung][:5]
    report.leaked_in_flight = 0 if hung else _settled_in_flight(target)
    report.final_probe_failed = 0 if hung else int(not _probe(target, shared))
    return report


def _thread(shared: _Shared, name: str, fn: Callable[..., None], *args: Any) -> threading.Thread:
    """Start a daemon thread running `fn(*args)`; an exception that escapes it is recorded as an error."""

    def guarded() -> None:
        try:
            fn(*args)
        except BaseException as exc:  # a crashed thread must show in the report, not only on stderr
            shared.fail(f"thread {name} crashed", exc)

    thread = threading.Thread(target=guarded, name=f"stress-{name}", daemon=True)
    thread.start()
    return thread


def _settled_in_flight(target: _Target, wait_s: float = 10.0) -> int:
    """Requests still holding an adapter after everything ended (polled up to `wait_s`)."""
    deadline = time.monotonic() + wait_s
    while True:
        held = target.in_flight()
        if held == 0 or time.monotonic() > deadline:
            return held
        time.sleep(0.1)


def _probe(target: _Target, shared: _Shared) -> bool:
    """One greedy 1-token request on the active version completes with that version."""
    if shared.active is None:
        return False
    prompt = [min(4, shared.settings.vocab_size - 1)] * 3
    request = GenerationRequest(prompt, shared.active, SamplingParams(max_new_tokens=1, temperature=0.0))
    try:
        done = target.engine.generate([request], timeout_s=shared.settings.control_timeout_s)
    except LoraRLError:
        return False
    ok = len(done) == 1 and done[0].finish_reason in ("stop", "length")
    return ok and done[0].adapter_version == adapter_version(shared.active)


def _report(target: _Target, shared: _Shared, wall_s: float) -> StressReport:
    s = shared.settings
    report = StressReport(
        target=getattr(target.engine, "url", type(target.engine).__name__),
        samples=target.samples,
        retire=s.retire,
        settings=dataclasses.asdict(s),
        wall_s=wall_s,
    )
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


def _check_groups(report: StressReport, shared: _Shared) -> None:
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
        report.latency_p99_s = sorted(latencies)[min(len(latencies) - 1, int(0.99 * len(latencies)))]


def _check_refused(report: StressReport, g: _Group, retire_started: dict[str, int]) -> None:
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
    report: StressReport, g: _Group, loaded: dict[str, int], unloaded: dict[str, int], aborted: Counter[str]
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
        if sample.finish not in ("stop", "length"):
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


def _unloads_while_paused(log: _EventLog, report: StressReport) -> int:
    """Unload events inside a paused interval (pause marked before the call, resume after it)."""
    paused = log.intervals("pause", "resume")
    bad = [(seq, name) for seq, kind, name in log.events if kind == "unloaded" and _inside(seq, paused)]
    report.examples += [f"{name} unloaded while paused (event {seq})" for seq, name in bad[:5]]
    return len(bad)


def _inside(seq: int, intervals: list[tuple[int, int]]) -> bool:
    return any(a < seq < b for a, b in intervals)


# ----------------------------------------------------------------------------- adapters


def random_lora_factory(
    model: nn.Module, *, rank: int = 2, targets: tuple[str, ...] = ("q_proj", "v_proj"), scale: float = 0.05
) -> AdapterFactory:
    """Random LoRA weights for `model`'s linear `targets`, fresh for each version (seeded by it).

    Keys are PEFT's (`base_model.model.<module>.lora_A.weight` `[r, in]`, `lora_B.weight` `[out, r]`), as
    `get_peft_model_state_dict` gives; B is non-zero, so versions change the outputs.

    Raises:
        ValueError: no linear module of `model` ends with one of `targets`.
    """
    shapes = {
        name: (m.in_features, m.out_features)
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear) and name.rsplit(".", 1)[-1] in targets
    }
    if not shapes:
        raise ValueError(f"no linear module ends with one of {targets}")
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": sorted(targets)}
    config["task_type"] = "CAUSAL_LM"

    def make(version: int) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        gen = torch.Generator().manual_seed(version)
        tensors = {}
        for name, (n_in, n_out) in shapes.items():
            tensors[f"base_model.model.{name}.lora_A.weight"] = torch.randn(rank, n_in, generator=gen) * scale
            tensors[f"base_model.model.{name}.lora_B.weight"] = torch.randn(n_out, rank, generator=gen) * scale
        return tensors, dict(config)

    return make


# ----------------------------------------------------------------------------- server


@contextmanager
def serve_in_thread(engine: Any, *, start_timeout_s: float = 15.0, **app_options: Any) -> Iterator[str]:
    """Serve `engine` with our engine server (uvicorn, in a daemon thread) on a free 127.0.0.1 port.

    Args:
        engine: the engine to serve (normally an `EmbeddedEngine`).
        start_timeout_s: how long to wait for uvicorn to start (s).
        app_options: `create_app` arguments (default `served_model_name="stress"`).

    Yields:
        The server's URL, e.g. `http://127.0.0.1:40123`; the server stops on exit.

    Raises:
        RuntimeError: uvicorn did not start in time.
    """
    import socket

    import uvicorn

    from lora_rl_core.engines.server import create_app

    app = create_app(engine, **{"served_model_name": "stress", **app_options})
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="stress-server", daemon=True)
    thread.start()
    deadline = time.monotonic() + start_timeout_s
    try:
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the engine server did not start")
            time.sleep(0.02)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()
