"""`benchmarks/_timeline.py`'s outline of a step's Chrome trace: ranges nested by time on the step's thread,
each with its heaviest top-level CPU ops and the GPU kernel time while it was open; other threads and
ranges under 0.1 ms left out."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
timeline = importlib.import_module("_timeline")


def _event(name: str, cat: str, ts: float, dur: float, tid: int = 1) -> dict:
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "tid": tid, "pid": 1}


def _trace() -> dict:
    return {
        "traceEvents": [
            _event("step 3", "user_annotation", 0, 10_000),
            _event("phase:publish", "user_annotation", 1_000, 4_000),
            _event("trainer.adapter_state", "user_annotation", 1_100, 2_000),
            _event("aten::to", "cpu_op", 1_200, 1_500),
            _event("aten::copy_", "cpu_op", 1_300, 1_000),  # inside aten::to: counted once, as aten::to
            _event("store.check", "user_annotation", 3_200, 1_500),
            _event("aten::sum", "cpu_op", 3_300, 600),
            _event("aten::sum", "cpu_op", 4_000, 600),
            _event("writer.check", "user_annotation", 4_800, 50),  # under 0.1 ms: left out
            _event("phase:sync", "user_annotation", 6_000, 3_000),
            _event("kernel_a", "kernel", 6_500, 700, tid=7),
            _event("writer.serialise", "user_annotation", 6_000, 2_000, tid=2),  # another thread
        ]
    }


def test_outline_nests_ranges_and_counts_ops_and_kernels():
    lines = timeline.summarize_trace(_trace(), "step 3").splitlines()
    assert lines[1] == "step 3: 10.0 ms, GPU 0.7 ms"
    publish = lines.index("  phase:publish: 4.0 ms, GPU 0.0 ms")
    assert lines[publish + 1 : publish + 3] == ["    - aten::to: 1.5 ms", "    - aten::sum: 1.2 ms"]
    assert "    trainer.adapter_state: 2.0 ms, GPU 0.0 ms" in lines
    assert "      - aten::to: 1.5 ms" in lines and not any("aten::copy_" in line for line in lines)
    assert "    store.check: 1.5 ms, GPU 0.0 ms" in lines and "      - aten::sum: 1.2 ms" in lines
    assert "  phase:sync: 3.0 ms, GPU 0.7 ms" in lines
    assert not any("writer." in line for line in lines)


def test_outline_needs_its_root_range():
    with pytest.raises(ValueError, match="no range named 'step 9'"):
        timeline.summarize_trace(_trace(), "step 9")


def test_a_timeline_starts_after_step_one():
    with pytest.raises(ValueError, match="must be >= 2"):
        timeline.StepTimeline(object(), 1, Path("unused"))


def test_gpu_busy_time_counts_overlapping_streams_once_within_the_window():
    spans = timeline.gpu_spans(
        [
            _event("k1", "kernel", 0, 100),
            _event("k2", "kernel", 50, 100),  # another stream, overlapping k1: 0..150 busy
            _event("copy", "gpu_memcpy", 300, 50),
            _event("op", "cpu_op", 0, 1_000),  # not GPU work
        ]
    )
    assert spans == [(0, 100), (50, 150), (300, 350)]
    assert timeline.busy_us(spans, 0, 1_000) == 200
    assert timeline.busy_us(spans, 120, 320) == 30 + 20  # clipped at both ends
    assert timeline.busy_us(spans, 400, 500) == 0
