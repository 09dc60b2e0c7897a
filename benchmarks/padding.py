"""How much of the trainer's forward is padding (issue 34, item 3): the rollouts of a finished run, cut into
micro-batches as the trainer cuts them (rows sorted by length, `rank_micro_batches`), each right-padded to its
longest row (`pack`). The share of padded positions (`batching.padding_fraction`) bounds what padding-free
packing (varlen attention: TRL's `padding_free`, verl's `use_remove_padding`) could remove from the forward
and backward, per micro-batch size; "unsorted" is the same without the sort, for scale.

    lora-rl train -c configs/smollm2-arith-grpo.yaml trainer.steps=4 run.eval_before_after=false \\
        run.output_dir=/tmp/pad/runs store.uri=file:///tmp/pad/store
    python benchmarks/padding.py --store file:///tmp/pad/store --run <run id from the log>

Every row of each step counts (as with `algorithm.skip_uniform_groups=false`), as one minibatch on one rank
(the default config); writes
`benchmarks/results/padding.json` and prints a table.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# isort: split
from _common import RESULTS, machine_info, print_table, write_json  # noqa: E402

from lora_rl_core.errors import LoraRLError, StoreError  # noqa: E402
from lora_rl_core.records import RolloutBatch  # noqa: E402
from lora_rl_core.run.rundir import RunDir  # noqa: E402
from lora_rl_core.trainer.batching import padding_fraction, rank_micro_batches  # noqa: E402

SIZES = (8, 16, 32, 64)


def step_padding(lengths: list[int], sizes: tuple[int, ...] = SIZES) -> dict[str, float]:
    """Padding fractions of one step's rows: length-sorted micro-batches of each size, and unsorted ones of 16."""
    rows = list(range(len(lengths)))
    out = {f"sorted_{size}": padding_fraction(lengths, rank_micro_batches(lengths, rows, size=size)) for size in sizes}
    out["unsorted_16"] = padding_fraction(lengths, [rows[i : i + 16] for i in range(0, len(rows), 16)])
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--store", required=True, help="the run's store URI (file://... or s3://...)")
    p.add_argument("--run", required=True, help="the run id")
    p.add_argument("--out", type=Path, default=RESULTS / "padding.json")
    args = p.parse_args()
    run_dir = RunDir(args.store, args.run)
    steps: list[dict[str, Any]] = []
    step = 1
    while True:
        try:
            rows = run_dir.read_phase("rollouts", step, RolloutBatch).rows
        except StoreError:  # the store failed: not the end of the run
            raise
        except LoraRLError:  # no rollouts of this step (the run ended before it), or a malformed record
            break
        if not rows:
            step += 1
            continue
        lengths = [len(r.prompt_ids) + len(r.completion_ids) for r in rows]
        steps.append(
            {"step": step, "rows": len(rows), "min": min(lengths), "max": max(lengths), **step_padding(lengths)}
        )
        step += 1
    if not steps:
        raise SystemExit(f"no rollouts of run {args.run} in {args.store}")
    keys = [k for k in steps[0] if k.startswith(("sorted", "unsorted"))]
    median = {k: statistics.median(s[k] for s in steps) for k in keys}
    record = {"store": args.store, "run": args.run, "steps": steps, "median": median, "machine": machine_info("cpu")}
    write_json(record, args.out)
    print_table(
        f"padded share of the computed positions, run {args.run}",
        ["step", "rows", "tokens min..max", *keys],
        [[s["step"], s["rows"], f"{s['min']}..{s['max']}", *(s[k] for k in keys)] for s in steps]
        + [["median", "", "", *median.values()]],
    )


if __name__ == "__main__":
    main()
