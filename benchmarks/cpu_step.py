"""One GRPO step of the default job on the CPU, per phase, for model.dtype bfloat16, float32 and auto.

Each dtype runs in its own process (so peak RSS is its own) on the real model and the default config
(`configs/smollm2-arith-grpo.yaml`), phase by phase through the library's step loop
(`lora_rl_core.run.loop.run_steps` over `RunPhases`), without Prefect: rollout (generation), score
(rewards + advantages), train (one PPO/GRPO update), publish (adapter to the store), sync (the engine loads
the new version). By default every group is trained on
(`algorithm.skip_uniform_groups=false`), so the train phase has the same 64 rows whatever the rewards; the
first `--warmup` steps are reported apart. With `--busy`, the `auto` run is repeated while `yes > /dev/null`
keeps one core busy, and the table shows the busy/idle step-time ratio.

    PYTHONPATH=. .venv/bin/python benchmarks/cpu_step.py                       # bf16, fp32, auto (slow: bf16)
    PYTHONPATH=. .venv/bin/python benchmarks/cpu_step.py --dtypes float32 auto --busy --steps 3

Writes `benchmarks/results/cpu_step.json` (or `--out`) and prints a table naming the CPU.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's lora_rl_core
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads, as the CLI does (lora_rl_core.runtime)

# isort: split
from _common import RESULTS, ROOT, machine_info, print_table, write_json  # noqa: E402

PHASES = ("rollout", "score", "train", "publish", "sync")


def run_one(args: argparse.Namespace) -> dict[str, Any]:
    """In a child process: build a run for one dtype and time `args.steps` steps of the library's step loop
    (`lora_rl_core.run.loop.run_steps`) phase by phase."""
    from lora_rl_core.config import load_config
    from lora_rl_core.run import open_run
    from lora_rl_core.run.loop import RunPhases, run_steps

    with tempfile.TemporaryDirectory(prefix="cpu-step-") as tmp:
        overrides = [
            f"model.dtype={args.dtype}",
            f"algorithm.skip_uniform_groups={str(args.skip_uniform).lower()}",
            f"run.output_dir={tmp}",
            f"store.uri=file://{tmp}/store",
            "engine.sync=tensor",
            *args.override,
        ]
        cfg = load_config(args.config, overrides)
        start = time.perf_counter()
        run = open_run(cfg, "cpu-step")
        setup_s = time.perf_counter() - start
        steps: list[dict[str, Any]] = []
        try:
            with RunPhases(run) as inner:
                timed = TimedPhases(inner)

                def on_step(metrics: dict[str, Any]) -> None:
                    times = timed.take()
                    steps.append(
                        {
                            "step": metrics["step"],
                            "seconds": times,
                            "step_seconds": sum(times.values()),
                            "completions": metrics["completions"],
                            "completion_tokens": metrics["completion_tokens"],
                            "train_sequences": metrics.get("train_sequences", 0.0),
                            "train_tokens": metrics.get("train_tokens", 0.0),
                            "accuracy": metrics["accuracy"],
                        }
                    )
                    line = f"  {args.dtype}: step {metrics['step']} {sum(times.values()):.1f} s {times}"
                    print(line, file=sys.stderr, flush=True)

                run_steps(timed, steps=args.steps, ahead=0, on_step=on_step)
            runtime = run.runtime
        finally:
            run.close()
    return {
        "requested_dtype": args.dtype,
        "runtime": runtime,
        "setup_seconds": setup_s,
        "steps": steps,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,  # Linux: KiB
    }


class TimedPhases:
    """A `PhaseRunner` that times each phase another one runs now (wall seconds by phase name, `take()` empties).
    Version 0's publish and sync (set-up, before step 1) and the final flush are not timed."""

    def __init__(self, inner: Any, around: Callable[[str], AbstractContextManager[Any]] | None = None) -> None:
        self.inner = inner
        self.times: dict[str, float] = {}
        self.around = around or (lambda phase: contextlib.nullcontext())  # e.g. a timeline's range per phase

    def take(self) -> dict[str, float]:
        """The seconds recorded since the last `take`, by phase."""
        times, self.times = self.times, {}
        return times

    def call(self, phase: Any, /, *args: Any, **kwargs: Any) -> Any:
        """Timed `phase` (its function's name, `rollout` ... `sync`)."""
        name = phase.__name__
        if name not in PHASES or (name == "publish" and args[0] == 0) or (name == "sync" and args[0].version == 0):
            return self.inner.call(phase, *args, **kwargs)
        start = time.perf_counter()
        try:
            with self.around(name):
                return self.inner.call(phase, *args, **kwargs)
        finally:
            self.times[name] = self.times.get(name, 0.0) + time.perf_counter() - start

    def submit(self, phase: Any, /, *args: Any, **kwargs: Any) -> Any:
        """Not timed: this benchmark runs sync mode."""
        return self.inner.submit(phase, *args, **kwargs)


def summarize(result: dict[str, Any], warmup: int) -> dict[str, Any]:
    """Mean seconds per phase over the steps after `warmup`, completions/s of the rollout phase."""
    timed = result["steps"][warmup:] or result["steps"]
    phases = {p: statistics.mean(s["seconds"][p] for s in timed) for p in PHASES}
    step_s = statistics.mean(s["step_seconds"] for s in timed)
    completions = sum(s["completions"] for s in timed)
    return {
        "phases_s": phases,
        "step_s": step_s,
        "completions_per_s": completions / sum(s["seconds"]["rollout"] for s in timed),
        "steps_timed": len(timed),
    }


def child(args: argparse.Namespace, dtype: str, *, busy: bool, steps: int) -> dict[str, Any]:
    """Run `run_one` for `dtype` in a fresh interpreter (optionally with `yes` keeping one core busy)."""
    cmd = [sys.executable, __file__, "--child", "--dtype", dtype, "--steps", str(steps), "--config", args.config]
    cmd += ["--skip-uniform"] if args.skip_uniform else []
    for o in args.override:
        cmd += ["--override", o]
    hog = subprocess.Popen(["yes"], stdout=subprocess.DEVNULL) if busy else None
    try:
        out = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True, env={**os.environ})
    finally:
        if hog is not None:
            hog.terminate()
            hog.wait()
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32", "auto"])
    parser.add_argument("--steps", type=int, default=2, help="steps per dtype (the first --warmup are not timed)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument(
        "--emulated-steps",
        type=int,
        default=1,
        help="steps for a bf16 run on a CPU without native bf16 (each takes minutes), all timed",
    )
    parser.add_argument("--busy", action="store_true", help="also run auto with one core kept busy by `yes`")
    parser.add_argument("--skip-uniform", action="store_true", help="train only groups whose rewards differ")
    parser.add_argument("--config", default=str(ROOT / "configs" / "smollm2-arith-grpo.yaml"))
    parser.add_argument("--override", action="append", default=[], help="dotted config override (repeatable)")
    parser.add_argument("--out", type=Path, default=RESULTS / "cpu_step.json")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--dtype", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(run_one(args)))
        return

    from lora_rl_core.runtime import choose_dtype, cpu_description

    runs: dict[str, dict[str, Any]] = {}
    cases = [(d, False) for d in args.dtypes] + ([("auto", True)] if args.busy else [])
    for dtype, busy in cases:
        label = f"{dtype} (1 core busy)" if busy else dtype
        emulated = dtype == "bfloat16" and choose_dtype("auto", "cpu").name != "bfloat16"
        steps, warmup = (args.emulated_steps, 0) if emulated else (args.steps, args.warmup)
        print(f"running {label} for {steps} step(s) ...", file=sys.stderr, flush=True)
        result = child(args, dtype, busy=busy, steps=steps)
        runs[label] = {
            **result,
            "summary": summarize(result, warmup),
            "busy_core": busy,
            "emulated_bf16": emulated,
            "warmup_steps": warmup,
        }
    if "auto" in runs and "auto (1 core busy)" in runs:
        ratio = runs["auto (1 core busy)"]["summary"]["step_s"] / runs["auto"]["summary"]["step_s"]
        runs["auto (1 core busy)"]["summary"]["busy_over_idle"] = ratio

    cpu = cpu_description()
    rows = []
    for label, r in runs.items():
        s = r["summary"]
        rows.append(
            [label + (" (no warm-up)" if r["warmup_steps"] == 0 else ""), r["runtime"]["dtype"]]
            + [*(s["phases_s"][p] for p in PHASES), s["step_s"], s["completions_per_s"]]
            + [r["peak_rss_bytes"] / 2**30, s.get("busy_over_idle", "")]
        )
    title = (
        f"GRPO step of {Path(args.config).name} on {cpu}, {runs[next(iter(runs))]['runtime']['cpu_threads']} threads; "
        f"mean of {args.steps - args.warmup} step(s) after {args.warmup} warm-up; "
        f"{'signal groups only' if args.skip_uniform else 'all 64 rows trained'}"
    )
    columns = ["run", "dtype", *(f"{p} s" for p in PHASES), "step s", "compl/s", "peak RSS GiB", "busy/idle"]
    print_table(title, columns, rows)
    write_json(
        {
            "benchmark": "cpu_step",
            "command": "PYTHONPATH=. .venv/bin/python benchmarks/cpu_step.py " + " ".join(sys.argv[1:]),
            "cpu": cpu,
            "machine": machine_info("cpu"),
            "config": Path(args.config).name,
            "overrides": args.override,
            "skip_uniform_groups": args.skip_uniform,
            "runs": runs,
        },
        args.out,
    )


if __name__ == "__main__":
    main()
