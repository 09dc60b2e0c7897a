"""One whole step of a run on a timeline (issue 34, item 4): `torch.profiler` over the step, CPU ops and CUDA
kernels of this process, with a named range for every phase and for the run's calls into its trainer, store,
store writer, engines and launched servers. SGLang runs in its own process: its work shows here as the
ranges of the calls that wait for it (a rollout's `generate`, a sync's `load_adapter`, the KV cache's
`release_memory` / `resume_memory`).

`StepTimeline(run, at, out)` names those calls (instance attributes wrap the methods: nothing in the library
changes), starts the profiler when step `at - 1` ends and stops it when step `at` ends, then writes
`<out>.trace.json.gz` (Chrome trace format: open it in https://ui.perfetto.dev) and `<out>.timeline.txt`: for
every range on the main thread, its seconds and, below it, the ranges it contains and its heaviest CPU ops
and its GPU kernel time. The profiled step is slower than the others (the profiler's own cost): its
`step_seconds` is left out of the medians (`gpu_scale.py` marks it `profiled`).
"""

from __future__ import annotations

import contextlib
import functools
import gzip
import json
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

# The run's parts the timeline names, and the methods of each (a missing one is skipped).
WATCHED: dict[str, tuple[str, ...]] = {
    "trainer": ("train_step", "adapter_state", "gather_adapter_state", "state_dict", "gather_state_dict"),
    "store": ("check", "unwritten_ref", "prepare", "write", "verify", "ref"),
    "writer": ("submit", "check"),
    "run_dir": ("write_phase", "read_phase"),
    "checkpoints": ("save",),
    "rewards": ("score",),
}
ENGINE_METHODS = ("generate", "load_adapter", "unload_adapter", "list_adapters", "pause", "resume", "flush_cache")
SERVER_METHODS = ("release_memory", "resume_memory")


def _named(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` inside a `record_function(name)` range."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with torch.profiler.record_function(name):
            return fn(*args, **kwargs)

    return wrapper


def _wrap(obj: Any, label: str, methods: tuple[str, ...]) -> None:
    """Wrap those of `obj`'s `methods` it has in ranges named `label.method` (instance attributes)."""
    for method in methods:
        fn = getattr(obj, method, None)  # the trainer kinds differ (a sharded one has no gather_adapter_state)
        if not callable(fn):
            continue
        with contextlib.suppress(AttributeError, TypeError, ValueError):  # slots, frozen, pydantic: unnamed
            setattr(obj, method, _named(f"{label}.{method}", fn))


class StepTimeline:
    """The profiler over step `at` of `run` (module docstring); `phase(name)` is the range of a phase.

    Args:
        run: the run's `RunComponents`.
        at: the step to profile (>= 2: step 1 pays compilation and cold caches).
        out: path prefix of the files written (`<out>.trace.json.gz`, `<out>.timeline.txt`).
    """

    def __init__(self, run: Any, at: int, out: Path) -> None:
        if at < 2:
            raise ValueError(f"--timeline-step must be >= 2 (step 1 pays compilation), got {at}")
        self.at, self.out = at, out
        self.report = ""
        self._profiler: torch.profiler.profile | None = None
        for attr, methods in WATCHED.items():
            _wrap(getattr(run, attr), attr, methods)
        engine = run.built.engine
        members = engine.members()  # the engine itself, or the replicas of a multi-engine
        for i, member in enumerate(members):
            _wrap(member, f"engine[{i}]", ENGINE_METHODS)
        if engine not in members:
            _wrap(engine, "engine", ENGINE_METHODS)
        for i, server in enumerate(run.built.servers):
            _wrap(server, f"server[{i}]", SERVER_METHODS)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """The range `phase:<name>` while the profiler runs (nothing otherwise)."""
        if self._profiler is None:
            yield
            return
        with torch.profiler.record_function(f"phase:{name}"):
            yield

    def on_step(self, step: int) -> None:
        """Call when step `step` ends: starts the profiler after step `at - 1`, stops and writes after `at`."""
        if step == self.at - 1:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._profiler = torch.profiler.profile(activities=activities)
            self._profiler.__enter__()
            self._step_range = torch.profiler.record_function(f"step {self.at}")
            self._step_range.__enter__()
        elif step == self.at and self._profiler is not None:
            self._step_range.__exit__(None, None, None)
            self._profiler.__exit__(None, None, None)
            raw = self.out.with_name(self.out.name + ".trace.json")
            self._profiler.export_chrome_trace(str(raw))
            self._profiler = None
            data = raw.read_bytes()
            Path(str(raw) + ".gz").write_bytes(gzip.compress(data))
            raw.unlink()
            self.report = summarize_trace(json.loads(data), f"step {self.at}")
            self.out.with_name(self.out.name + ".timeline.txt").write_text(self.report)


GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
"""The trace categories of work on the GPU."""


def gpu_spans(events: list[dict[str, Any]]) -> list[tuple[float, float]]:
    """(start, end) in us of every GPU event (`GPU_CATEGORIES`, complete events) of a trace, sorted by start."""
    gpu = (e for e in events if e.get("ph") == "X" and e.get("cat") in GPU_CATEGORIES)
    return sorted((e["ts"], e["ts"] + e["dur"]) for e in gpu)


def busy_us(spans: list[tuple[float, float]], start: float, end: float) -> float:
    """Microseconds of [`start`, `end`) during which the GPU ran something: the union of `spans` (sorted by
    start, `gpu_spans`) clipped to the window, so kernels of several streams that overlap count once."""
    busy, covered = 0.0, start
    for a, b in spans:
        if a >= end:
            break
        b = min(b, end)
        busy += max(0.0, b - max(a, covered))
        covered = max(covered, b)
    return busy


def summarize_trace(trace: dict[str, Any], root: str, top_ops: int = 6) -> str:
    """A text outline of a Chrome trace from `torch.profiler`: the range named `root` and every range inside it
    on the same thread, indented by depth, each with its milliseconds, its heaviest CPU ops (`top_ops`, by
    total time, counting nested ops once) and how long the GPU was busy while it was open (`busy_us`).

    Args:
        trace: the exported trace (`{"traceEvents": [...]}`; complete events `ph: X`, `ts`/`dur` in us).
        root: the name of the outermost range.

    Raises:
        ValueError: no range named `root` in the trace.
    """
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    ranges = [e for e in events if e.get("cat") == "user_annotation"]
    top = next((e for e in ranges if e["name"] == root), None)
    if top is None:
        raise ValueError(f"no range named {root!r} in the trace")
    tid, t0, t1 = top["tid"], top["ts"], top["ts"] + top["dur"]
    inside = sorted(  # ranges under 0.1 ms (an in-memory lookup) would only crowd the outline
        (e for e in ranges if e["tid"] == tid and t0 <= e["ts"] and e["ts"] + e["dur"] <= t1 and e["dur"] >= 100),
        key=lambda e: (e["ts"], -e["dur"]),
    )
    ops = sorted(
        (e for e in events if e.get("cat") == "cpu_op" and e["tid"] == tid and t0 <= e["ts"] <= t1),
        key=lambda e: (e["ts"], -e["dur"]),
    )
    spans = gpu_spans(events)
    lines = [f"{root} (main thread; ranges of 0.1 ms or more; GPU: ms it was busy while the range was open)"]
    stack: list[dict[str, Any]] = []
    for r in inside:
        while stack and r["ts"] >= stack[-1]["ts"] + stack[-1]["dur"]:
            stack.pop()
        depth = len(stack)
        stack.append(r)
        end = r["ts"] + r["dur"]
        gpu_ms = busy_us(spans, r["ts"], end) / 1e3
        lines.append(f"{'  ' * depth}{r['name']}: {r['dur'] / 1e3:.1f} ms, GPU {gpu_ms:.1f} ms")
        heavy = _top_level_ops([o for o in ops if r["ts"] <= o["ts"] and o["ts"] + o["dur"] <= end])
        for name, ms in heavy[:top_ops]:
            if ms >= 0.5:
                lines.append(f"{'  ' * (depth + 1)}- {name}: {ms:.1f} ms")
    return "\n".join(lines) + "\n"


def _top_level_ops(ops: list[dict[str, Any]]) -> list[tuple[str, float]]:
    """Milliseconds by op name, over the ops not nested in another op of the list (sorted by start)."""
    totals: dict[str, float] = defaultdict(float)
    end = -1.0
    for o in ops:
        if o["ts"] >= end:
            totals[o["name"]] += o["dur"] / 1e3
            end = o["ts"] + o["dur"]
    return sorted(totals.items(), key=lambda kv: -kv[1])
