"""`benchmarks/async_parity_report.py`: merging per-process records and the parity statistics."""

from __future__ import annotations

import gzip
import importlib
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
report = importlib.import_module("async_parity_report")


def _run(variant: str, seed: int, final: float, step_s: float = 2.0) -> dict:
    return {
        "variant": variant,
        "seed": seed,
        "final_accuracy": final,
        "check_accuracy_mean": final,
        "reward_mean_last5": final,
        "step_seconds_mean": step_s,
    }


def _record(runs: list[dict]) -> dict:
    return {"baseline": "sync", "results": runs}


def test_gaps_are_paired_by_seed_across_records_and_files(tmp_path):
    a = _record([_run("sync", 0, 0.70, 4.0), _run("async", 0, 0.66), _run("sync", 1, 0.60, 4.0)])
    b = _record([_run("sync", 2, 0.80, 4.0), _run("async", 2, 0.82), _run("async", 1, 0.20)])
    (tmp_path / "a.json").write_text(json.dumps(a))
    (tmp_path / "b.json.gz").write_bytes(gzip.compress(json.dumps([b]).encode()))

    result = report.parity(report.load_records([tmp_path / "a.json", tmp_path / "b.json.gz"]))

    v = result["variants"]["async"]
    assert v["seeds"] == [0, 1, 2]
    gaps = v["gaps"]["final_accuracy"]
    assert gaps["n"] == 3
    assert gaps["mean"] == pytest.approx((-4.0 - 40.0 + 2.0) / 3)
    assert gaps["median"] == pytest.approx(-4.0)
    assert gaps["within_5"] == 2
    lo, hi = gaps["ci95"]
    assert lo < gaps["mean"] < hi and hi - lo == pytest.approx(2 * 4.303 * gaps["sd"] / 3**0.5)
    assert v["collapsed"] == [1]  # 20 % < half the sync mean (70 %)
    assert v["step_seconds_ratio"] == pytest.approx(2.0)


def test_a_seed_run_twice_or_mixed_baselines_are_refused():
    twice = _record([_run("sync", 0, 0.7), _run("sync", 0, 0.6)])
    with pytest.raises(ValueError, match="seed 0 of variant sync appears twice"):
        report.parity([twice])
    other = {"baseline": "async", "results": []}
    with pytest.raises(ValueError, match="different baselines"):
        report.parity([_record([]), other])
