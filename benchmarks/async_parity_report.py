"""Learning parity of async rollouts over many seeds: merge `async_rollouts.py` records and report the gaps.

`benchmarks/gpu/async_parity.sh` runs `async_rollouts.py` in several processes at once (one JSON each, some
seeds each); this merges them (plain or gzipped JSON, several records per file allowed) and reports, per
variant against the baseline (each record's first variant), seed by seed: the final greedy accuracy (the
flow's engine), the mean greedy accuracy of the last versions checked with transformers + PEFT
(`--check-versions`), and the sampled batch accuracy of the last 5 steps. Per variant: the mean, median,
standard deviation and a 95 % confidence interval of the mean gap (Student t), the seeds within 5 points,
and the runs that ended below half the baseline's mean final accuracy (collapsed).

Usage::

    python benchmarks/async_parity_report.py benchmarks/results/gpu-async/async_parity_runs.json.gz \\
        --out benchmarks/results/gpu-async/async_parity_summary.json
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import _common
from _common import print_table, write_json

METRICS = ("final_accuracy", "check_accuracy_mean", "reward_mean_last5")
T_975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
         12: 2.179, 15: 2.131, 20: 2.086, 25: 2.060, 30: 2.042, 40: 2.021, 60: 2.000, 120: 1.980}  # fmt: skip
"""Two-sided 95 % quantiles of Student's t by degrees of freedom (tables; the nearest lower entry is used)."""


def load_records(paths: list[Path]) -> list[dict[str, Any]]:
    """The `async_rollouts.py` records in `paths` (`.json` or `.json.gz`; a file holds one record or a list)."""
    records: list[dict[str, Any]] = []
    for path in paths:
        text = gzip.decompress(path.read_bytes()).decode() if path.suffix == ".gz" else path.read_text()
        data = json.loads(text)
        records.extend(data if isinstance(data, list) else [data])
    return records


def _t975(df: int) -> float:
    return T_975[max(k for k in T_975 if k <= df)]


def _stats(gaps: list[float]) -> dict[str, Any]:
    """The gaps (points, seed order) with their mean, median, standard deviation and the 95 % confidence
    interval of the mean."""
    n = len(gaps)
    mean = statistics.mean(gaps)
    sd = statistics.stdev(gaps) if n > 1 else None
    half = _t975(n - 1) * sd / n**0.5 if sd is not None else None
    return {
        "values": gaps,
        "n": n,
        "mean": mean,
        "median": statistics.median(gaps),
        "sd": sd,
        "ci95": None if half is None else [mean - half, mean + half],
        "within_5": sum(abs(g) <= 5.0 for g in gaps),
    }


def _below(run: dict[str, Any], threshold: float) -> bool:
    return run.get("final_accuracy") is not None and run["final_accuracy"] < threshold


def parity(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Per variant other than the baseline: per-seed accuracies and gaps (points) and their statistics.

    Raises:
        ValueError: records with different baselines, or a seed run twice in one variant.
    """
    baselines = {r["baseline"] for r in records}
    if len(baselines) != 1:
        raise ValueError(f"records compare with different baselines: {sorted(baselines)}")
    baseline = baselines.pop()
    runs: dict[str, dict[Any, dict[str, Any]]] = {}
    for record in records:
        for r in record["results"]:
            seeds = runs.setdefault(r["variant"], {})
            if r["seed"] in seeds:
                raise ValueError(f"seed {r['seed']} of variant {r['variant']} appears twice")
            seeds[r["seed"]] = r
    base = runs.pop(baseline, {})
    finals = [r["final_accuracy"] for r in base.values() if r.get("final_accuracy") is not None]
    base_final = statistics.mean(finals) if finals else 0.0
    report: dict[str, Any] = {"baseline": baseline, "baseline_seeds": len(base), "variants": {}}
    for name, seeds in runs.items():
        common = sorted(set(seeds) & set(base), key=str)
        if not common:
            continue
        per_seed = [
            {
                "seed": s,
                **{
                    f"{m}_{v}": 100 * run[m]
                    for m in METRICS
                    for v, run in ((baseline, base[s]), (name, seeds[s]))
                    if run.get(m) is not None
                },
            }
            for s in common
        ]
        stats: dict[str, Any] = {}
        for m in METRICS:
            gaps = [
                100 * (seeds[s][m] - base[s][m])
                for s in common
                if seeds[s].get(m) is not None and base[s].get(m) is not None
            ]
            if gaps:
                stats[m] = _stats(gaps)
        report["variants"][name] = {
            "seeds": common,
            "per_seed": per_seed,
            "gaps": stats,
            "collapsed": [s for s in common if _below(seeds[s], base_final / 2)],
            "baseline_collapsed": [s for s in common if _below(base[s], base_final / 2)],
            "step_seconds_ratio": statistics.mean(base[s]["step_seconds_mean"] for s in common)
            / statistics.mean(seeds[s]["step_seconds_mean"] for s in common),
        }
    return report


def main() -> int:
    """Merge, print the per-variant gap table, write the JSON summary."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("records", nargs="+", type=Path, help="async_rollouts.py JSON files (.json or .json.gz)")
    parser.add_argument("--out", type=Path, default=None, help="write the summary JSON here")
    args = parser.parse_args()
    records = load_records(args.records)
    report = parity(records)
    rows = []
    for name, v in report["variants"].items():
        for m, s in v["gaps"].items():
            ci = "-" if s["ci95"] is None else f"[{s['ci95'][0]:+.1f}, {s['ci95'][1]:+.1f}]"
            sd = "-" if s["sd"] is None else f"{s['sd']:.1f}"
            rows.append([name, m, s["n"], f"{s['mean']:+.1f}", f"{s['median']:+.1f}", sd, ci,
                         f"{s['within_5']}/{s['n']}", len(v["collapsed"]), len(v["baseline_collapsed"])])  # fmt: skip
    print_table(
        f"{'variant'} minus {report['baseline']}, points (goal: within 5)",
        ["variant", "metric", "seeds", "mean gap", "median", "sd", "95% CI of mean", "seeds within 5",
         "collapsed", f"{report['baseline']} collapsed"],
        rows,
    )  # fmt: skip
    if args.out:
        machine = records[0].get("machine", {})
        write_json({"machine": machine, "sources": [p.name for p in args.records], **report}, args.out)
    return 0


if __name__ == "__main__":
    assert _common  # puts the checkout on sys.path
    sys.exit(main())
