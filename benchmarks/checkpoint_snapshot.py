"""What a checkpoint costs the train phase with sharded ranks: the whole state gathered through rank 0 into the
run's process (`Trainer.state_dict`, how a checkpoint was taken before issue 46) against each rank's own
snapshot (`Trainer.save_checkpoint`, which returns once every rank copied its part; the serialising and the
upload run behind, on each rank's thread: `written_checkpoints(wait=True)` times that part apart).

Both on the same ranks in one run, alternating, after one train step (so AdamW's moments exist). The model is
the config's (default: the real SmolLM2-135M of `configs/smollm2-arith-grpo.yaml`), with `trainer.backend`
local and `--ranks` ranks on this machine's device:

    PYTHONPATH=. .venv/bin/python benchmarks/checkpoint_snapshot.py --ranks 2 --repeats 6

Writes `benchmarks/results/checkpoint_snapshot.json` (or `--out`) and prints a table naming the machine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's lora_rl_core
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads, as the CLI does

# isort: split
import torch  # noqa: E402
from _common import RESULTS, ROOT, machine_info, print_table, write_json  # noqa: E402

from lora_rl_core.checkpoint import CheckpointTarget  # noqa: E402
from lora_rl_core.config import load_config  # noqa: E402
from lora_rl_core.plan import make_plan  # noqa: E402
from lora_rl_core.records import TrainBatch  # noqa: E402
from lora_rl_core.runtime import cpu_description  # noqa: E402
from lora_rl_core.trainer.workers import TrainerWorkers  # noqa: E402

ARMS = ("gathered", "rank_snapshot", "rank_upload_behind")


def _batch(rows: int, seed: int = 1) -> TrainBatch:
    """`rows` rows of 40 prompt and 20 completion tokens: one step, so that AdamW's moments exist."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(10, 1000, (40,), generator=g).tolist() for _ in range(rows)]
    completions = [torch.randint(10, 1000, (20,), generator=g).tolist() for _ in range(rows)]
    return TrainBatch(prompts, completions, [(-1.0) ** i / 2 for i in range(rows)], [[-1.0] * 20] * rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(ROOT / "configs" / "smollm2-arith-grpo.yaml"))
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--override", action="append", default=[], help="dotted config override (repeatable)")
    parser.add_argument("--out", type=Path, default=RESULTS / "checkpoint_snapshot.json")
    args = parser.parse_args()
    backend = ["trainer.backend=local", f"trainer.backend.world_size={args.ranks}"]
    cfg = load_config(args.config, [*backend, f"trainer.backend.device={args.device}", *args.override])
    plan = make_plan(cfg).trainer
    assert plan is not None
    seconds: dict[str, list[float]] = {arm: [] for arm in ARMS}
    with tempfile.TemporaryDirectory() as tmp, TrainerWorkers(plan, timeout_s=600) as ranks:
        ranks.train_step(_batch(8 * args.ranks))
        for i in range(args.repeats):
            start = time.perf_counter()
            state = ranks.state_dict()
            seconds["gathered"].append(time.perf_counter() - start)
            state_bytes = sum(t.numel() * t.element_size() for t in state["tensors"].values())
            del state
            start = time.perf_counter()
            ranks.save_checkpoint(CheckpointTarget(f"file://{tmp}", "snapshot", i + 1))
            seconds["rank_snapshot"].append(time.perf_counter() - start)
            start = time.perf_counter()
            reports = ranks.written_checkpoints(wait=True)
            seconds["rank_upload_behind"].append(time.perf_counter() - start)
            assert len(reports) == args.ranks and all(r.error is None for r in reports), reports
    medians = {arm: statistics.median(v) for arm, v in seconds.items()}
    info = machine_info(args.device)
    where = cpu_description() if args.device == "cpu" else info["device_name"]
    print_table(
        f"checkpoint snapshot, {args.ranks} local ranks on {where}, {state_bytes / 2**20:.1f} MiB of "
        f"trainer state; median of {args.repeats}",
        ["gathered into the run (s)", "ranks' own snapshot (s)", "ranks' upload, behind the step (s)"],
        [[medians["gathered"], medians["rank_snapshot"], medians["rank_upload_behind"]]],
    )
    write_json(
        {
            "benchmark": "checkpoint_snapshot",
            "command": " ".join(["PYTHONPATH=. .venv/bin/python benchmarks/checkpoint_snapshot.py", *sys.argv[1:]]),
            "machine": info,
            "cpu": cpu_description(),
            "ranks": args.ranks,
            "state_bytes": state_bytes,
            "median_seconds": medians,
            "seconds": seconds,
        },
        args.out,
    )


if __name__ == "__main__":
    main()
