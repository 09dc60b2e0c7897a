"""Hot-swap stress: adapter swaps under concurrent sampling, aborts and pauses, with the invariants checked.

The hot-swap protocol's acceptance run (docs/HOTSWAP.md); the CI test (`tests/integration/test_hotswap_stress.py`,
reduced size) and the benchmark (`benchmarks/hotswap_stress.py`, full size) both call `run_hotswap_stress`. The
records and the checks are in `lora_rl_testing/stress_report.py`, the random adapters in `lora_rl_testing/adapters.py`.

Threads:

* swapper: `swaps` times, loads `<run>-v000001, ...` from fresh random LoRA tensors (the tensor path), each
  under a new name, makes it the active version, then retires stale versions with `subscriber.retire_stale`
  (what `sync_version` runs) under the control lock, so no unload can overlap a pause: that function skips
  engines that report generation paused (the protocol under test).
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
*admitted* request holds, so requests still queued for a retired version end that way.

Targets: an in-process engine (`EmbeddedEngine`; a group is `n` requests sharing the prompt, through
`generate`), or our engine server over HTTP (a `ServerEngine` or its URL): a group is one SGLang `/generate`
with `sampling_params.n` (`samples="n"`, the default there), whose per-sample `meta_info.weight_version` is
the version the server admitted the sample with; or `samples="group"`, `n` requests through
`ServerEngine.generate` (the rollout path), whose completions derive the version from the adapter name, so
the version check is weaker there.

A real SGLang server (an `SGLangEngine`) is a third kind of target (`stress_targets.SGLangTarget`; what it
can and cannot check is in its docstring): `benchmarks/hotswap_stress.py --targets sglang-group,sglang-n` on the GPU
host.

Left out: several engines, store-path loads (`benchmarks/sync_latency.py` times those).
"""

from __future__ import annotations

import functools
import heapq
import itertools
import random
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from lora_rl_core.adapters import adapter_version
from lora_rl_core.engines.base import PAUSE_MODES, GenerationRequest, SamplingParams
from lora_rl_core.errors import LoraRLError
from lora_rl_testing.adapters import AdapterFactory
from lora_rl_testing.stress_report import Group, Sample, Shared, StressReport, StressSettings, build_report
from lora_rl_testing.stress_targets import LostCall, Target, make_target

__all__ = ["StressReport", "StressSettings", "run_hotswap_stress"]

# ----------------------------------------------------------------------------- threads


def _swapper(target: Target, shared: Shared, make_adapter: AdapterFactory) -> None:
    s = shared.settings
    rng = random.Random(s.seed)
    until = time.monotonic() + s.duration_s
    for version in itertools.count(1):
        done = time.monotonic() >= until if s.duration_s else version > s.swaps
        if done or time.monotonic() > shared.deadline:
            break
        name = f"{s.run_id}-v{version:06d}"
        tensors, config = shared.phase("adapter", functools.partial(make_adapter, version))
        if s.bounded and not shared.phase("room", functools.partial(_make_room, target, shared)):
            break
        shared.log.mark("load_start", name)
        try:
            shared.phase("load", functools.partial(_load, target, shared, name, tensors, config))
        except LoraRLError as exc:
            shared.count(swap_failures=1)
            shared.fail(f"load {name}", exc)
            continue
        shared.log.mark("load_done", name)
        shared.active = name
        shared.count(swaps=1)
        if not s.bounded:
            _retire(target, shared, name)
        time.sleep(rng.uniform(0, 2 * s.swap_interval_s))


def _load(target: Target, shared: Shared, name: str, tensors: dict, config: dict) -> None:
    shared.timed(f"load {name}", shared.settings.control_timeout_s, lambda: target.load(name, tensors, config))


def _make_room(target: Target, shared: Shared) -> bool:
    """Bounded swaps: retire (draining) until at most `keep - 1` versions are loaded, so the next load makes
    `keep`; retried while a pause holds retirement off. False when the run's deadline came first."""
    s = shared.settings
    while time.monotonic() < shared.deadline:
        if shared.active is not None:
            _retire(target, shared, shared.active, keep=s.keep - 1, drain=True)
        if target.loaded(s.run_id) < s.keep:
            return True
        time.sleep(0.02)
    return False


def _retire(target: Target, shared: Shared, active: str, *, keep: int | None = None, drain: bool = False) -> None:
    """Retire under the control lock, so no pause transition happens while an unload is being decided."""
    limit = shared.settings.control_timeout_s * (shared.settings.keep + 1)
    with shared.control:
        start = shared.log.mark("retire_start")
        try:
            retired = shared.timed("retire", limit, lambda: target.retire(active, keep=keep, drain=drain))
        except LoraRLError as exc:
            shared.fail("retire", exc)
            return
        for name in retired:
            shared.retire_started.setdefault(name, start)
            shared.log.mark("unloaded", name)
    shared.count(retired=len(retired))


def _client(index: int, target: Target, shared: Shared, aborts: _Aborter) -> None:
    s = shared.settings
    rng = random.Random(s.seed * 1000 + index)
    while not shared.stop.is_set() and time.monotonic() < shared.deadline:
        name = shared.active
        if name is None:
            time.sleep(0.01)
            continue
        prompt = [rng.randrange(4, s.vocab_size) for _ in range(rng.randint(*s.prompt_len))]
        params = SamplingParams(max_new_tokens=rng.choice(s.max_new_tokens), temperature=1.0)
        group = Group(rid=uuid.uuid4().hex[:16], name=name, n=s.n)
        if rng.random() < s.abort_prob:
            which = None if rng.random() < 0.3 else rng.randrange(s.n)
            aborts.schedule(rng.uniform(0, s.max_abort_delay_s), target.abort_ids(group, which))
        _send(target, shared, group, prompt, params)


def _send(target: Target, shared: Shared, group: Group, prompt: list[int], params: SamplingParams) -> None:
    limit = shared.settings.request_timeout_s
    group.submit_seq = shared.log.tick()
    start = time.monotonic()
    try:
        group.samples = shared.timed(f"generate {group.rid}", limit, lambda: target.send(group, prompt, params))
    except LostCall as exc:
        if shared.log.paused_after(group.submit_seq, "abort"):  # the pause aborted every sample of the call
            version = adapter_version(group.name)
            group.samples = [Sample(f"{group.rid}-{j}", "abort", group.name, version, "paused") for j in range(group.n)]
        else:
            group.error = str(exc)
    except LoraRLError as exc:
        group.error, group.rejected = str(exc), _is_unknown_adapter(str(exc))
    except Exception as exc:  # an HTTP transport error, a bug: recorded as an error, never swallowed silently
        group.error = f"{type(exc).__name__}: {exc}"
    group.seconds = time.monotonic() - start
    group.end_seq = shared.log.tick()
    with shared.lock:
        shared.groups.append(group)


def _is_unknown_adapter(message: str) -> bool:
    return "has never been loaded" in message  # SGLang's wording, ours and our client's for a retired name


class _Aborter:
    """Aborts request ids at scheduled times: one thread keeps a heap of due times and hands each due abort
    to a small pool, so slow abort calls (HTTP) don't make later aborts late."""

    def __init__(self, target: Target, shared: Shared, workers: int = 4) -> None:
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


def _pauser(target: Target, shared: Shared) -> None:
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


def _toggle(shared: Shared, kind: str, call: Callable[[], Any]) -> None:
    """Pause or resume under the control lock; the paused interval is marked conservatively wide (pause
    marked before the call, resume after it). A failed call is recorded, not raised."""
    with shared.control:
        if kind != "resume":
            shared.log.mark("pause", kind.split(":", 1)[1])
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
        engine: an `EmbeddedEngine` (in-process), a `ServerEngine` or our engine server's URL, or an
            `SGLangEngine` of a real SGLang server.
        make_adapter: version -> (PEFT-keyed LoRA tensors, PEFT config) for that version's weights;
            `random_lora_factory(model)` makes small random ones.
        swaps, clients, n: versions loaded, client threads, samples per group.
        deadline_s: the whole run's deadline (s): threads still alive then are hangs.
        abort_prob: probability that a group gets an abort (of one sample, or of the whole group).
        pause_prob: probability per pauser tick (`pause_tick_s`) of a pause.
        seed: seeds prompts, sampling of delays and modes (thread timing is not reproducible).
        options: other `StressSettings` fields (e.g. `vocab_size`, `keep`, `samples`).

    Returns:
        The `StressReport`; `report.ok` is True when no invariant was breached. Never raises for a breach.
    """
    settings = StressSettings(
        swaps=swaps, clients=clients, n=n, deadline_s=deadline_s, abort_prob=abort_prob, pause_prob=pause_prob,
        seed=seed, **options,
    )  # fmt: skip
    target, owned = make_target(engine, settings)
    try:
        return _run(target, settings, make_adapter)
    finally:
        target.close()
        if owned:
            target.engine.close()


def _run(target: Target, settings: StressSettings, make_adapter: AdapterFactory) -> StressReport:
    shared = Shared(settings)
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
    report = build_report(target.label, target.samples, shared, time.monotonic() - start)
    report.hangs = len(hung)
    report.examples += [f"thread alive at the deadline: {name}" for name in hung][:5]
    report.leaked_in_flight = 0 if hung else _settled_in_flight(target)
    report.final_probe_failed = 0 if hung else int(not _probe(target, shared))
    report.revived_adapters = target.revived()
    if not target.exact_abort_counts:
        report.unaccounted_aborts = 0
        report.examples.append("abort counts are this client's estimates here: unaccounted_aborts not checked")
    return report


def _thread(shared: Shared, name: str, fn: Callable[..., None], *args: Any) -> threading.Thread:
    """Start a daemon thread running `fn(*args)`; an exception that escapes it is recorded as an error."""

    def guarded() -> None:
        try:
            fn(*args)
        except BaseException as exc:  # a crashed thread must show in the report, not only on stderr
            shared.fail(f"thread {name} crashed", exc)

    thread = threading.Thread(target=guarded, name=f"stress-{name}", daemon=True)
    thread.start()
    return thread


def _settled_in_flight(target: Target, wait_s: float = 10.0) -> int:
    """Requests still holding an adapter after everything ended (polled up to `wait_s`); 1 when the engine
    cannot say (an engine that stopped answering is a breach, not a crash of the run)."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            held = target.in_flight()
        except LoraRLError:
            return 1
        if held == 0 or time.monotonic() > deadline:
            return held
        time.sleep(0.1)


def _probe(target: Target, shared: Shared) -> bool:
    """One greedy 1-token request on the active version completes with that version."""
    if shared.active is None:
        return False
    prompt = [min(4, shared.settings.vocab_size - 1)] * 3
    request = GenerationRequest(prompt, shared.active, SamplingParams(max_new_tokens=1, temperature=0.0))
    try:
        done = target.engine.generate([request], timeout_s=shared.settings.control_timeout_s)
    except LoraRLError:
        return False
    ok = len(done) == 1 and done[0].finish_reason in ("stop", "eos", "length")
    return ok and done[0].adapter_version == adapter_version(shared.active)
