"""Sync vs async rollouts, in one run: the training flow twice on the same config (issue: async rollouts).

Runs `flows.grpo_lora.train` with `rollout.mode=sync`, then with `rollout.mode=async` (rollouts of the next
`algorithm.max_staleness` steps generated while a step trains), same config, seed and steps, each with its
own run id in the same store. Reports, per mode: mean step wall time (s; the flow's step loop, publish and
sync included), steps per hour, rollout completions/s (completions / rollout-phase seconds), the version-lag
histogram summed over steps, mean importance weight, and greedy held-out accuracy before and after (the
learning-parity check: async should end within 5 points of sync). Step 1 is left out of the step time
(warm-up: first CUDA kernels, first adapter load).

Usage::

    PYTHONPATH=. python benchmarks/async_rollouts.py --config configs/smollm2-arith-grpo.yaml \\
        --steps 6 --set run.eval_before_after=false                 # CPU, embedded engine
    # learning parity over seeds, with a larger held-out set (the greedy accuracy of 128 problems moves by
    # about 4 points from noise alone)
    ... --seeds 0,1,2 --steps 30 --set data.eval_size=512
    # GPU host (docs/SGLANG.md, "GPU host"): one SGLang server, launched here from the config's
    # engine.launch settings, serves both runs (--launch-sglang)
    PYTHONPATH=/tmp/ours:. python3 benchmarks/async_rollouts.py --config configs/smollm2-arith-grpo.yaml \\
        --launch-sglang --device cuda --set model.name_or_path=/tmp/models/smollm2-gguf engine.type=sglang \\
        "engine.launch.env={PYTHONPATH: /tmp/sglsite}" engine.sglang_retire=keep engine.launch.cuda_graph_max_bs=null

On SGLang 0.5.17 use `engine.sglang_retire=keep`: its unload hangs under concurrent traffic, which async
rollouts are (docs/HOTSWAP.md).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import _common
from _common import RESULTS, machine_info, print_table, write_json

MODES = ("sync", "async")


def run_mode(mode: str, args: argparse.Namespace, store: str, output_dir: str, seed: int | None) -> dict[str, Any]:
    """One training flow in `mode` (with `run.seed=seed` unless None); its summary and the step metrics that the
    comparison needs."""
    from flows.grpo_lora import train

    stamp = time.strftime("%H%M%S")
    overrides = [
        *args.set,
        *([] if seed is None else [f"run.seed={seed}"]),
        f"rollout.mode={mode}",
        f"run.id=bench-{mode}-{'' if seed is None else f's{seed}-'}{stamp}",
        f"store.uri={store}",
        f"run.output_dir={output_dir}",
    ]
    if args.steps:
        overrides.append(f"trainer.steps={args.steps}")
    start = time.perf_counter()
    summary = train(config_path=args.config, overrides=overrides)
    wall = time.perf_counter() - start
    history = json.loads((Path(output_dir) / summary["run_id"] / "history.json").read_text())
    timed = [h["step_seconds"] for h in history[1:]] or [history[0]["step_seconds"]]
    lag: Counter[str] = Counter()
    for h in history:
        lag.update(h.get("version_lag") or {})
    weights = [h["is_weight_mean"] for h in history if "is_weight_mean" in h]
    return {
        "mode": mode,
        "seed": seed,
        "steps": len(history),
        "flow_wall_seconds": wall,
        "step_seconds_mean": statistics.mean(timed),
        "step_seconds_median": statistics.median(timed),
        "steps_per_hour": 3600.0 / statistics.mean(timed),
        "rollout_completions_per_second": summary["completions_per_second"],
        "rollout_seconds_mean": statistics.mean(h["rollout_seconds"] for h in history[1:] or history),
        "train_seconds_mean": statistics.mean(h.get("train_seconds", 0.0) for h in history[1:] or history),
        "version_lag": dict(sorted(lag.items())),
        "is_weight_mean": statistics.mean(weights) if weights else None,
        "base_accuracy": summary["base_accuracy"],
        "final_accuracy": summary["final_accuracy"],
        "reward_mean_last5": statistics.mean(h["reward_mean"] for h in history[-5:]),
        "runtime": summary["runtime"],
    }


def main() -> int:
    """Run both modes for each seed, print the tables, write the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/smollm2-arith-grpo.yaml")
    parser.add_argument("--steps", type=int, default=None, help="default: the config's trainer.steps")
    parser.add_argument("--set", nargs="*", default=[], help="config overrides for both modes (key=value)")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument(
        "--seeds", default=None, help="comma-separated run.seed values, each run in every mode (default: the config's)"
    )
    parser.add_argument("--launch-sglang", action="store_true", help="one SGLang server for every run")
    parser.add_argument("--device", default="cpu", help="for the machine facts only; the config picks the device")
    parser.add_argument("--out", type=Path, default=None, help="default: results/async_rollouts_<device>.json")
    args = parser.parse_args()
    seeds: list[int | None] = [int(x) for x in args.seeds.split(",")] if args.seeds else [None]
    work = Path(tempfile.mkdtemp(prefix="async-bench-"))
    store, output_dir = f"file://{work / 'store'}", str(work / "runs")
    server = None
    if args.launch_sglang:
        from lora_rl_core.config import load_config
        from lora_rl_core.engines.sglang_server import launch_sglang

        cfg = load_config(args.config, [*args.set, "engine.launch.enabled=true"])
        server = launch_sglang(cfg, work / "sglang.log")
        args.set = [*args.set, "engine.launch.enabled=false", f"engine.urls=[{server.url}]"]
    out = args.out or RESULTS / f"async_rollouts_{args.device.split(':')[0]}.json"
    results: list[dict[str, Any]] = []
    try:
        for seed in seeds:
            for mode in args.modes.split(","):
                results.append(run_mode(mode, args, store, output_dir, seed))
                write_json(_record(args, results), out)  # after each run: a time limit keeps what finished
    finally:
        if server is not None:
            print("sglang log tail:\n" + server.log_tail(30), flush=True)
            server.stop()
    record = _record(args, results)
    pct = lambda v: "-" if v is None else f"{100 * v:.1f}%"  # noqa: E731
    print_table(
        f"sync vs async rollouts ({args.config}, {results[0]['steps']} steps)",
        ["seed", "mode", "s/step", "steps/h", "rollout compl/s", "rollout s", "train s", "version lag", "IS weight",
         "acc before", "acc after", "batch acc last 5"],
        [
            [r["seed"] if r["seed"] is not None else "-", r["mode"], r["step_seconds_mean"], r["steps_per_hour"],
             r["rollout_completions_per_second"], r["rollout_seconds_mean"], r["train_seconds_mean"],
             " ".join(f"{k}:{v}" for k, v in r["version_lag"].items()), r["is_weight_mean"] or "-",
             pct(r["base_accuracy"]), pct(r["final_accuracy"]), pct(r["reward_mean_last5"])]
            for r in results
        ],
    )  # fmt: skip
    summary = record["summary"]
    speedup = summary["async_over_sync_steps_per_hour"]
    if speedup is not None:
        print(f"async / sync steps per hour: {speedup:.2f}x (goal on the GPU: >= 1.5x)")
    if summary["final_accuracy_gap_mean"] is not None:
        print(
            f"final greedy accuracy, async - sync: {100 * summary['final_accuracy_gap_mean']:+.1f} points "
            f"(per seed {', '.join(f'{100 * g:+.1f}' for g in summary['final_accuracy_gaps'])}; goal: within 5)"
        )
    write_json(record, out)
    return 0


def _record(args: argparse.Namespace, results: list[dict[str, Any]]) -> dict[str, Any]:
    """The JSON record: settings, machine, each run's results, and a summary over the seeds where both modes
    ran: async over sync steps per hour (mean step times), and async minus sync final greedy accuracy and
    last-5-step batch accuracy (per seed and mean)."""
    pairs: dict[Any, dict[str, dict[str, Any]]] = {}
    for r in results:
        pairs.setdefault(r["seed"], {})[r["mode"]] = r
    both = [p for p in pairs.values() if {"sync", "async"} <= p.keys()]
    gaps = [p["async"]["final_accuracy"] - p["sync"]["final_accuracy"] for p in both
            if p["async"]["final_accuracy"] is not None and p["sync"]["final_accuracy"] is not None]  # fmt: skip
    batch_gaps = [p["async"]["reward_mean_last5"] - p["sync"]["reward_mean_last5"] for p in both]
    speedup = None
    if both:
        step_s = {m: statistics.mean(p[m]["step_seconds_mean"] for p in both) for m in MODES}
        speedup = step_s["sync"] / step_s["async"]
    return {
        "config": args.config,
        "overrides": args.set,
        "seeds": args.seeds,
        "machine": machine_info(args.device),
        "results": results,
        "summary": {
            "async_over_sync_steps_per_hour": speedup,
            "final_accuracy_gaps": gaps,
            "final_accuracy_gap_mean": statistics.mean(gaps) if gaps else None,
            "batch_accuracy_last5_gaps": batch_gaps,
            "batch_accuracy_last5_gap_mean": statistics.mean(batch_gaps) if batch_gaps else None,
        },
    }


if __name__ == "__main__":
    assert _common  # puts the checkout on sys.path
    sys.exit(main())
