"""PPO against GRPO over this folder's GPU runs on the current rules (`SETS`) on the default task: the mean gain
over the base model (held-out greedy accuracy under the fixed grader, strict and flexible, points) per set of
runs and pooled. Left out: the first four-seed runs at the folder's root (85cfebf), `critic-epochs4/`, and
`value-only/`'s PPO runs (before the whitening rule of `policy-scale/`).

    .venv/bin/python benchmarks/results/ppo-vs-grpo/pool.py

Sets: GRPO's first run (`value-only/`, seeds 0-7) and its repeat (`grpo-repeat/`), PPO's two runs with the
policy rows' whitening scale (`policy-scale/`, seeds 0-7 twice), and both at bde04be side by side
(`seeds8-23/`, seeds 8-23). A run "collapsed" where its strict gain is below 20 points.
"""

from __future__ import annotations

import math
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))  # benchmarks/: the parity report's loader

from async_parity_report import load_records  # noqa: E402

SETS = {
    "GRPO, value-only/ (seeds 0-7)": ("value-only/seeds*/parity*_p*.json", "grpo"),
    "GRPO, grpo-repeat/ (seeds 0-7)": ("grpo-repeat/seeds*/parity*_p*.json", "grpo"),
    "GRPO, seeds8-23/ (bde04be)": ("seeds8-23/*/parity_p*.json", "grpo"),
    "PPO, policy-scale/ (seeds 0-7)": ("policy-scale/seeds*/parity*_p*.json", "ppo"),
    "PPO, policy-scale/repeat (seeds 0-7)": ("policy-scale/repeat-seeds*/parity*_p*.json", "ppo"),
    "PPO, seeds8-23/ (bde04be)": ("seeds8-23/*/parity_p*.json", "ppo"),
}


def runs(pattern: str, variant: str) -> list[dict]:
    """The runs of `variant` in the `async_rollouts.py` files matching `pattern` (relative to this folder)."""
    files = load_records(sorted(HERE.glob(pattern)))
    return [r for f in files for r in f["results"] if r["variant"] == variant]


def gains(records: list[dict], grader: str) -> list[float]:
    """Each run's final minus base held-out accuracy under `grader` (`strict`, `flexible`), points."""
    key = f"accuracy/{grader}"
    return [100 * (r["final_eval"][key] - r["base_eval"][key]) for r in records]


def main() -> None:
    """Print the table of sets and the pooled gains with their standard errors."""
    pooled: dict[str, list[dict]] = {"GRPO": [], "PPO": []}
    print("| runs | n | strict gain | flexible gain | collapsed |")
    print("|---|---|---|---|---|")
    for name, (pattern, variant) in SETS.items():
        records = runs(pattern, variant)
        pooled[name.split(",")[0]] += records
        strict, flexible = gains(records, "strict"), gains(records, "flexible")
        collapsed = sum(g < 20 for g in strict)
        means = f"{statistics.mean(strict):.1f} | {statistics.mean(flexible):.1f}"
        print(f"| {name} | {len(records)} | {means} | {collapsed} |")
    for algo, records in pooled.items():
        for grader in ("strict", "flexible"):
            g = gains(records, grader)
            se = statistics.stdev(g) / math.sqrt(len(g))
            spread = f"sd {statistics.stdev(g):.1f}, standard error {se:.1f}"
            print(f"{algo}, all {len(g)} runs, {grader} gain: mean {statistics.mean(g):.1f}, {spread}")


if __name__ == "__main__":
    main()
