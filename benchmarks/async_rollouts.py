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

Variants (`--variants`): each is `NAME` (`sync` or `async`) or `NAME:key=value;key=value` (config overrides of
that variant only, `rollout.mode` among them), e.g.
`async-seqmask:rollout.mode=async;algorithm.off_policy_correction=sequence-mask`.
The first variant is the baseline that the others are compared with, seed by seed. Every run keeps its
per-step curves (reward, entropy, gradient norm, importance weights, ...). `--check-versions K` also measures
the greedy accuracy of each run's last K versions with the transformers + PEFT engine (`engine.type: embedded`
on the config's device): a second opinion on the engine's final evaluation, and a less noisy end point (the
mean over the last K versions) than one version's accuracy.
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
from async_parity_report import parity

MODES = ("sync", "async")
CURVES = ("reward_mean", "entropy", "grad_norm", "train_sequences", "is_weight_mean", "is_weight_max",
          "is_masked_fraction", "m2", "m2_masked_fraction", "logprob_mismatch", "clip_fraction",
          "step_seconds", "truncated_fraction", "completion_length", "value_loss", "explained_variance",
          "value_mean", "critic_seconds", "train_seconds")  # fmt: skip
"""Step metrics kept per run as curves (`None` where a step has no value, e.g. no IS weights in sync)."""


def parse_variant(text: str) -> tuple[str, list[str]]:
    """`NAME` or `NAME:key=value;key=value` -> (name, overrides); a bare `sync` / `async` sets `rollout.mode`.

    Raises:
        SystemExit: a variant whose overrides set no `rollout.mode` and whose name is not a mode.
    """
    name, _, rest = text.partition(":")
    overrides = [o.strip() for o in rest.split(";") if o.strip()]
    if not any(o.startswith("rollout.mode=") for o in overrides):
        if name not in MODES:
            raise SystemExit(f"--variants {text!r}: name a mode ({', '.join(MODES)}) or set rollout.mode=...")
        overrides.append(f"rollout.mode={name}")
    return name, overrides


def run_variant(
    variant: tuple[str, list[str]], args: argparse.Namespace, store: str, output_dir: str, seed: int | None
) -> dict[str, Any]:
    """One training flow of `variant` (with `run.seed=seed` unless None); its summary, the step metrics that the
    comparison needs and its per-step curves."""
    from flows.grpo_lora import train

    name, variant_overrides = variant
    stamp = time.strftime("%H%M%S")
    overrides = [
        *args.set,
        *([] if seed is None else [f"run.seed={seed}"]),
        *variant_overrides,
        f"run.id=bench-{name}-{'' if seed is None else f's{seed}-'}{stamp}",
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
        "variant": name,
        "mode": next(o.split("=", 1)[1] for o in variant_overrides if o.startswith("rollout.mode=")),
        "variant_overrides": variant_overrides,
        "seed": seed,
        "run_id": summary["run_id"],
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
        # every grader metric (strict, flexible), and what the last step's completions were
        "base_eval": {k: v for k, v in (summary.get("base_eval") or {}).items() if k.startswith("accuracy")},
        "final_eval": {k: v for k, v in (summary.get("final_eval") or {}).items() if k.startswith("accuracy")},
        "final_truncated_fraction": summary.get("final_truncated_fraction"),
        "last_step_samples": [s for s in summary.get("step_samples", []) if s["step"] == len(history)],
        "critic": summary.get("critic"),
        "reward_mean_last5": statistics.mean(h["reward_mean"] for h in history[-5:]),
        "curves": {k: [_round(h.get(k)) for h in history] for k in CURVES},
        "runtime": summary["runtime"],
    }


def _round(value: Any) -> Any:
    return round(value, 5) if isinstance(value, float) else value


class VersionCheck:
    """Greedy accuracy of stored versions with the transformers + PEFT engine: one copy of the model for the
    whole benchmark (`engine.type: embedded` on the config's device), the versions loaded from the store."""

    def __init__(self, args: argparse.Namespace, store: str) -> None:
        from lora_rl_core.config import EmbeddedEngineConfig, load_config
        from lora_rl_core.engines.embedded.build import build_embedded_engine
        from lora_rl_core.models import load_tokenizer

        self.cfg = load_config(args.config, [*args.set, f"store.uri={store}"])
        self.store = self.cfg.store.build()
        self.tokenizer = load_tokenizer(self.cfg.model)
        embedded = EmbeddedEngineConfig(max_batch_size=512)  # whatever engine the runs use
        self.engine = build_embedded_engine(embedded, self.cfg.model, self.store, tokenizer=self.tokenizer)

    def accuracies(self, run_id: str, seed: int | None, versions: list[int]) -> dict[str, float]:
        """`{version: greedy accuracy}` on the run's held-out problems (the seed's split, as the flow's)."""
        from lora_rl_core.data import load_problems
        from lora_rl_core.evaluation import evaluate_run_policy
        from lora_rl_core.rewards import build_grader

        problems = load_problems(self.cfg.data, "test", self.cfg.run.seed if seed is None else seed)
        result: dict[str, float] = {}
        grader = build_grader(self.cfg.eval, self.cfg.reward)  # one grader for every version
        try:
            for version in versions:
                ref = self.store.resolve(f"{run_id}@{version}")
                self.engine.load_adapter(ref.name, path=ref.uri)
                try:
                    acc = evaluate_run_policy(self.engine, self.tokenizer, problems, grader, self.cfg, adapter=ref.name)
                finally:
                    self.engine.unload_adapter(ref.name)
                result[str(version)] = acc["accuracy"]
        finally:
            grader.close()
        return result

    def close(self) -> None:
        self.engine.close()


def main() -> int:
    """Run every variant for each seed, print the tables, write the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/smollm2-arith-grpo.yaml")
    parser.add_argument("--steps", type=int, default=None, help="default: the config's trainer.steps")
    parser.add_argument("--set", nargs="*", default=[], help="config overrides for every variant (key=value)")
    parser.add_argument(
        "--variants", nargs="+", default=list(MODES), help="NAME or NAME:key=value;... (module docstring)"
    )
    parser.add_argument(
        "--seeds", default=None, help="comma-separated run.seed values, each run in every mode (default: the config's)"
    )
    parser.add_argument("--check-versions", type=int, default=0, help="greedy accuracy of each run's last K versions "
                        "with the transformers + PEFT engine (0: off)")  # fmt: skip
    parser.add_argument("--launch-sglang", action="store_true", help="one SGLang server for every run")
    parser.add_argument("--device", default="cpu", help="for the machine facts only; the config picks the device")
    parser.add_argument("--out", type=Path, default=None, help="default: results/async_rollouts_<device>.json")
    args = parser.parse_args()
    variants = [parse_variant(v) for v in args.variants]
    seeds: list[int | None] = [int(x) for x in args.seeds.split(",")] if args.seeds else [None]
    work = Path(tempfile.mkdtemp(prefix="async-bench-"))
    store, output_dir = f"file://{work / 'store'}", str(work / "runs")
    server, check = None, None
    out = args.out or RESULTS / f"async_rollouts_{args.device.split(':')[0]}.json"
    results: list[dict[str, Any]] = []
    try:
        if args.launch_sglang:
            from lora_rl_core.config import load_config, sglang_section
            from lora_rl_core.engines.launch.process import launch_sglang

            cfg = load_config(args.config, [*args.set, "engine.launch.enabled=true"])
            server = launch_sglang(
                sglang_section(cfg.engine, "this benchmark"), cfg.model, cfg.lora, work / "sglang.log"
            )
            args.set = [*args.set, "engine.launch.enabled=false", f"engine.urls=[{server.url}]"]
        if args.check_versions:
            check = VersionCheck(args, store)
        for seed in seeds:
            for variant in variants:
                r = run_variant(variant, args, store, output_dir, seed)
                if check is not None:
                    last = r["steps"]
                    versions = list(range(max(0, last - args.check_versions + 1), last + 1))
                    r["check_accuracy"] = check.accuracies(r["run_id"], seed, versions)
                    r["check_accuracy_mean"] = statistics.mean(r["check_accuracy"].values())
                results.append(r)
                write_json(_record(args, results), out)  # after each run: a time limit keeps what finished
    finally:
        if check is not None:
            check.close()
        if server is not None:
            print("sglang log tail:\n" + server.log_tail(30), flush=True)
            server.stop()
    record = _record(args, results)
    pct = lambda v: "-" if v is None else f"{100 * v:.1f}%"  # noqa: E731
    print_table(
        f"variants ({args.config}, {results[0]['steps']} steps)",
        ["seed", "variant", "s/step", "steps/h", "rollout compl/s", "rollout s", "train s", "version lag",
         "IS weight", "acc before", "acc after", "check acc (mean)", "batch acc last 5"],
        [
            [r["seed"] if r["seed"] is not None else "-", r["variant"], r["step_seconds_mean"], r["steps_per_hour"],
             r["rollout_completions_per_second"], r["rollout_seconds_mean"], r["train_seconds_mean"],
             " ".join(f"{k}:{v}" for k, v in r["version_lag"].items()), r["is_weight_mean"] or "-",
             pct(r["base_accuracy"]), pct(r["final_accuracy"]), pct(r.get("check_accuracy_mean")),
             pct(r["reward_mean_last5"])]
            for r in results
        ],
    )  # fmt: skip
    for name, v in record["summary"].items():
        print(f"{name} / {record['baseline']} steps per hour: {v['step_seconds_ratio']:.2f}x (goal: >= 1.5x)")
        if "final_accuracy" in v["gaps"]:
            gaps = v["gaps"]["final_accuracy"]
            print(
                f"final greedy accuracy, {name} - {record['baseline']}: {gaps['mean']:+.1f} points "
                f"(per seed {', '.join(f'{g:+.1f}' for g in gaps['values'])}; goal: within 5)"
            )
    write_json(record, out)
    return 0


def _record(args: argparse.Namespace, results: list[dict[str, Any]]) -> dict[str, Any]:
    """The JSON record: settings, machine, each run's results, and per variant other than the baseline (the
    first) the comparison over the seeds where both ran (`async_parity_report.parity`: step-time ratio, and
    per-seed accuracy gaps in points with their statistics)."""
    record = {
        "config": args.config,
        "overrides": args.set,
        "variants": args.variants,
        "baseline": parse_variant(args.variants[0])[0],
        "seeds": args.seeds,
        "machine": machine_info(args.device),
        "results": results,
    }
    return {**record, "summary": parity([record])["variants"]}


if __name__ == "__main__":
    assert _common  # puts the checkout on sys.path
    sys.exit(main())
