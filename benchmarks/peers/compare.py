"""lora-rl against a peer on the same GPU, the same shape, batch and lengths (issue 46, item 5): a table and a JSON.

Reads our `benchmarks/gpu_scale.py` JSON and verl's per-step metrics (`trainer.logger=file`, one JSON line a step,
`timing_s/*` and `perf/*`) from one folder that `verl/side_by_side.sh` filled, and writes `compare.json` beside
them. Medians over steps 2..N (step 1 holds each side's compilation and warm-up). Units: seconds a step, tokens a
second over the whole GPU; rollout tokens/s is completion tokens over the generation phase.

    .venv/bin/python benchmarks/peers/compare.py benchmarks/results/peers/verl-1.5b-1gpu-h200
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared table and JSON writer
from _common import print_table, write_json  # noqa: E402


def ours(path: Path) -> dict[str, Any]:
    """Our side from a `gpu_scale.py` JSON: step, rollout and train seconds, tokens a step and tokens/s."""
    d = json.loads(path.read_text())
    steps = [s for s in d["steps"] if s["step"] >= 2 and not s["profiled"]]
    med = lambda f: statistics.median(f(s) for s in steps)  # noqa: E731
    step, trained, completion = (
        med(lambda s: s["step_seconds"]),
        med(lambda s: s["trained_tokens"]),
        med(lambda s: s["completion_tokens"]),
    )
    rollout = med(lambda s: s["seconds"]["rollout"])
    return {
        "side": "lora-rl",
        "steps": len(d["steps"]),
        "step_seconds": step,
        "rollout_seconds": rollout,
        "train_seconds": med(lambda s: s["seconds"]["train"]),
        "sync_seconds": med(lambda s: s["seconds"]["sync"] + s["seconds"]["publish"]),
        "tokens_per_step": trained,
        "tokens_per_second": trained / step,
        "rollout_tokens_per_second": completion / rollout,
        "setup_seconds": d["setup_seconds"],
        "first_step_seconds": d["steps"][0]["step_seconds"],
    }


def verl(path: Path) -> dict[str, Any]:
    """verl's side from its file logger's lines: `timing_s/step`, `gen`, `update_actor`, `update_weights`."""
    rows = [json.loads(line)["data"] for line in path.read_text().splitlines() if line.strip()]
    later = rows[1:]
    med = lambda k: statistics.median(r[k] for r in later)  # noqa: E731
    step, tokens = med("timing_s/step"), med("perf/total_num_tokens")
    completion = med("response_length/mean") * tokens / (med("response_length/mean") + med("prompt_length/mean"))
    return {
        "side": "verl 0.9.1",
        "steps": len(rows),
        "step_seconds": step,
        "rollout_seconds": med("timing_s/gen"),
        "train_seconds": med("timing_s/update_actor") + med("timing_s/old_log_prob"),
        "sync_seconds": med("timing_s/update_weights"),
        "tokens_per_step": tokens,
        "tokens_per_second": tokens / step,
        "rollout_tokens_per_second": completion / med("timing_s/gen"),
        "setup_seconds": None,
        "first_step_seconds": rows[0]["timing_s/step"],
    }


def main() -> None:
    """Print the table and write `compare.json` in the folder."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folder", type=Path)
    args = p.parse_args()
    sides = [ours(args.folder / "ours.json"), verl(args.folder / "verl-metrics.jsonl")]
    gpu = json.loads((args.folder / "ours.json").read_text())["gpu"]
    keys = [k for k in sides[0] if k != "side"]
    rows = [[k, *("-" if s[k] is None else float(s[k]) for s in sides)] for k in keys]
    print_table(f"one {gpu}: medians of steps 2..N", ["", *(s["side"] for s in sides)], rows)
    ratio = sides[1]["step_seconds"] / sides[0]["step_seconds"]
    print(f"verl's step / ours: {ratio:.2f}x")
    write_json({"gpu": gpu, "sides": sides, "peer_step_over_ours": ratio}, args.folder / "compare.json")


if __name__ == "__main__":
    main()
