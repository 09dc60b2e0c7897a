"""A step's critical path after its update (train record + checkpoint, publish, sync), with the store writes
on the background thread (`trainer.background_publish: true`, the default) or inside the phases (false).

On the default job (`configs/smollm2-arith-grpo.yaml`: SmolLM2-135M-Instruct, LoRA rank 16 on all linear
layers, the embedded engine, `engine.sync: tensor`) with a `file://` store in a temp folder. Each of `--steps`
steps: an AdamW step on random gradients stands for the update (untimed; it gives the checkpoint its real
size: LoRA weights and both moments), then the phases' tails are timed as the loop runs them:
`phases.record_train` (the train record and, every step, a checkpoint: the default `checkpoint_every: 1`),
`versions.publish` and `versions.sync`. In background mode the writes finish during the next rollout: here
an untimed `flush`, whose seconds are reported apart (the write time moved off the critical path).
`--latency-ms` adds that latency to every store write and create (`StoreIO.put` / `create`), as an object
store's round trip would.

    PYTHONPATH=. .venv/bin/python benchmarks/background_publish.py [--steps 5] [--latency-ms 0 50]

Writes `benchmarks/results/background_publish.json` (or `--out`) and prints a table naming the CPU.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's lora_rl_core
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads, as the CLI does (lora_rl_core.runtime)

# isort: split
import torch  # noqa: E402
from _common import RESULTS, ROOT, machine_info, print_table, write_json  # noqa: E402

PARTS = ("record_s", "publish_s", "sync_s", "critical_s", "flush_s")


class StoreLatency:
    """Makes every `StoreIO.put` / `create` of this process sleep `seconds` first (an object store's round trip)."""

    seconds = 0.0

    @classmethod
    def install(cls) -> None:
        from lora_rl_core.store import io

        for name in ("put", "create"):
            original = getattr(io.StoreIO, name)

            def delayed(self: Any, *args: Any, _original: Any = original, **kwargs: Any) -> Any:
                if cls.seconds:
                    time.sleep(cls.seconds)
                return _original(self, *args, **kwargs)

            setattr(io.StoreIO, name, delayed)


def fake_update(trainer: Any) -> None:
    """One AdamW step on small random gradients: the LoRA moves and the optimizer holds both moments."""
    for p in trainer.params:
        p.grad = torch.randn_like(p) * 1e-3
    trainer.optimizer.step()
    trainer.optimizer.zero_grad(set_to_none=True)


def run_mode(config: str, background: bool, steps: int) -> list[dict[str, float]]:
    """Time `steps` step tails of a fresh run with `trainer.background_publish` = `background`."""
    from lora_rl_core.config import load_config
    from lora_rl_core.records import TrainStats
    from lora_rl_core.run import open_run, phases, versions

    with tempfile.TemporaryDirectory(prefix="bg-publish-") as tmp:
        overrides = [
            f"run.output_dir={tmp}",
            f"store.uri=file://{tmp}/store",
            "engine.sync=tensor",
            "trainer.checkpoint_every=1",
            f"trainer.background_publish={str(background).lower()}",
        ]
        run = open_run(load_config(config, overrides), "bg-publish")
        rows: list[dict[str, float]] = []
        try:
            versions.sync(run, versions.publish(run, 0))
            versions.flush(run)
            for step in range(1, steps + 1):
                fake_update(run.trainer)
                stats = TrainStats(trainer={}, trained_rows=0, stale_rejected=0, uniform_skipped=0, checkpointed=True)
                t0 = time.perf_counter()
                phases.record_train(run, step, stats)
                t1 = time.perf_counter()
                ref = versions.publish(run, step, {})
                t2 = time.perf_counter()
                versions.sync(run, ref)
                t3 = time.perf_counter()
                versions.flush(run)  # the next rollout's time, in background mode
                t4 = time.perf_counter()
                parts = (t1 - t0, t2 - t1, t3 - t2, t3 - t0, t4 - t3)
                rows.append(dict(zip(PARTS, parts, strict=True)))
                print(f"  background={background}: step {step} {rows[-1]}", file=sys.stderr, flush=True)
            assert run.store.versions("bg-publish") == list(range(steps + 1))
            assert run.checkpoints.latest("bg-publish") == steps
        finally:
            run.close()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=5, help="timed step tails per mode (after version 0)")
    parser.add_argument("--latency-ms", type=float, nargs="+", default=[0.0], help="store write latencies to add")
    parser.add_argument("--config", default=str(ROOT / "configs" / "smollm2-arith-grpo.yaml"))
    parser.add_argument("--out", type=Path, default=RESULTS / "background_publish.json")
    args = parser.parse_args()

    from lora_rl_core.runtime import cpu_description

    results: dict[str, Any] = {}
    table = []
    StoreLatency.install()
    for latency_ms in args.latency_ms:
        StoreLatency.seconds = latency_ms / 1000
        for background in (False, True):
            rows = run_mode(args.config, background, args.steps)
            medians = {part: statistics.median(r[part] for r in rows) for part in PARTS}
            key = f"{'background' if background else 'inline'}, +{latency_ms:g} ms/write"
            results[key] = {"latency_ms": latency_ms, "background": background, "steps": rows, "median": medians}
            table.append([key, *(medians[p] for p in PARTS)])
    print_table(f"Step tail after the update, median seconds ({cpu_description()})", ["mode", *PARTS], table)
    write_json(
        {
            "benchmark": "background_publish",
            "command": " ".join(["PYTHONPATH=. .venv/bin/python benchmarks/background_publish.py", *sys.argv[1:]]),
            "machine": machine_info("cpu"),
            "config": Path(args.config).name,
            "runs": results,
        },
        args.out,
    )


if __name__ == "__main__":
    main()
