"""What Prefect adds to a training step: the same steps through the library's loop and through the flow's tasks.

Issue 34, item 4: on one H100 the `lora-rl train` step had 0.7-0.85 s outside rollout and train. This measures
the part of it that is orchestration, on any machine: one process runs the same run twice, each time with
`lora_rl_core.run.loop.run_steps`,

    library   over `RunPhases` (each phase a direct call: what `benchmarks/gpu_scale.py` times), then
    prefect   over the flow's `TaskPhases` inside the real `train` flow (`flows/grpo_lora.py`; each phase a
              Prefect task run: its state transitions, cache key and result persistence, on Prefect's
              temporary API server as `lora-rl train` starts it),

and times every phase call from outside, and after each step samples the CPU seconds of this process's threads
and of its child processes (Prefect's temporary API server). The model is the default job's (SmolLM2-135M-
Instruct's config and tokenizer) cut to `--layers` layers of width `--hidden` with random weights, so that the
phases themselves are short and what Prefect adds stands out; rollout and train sizes are the default config's
unless overridden. Writes `benchmarks/results/orchestration/<name>.json` (per step and phase, both drivers) and a
Chrome trace of every phase call (`<name>.trace.json`: open it in https://ui.perfetto.dev; one track per
driver), and prints the per-phase medians and their difference.

    PYTHONPATH=. .venv/bin/python benchmarks/orchestration.py --steps 8
    PYTHONPATH=. .venv/bin/python benchmarks/orchestration.py --steps 8 --override rollout.mode=async --name async
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's lora_rl_core, flows, tasks
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads, as the CLI does (lora_rl_core.runtime)
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")  # as `lora-rl train` allows

# isort: split
from _common import RESULTS, machine_info, print_table, write_json  # noqa: E402

PHASES = ("rollout", "score", "train", "publish", "sync")
T0 = time.perf_counter()


def cpu_seconds() -> dict[str, float]:
    """CPU seconds (user + system) used so far by this process's threads, summed by thread name (`main` for
    the main thread), and by its child processes (`children`: Prefect's temporary API server), read from
    /proc (Linux)."""
    tick = os.sysconf("SC_CLK_TCK")

    def stat_cpu(path: str) -> float:
        fields = Path(path).read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / tick  # utime, stime

    out: dict[str, float] = {}
    me = os.getpid()
    for task in Path(f"/proc/{me}/task").iterdir():
        try:
            name = "main" if int(task.name) == me else (task / "comm").read_text().strip()
            out[name] = out.get(name, 0.0) + stat_cpu(str(task / "stat"))
        except (OSError, ValueError, IndexError):
            continue  # the thread ended meanwhile
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) == me:  # a child of this process
                out["children"] = out.get("children", 0.0) + stat_cpu(str(proc / "stat"))
        except (OSError, ValueError, IndexError):
            continue
    return out


class TracedPhases:
    """A `PhaseRunner` that records every phase another one runs as a span `(phase, step, start s, end s)`, the
    times in seconds since this module loaded, and after each step's sync the CPU seconds used so far
    (`cpu_seconds`). Version 0's publish and sync (before step 1), the flush and the report's phases are left
    out; a submitted rollout is recorded as `submit_rollout` (its run is the task runner's, not on this track)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.spans: list[tuple[str, int, float, float]] = []
        self.cpu: dict[int, dict[str, float]] = {0: cpu_seconds()}

    def call(self, phase: Any, /, *args: Any, **kwargs: Any) -> Any:
        """Traced `phase`; after a sync, the CPU seconds used so far are sampled (the end of that step)."""
        return self._span(phase.__name__, self.inner.call, phase, *args, **kwargs)

    def submit(self, phase: Any, /, *args: Any, **kwargs: Any) -> Any:
        """Traced submission."""
        return self._span(f"submit_{phase.__name__}", self.inner.submit, phase, *args, **kwargs)

    def _span(self, name: str, run: Any, phase: Any, *args: Any, **kwargs: Any) -> Any:
        step = args[0].version if name == "sync" else args[0] if args and isinstance(args[0], int) else 0
        start = time.perf_counter() - T0
        try:
            return run(phase, *args, **kwargs)
        finally:
            if step > 0:
                self.spans.append((name, step, start, time.perf_counter() - T0))
            if name == "sync":
                self.cpu[step] = cpu_seconds()


def build_model(out: Path, layers: int, hidden: int) -> Path:
    """The default job's model (its config and tokenizer) with `layers` layers of width `hidden`, random weights."""
    import shutil

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from lora_rl_core.config import ModelConfig
    from lora_rl_core.models import model_folder

    source = model_folder(ModelConfig())
    config = AutoConfig.from_pretrained(source)
    heads = max(1, hidden // 16)
    config.update(
        {
            "num_hidden_layers": layers,
            "hidden_size": hidden,
            "intermediate_size": 2 * hidden,
            "num_attention_heads": heads,
            "num_key_value_heads": heads,
            "head_dim": hidden // heads,
        }
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    for f in Path(source).iterdir():
        if f.is_file() and f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges", "chat_template")):
            shutil.copy(f, out / f.name)
    return out


def run_library(cfg: Any, run_id: str) -> tuple[list[dict[str, Any]], TracedPhases]:
    """The steps through `run_steps` over `RunPhases` (no Prefect)."""
    from lora_rl_core.run import open_run
    from lora_rl_core.run.loop import RunPhases, run_steps

    run = open_run(cfg, run_id)
    try:
        with RunPhases(run) as inner:
            traced = TracedPhases(inner)
            done = run_steps(traced, steps=cfg.trainer.steps, ahead=run.plan.rollouts_ahead())
    finally:
        run.close()
    return done.history, traced


def run_prefect(cfg: Any, run_id: str) -> tuple[list[dict[str, Any]], TracedPhases]:
    """The steps through the real `train` flow: its `TaskPhases` are traced (the flow module's name for them is
    swapped for the tracer's constructor while the flow runs; the flow's evaluations and report pass through
    it untraced)."""
    import flows.grpo_lora as flow
    from lora_rl_core.run import open_run

    tracers: list[TracedPhases] = []
    task_phases = flow.TaskPhases

    def traced_task_phases(*args: Any) -> TracedPhases:
        tracers.append(TracedPhases(task_phases(*args)))
        return tracers[-1]

    flow.TaskPhases = traced_task_phases  # type: ignore[assignment,misc]
    try:
        with open_run(cfg, run_id):  # built before the flow, as `lora-rl train` builds it: the flow takes it by id
            flow.train(run_id=run_id)
    finally:
        flow.TaskPhases = task_phases  # type: ignore[misc]
    history = json.loads((Path(cfg.run.output_dir) / run_id / "history.json").read_text())
    return history, tracers[0]


def per_step(traced: TracedPhases, history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per step: the seconds of each phase call (outside), the step's wall seconds (first call's start to the
    sync's end), and the phase's own seconds where its record has them (inside)."""
    rows = []
    for h in history:
        step = h["step"]
        spans = [s for s in traced.spans if s[1] == step and s[0] in PHASES]
        before, after = traced.cpu.get(step - 1, {}), traced.cpu.get(step, {})
        rows.append(
            {
                "step": step,
                "cpu_seconds": {
                    k: round(v - before.get(k, 0.0), 3) for k, v in after.items() if v > before.get(k, 0.0)
                },
                "outside": {p: sum(e - b for name, _, b, e in spans if name == p) for p in PHASES},
                "step_seconds": h.get("step_seconds"),
                "inside": {
                    "rollout": h.get("rollout_seconds"),
                    "score": h.get("score_seconds"),
                    "train": h.get("train_seconds"),
                    "sync": h.get("sync_seconds"),
                },
            }
        )
    return rows


def chrome_trace(tracks: dict[str, TracedPhases]) -> dict[str, Any]:
    """A Chrome trace (`traceEvents`, microseconds) with one process per driver, a complete event per call."""
    events: list[dict[str, Any]] = []
    for pid, (name, traced) in enumerate(tracks.items(), start=1):
        events.append({"name": "process_name", "ph": "M", "pid": pid, "tid": 1, "args": {"name": name}})
        for phase, step, begin, end in traced.spans:
            events.append(
                {
                    "name": phase,
                    "cat": "phase",
                    "ph": "X",
                    "pid": pid,
                    "tid": 1,
                    "ts": round(begin * 1e6),
                    "dur": round((end - begin) * 1e6),
                    "args": {"step": step},
                }
            )
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2, help="first steps left out of the medians")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--override", action="append", default=[], help="config overrides for both drivers")
    p.add_argument("--name", default="sync", help="result file name under benchmarks/results/orchestration/")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    from lora_rl_core.config import load_config

    work = Path(tempfile.mkdtemp(prefix="orchestration-"))
    model = build_model(work / "model", args.layers, args.hidden)
    overrides = [
        f"model.name_or_path={model}",
        "model.device=cpu",
        f"trainer.steps={args.steps}",
        "run.eval_before_after=false",
        "algorithm.skip_uniform_groups=false",  # a random model's rewards are uniform: train every step anyway
        "reward.leak_check=false",
        f"run.output_dir={work / 'runs'}",
        f"store.uri=file://{work / 'store'}",
        *args.override,
    ]
    cfg = load_config(None, overrides)
    results: dict[str, Any] = {}
    tracks: dict[str, TracedPhases] = {}
    for driver, runner in (("library", run_library), ("prefect", run_prefect)):
        history, traced = runner(cfg, f"orchestration-{driver}")
        results[driver] = per_step(traced, history)
        tracks[driver] = traced
    timed = {d: rows[args.warmup :] or rows for d, rows in results.items()}

    def median(driver: str, key: str, phase: str | None = None) -> float:
        values = [r[key][phase] if phase else r[key] for r in timed[driver]]
        return statistics.median(v for v in values if v is not None)

    summary = {phase: {d: median(d, "outside", phase) for d in timed} for phase in PHASES} | {
        "step": {d: median(d, "step_seconds") for d in timed}
    }
    cpu = {
        d: {
            k: statistics.median(r["cpu_seconds"].get(k, 0.0) for r in rows)
            for k in sorted({k for r in rows for k in r["cpu_seconds"]})
        }
        for d, rows in timed.items()
    }
    record = {
        "command": "benchmarks/orchestration.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "overrides": [o for o in overrides if not o.startswith(("model.name_or_path", "run.output_dir", "store."))],
        "model": {"layers": args.layers, "hidden": args.hidden, "tokenizer": "SmolLM2-135M-Instruct"},
        "medians_after_warmup": summary,
        "cpu_seconds_per_step": cpu,
        "steps": results,
        "machine": machine_info("cpu"),
    }
    out = RESULTS / "orchestration" / f"{args.name}.json"
    write_json(record, out)
    out.with_suffix(".trace.json").write_text(json.dumps(chrome_trace(tracks)))
    print_table(
        f"One step's phases, library loop against the Prefect flow (medians of steps {args.warmup + 1}..{args.steps})",
        ["phase", "library s", "prefect s", "prefect adds s"],
        [[p, v["library"], v["prefect"], v["prefect"] - v["library"]] for p, v in summary.items()],
    )
    print_table(
        "CPU seconds per step by thread and child process (medians)",
        ["driver", "where", "CPU s"],
        [[d, k, v] for d, by in cpu.items() for k, v in sorted(by.items(), key=lambda kv: -kv[1]) if v >= 0.01],
    )
    return record


if __name__ == "__main__":
    main()
