"""Moving a trainer rank's tensors to the parent: `PackedTensors` (shared memory) against safetensors bytes.

An FSDP2 rank hands its parent a copy of the adapter at every publish and of the whole trainer state (LoRA
weights and both AdamW moments) at every checkpoint (`lora_rl_core/trainer/workers.py`). This times that
hand-over for the sizes of a 7B and a 32B run (LoRA rank 16 on every linear module: 40.4M and 134.2M float32
parameters, 392 and 448 tensors), in a spawned process like a rank, each way in one run:

    bytes    `safetensors` bytes of the tensors, pickled through the pipe, loaded in the parent (the wire
             format before PackedTensors)
    copied   a CPU copy of each tensor first (the rank's gather before 2026-11-27: `.to("cpu", copy=True)`),
             then as `packed`
    packed   `PackedTensors.pack` straight from the rank's tensors (one shared-memory buffer per dtype), the
             buffer's file descriptor through the pipe, `unpack` (a copy of each tensor) in the parent

On a GPU host the rank's tensors are on the GPU: `copied` then stands for a device-to-host copy into fresh
memory followed by a host copy into the buffer, `packed` for the device-to-host copy into the buffer alone.

    PYTHONPATH=. .venv/bin/python benchmarks/rank_transfer.py

Writes `benchmarks/results/rank_transfer.json` and prints a table naming the CPU. The medians of `--repeats`.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's lora_rl_core

# isort: split
import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from _common import RESULTS, machine_info, print_table, write_json  # noqa: E402
from safetensors.torch import load as load_tensors  # noqa: E402

from lora_rl_core.adapters.io import safetensors_bytes  # noqa: E402
from lora_rl_core.trainer.workers import PackedTensors  # noqa: E402

CASES = {  # what a rank sends: the adapter (publish) and the trainer state (checkpoint: weights + 2 moments)
    "7B adapter": (40_370_176, 392),
    "7B checkpoint state": (3 * 40_370_176, 3 * 392),
    "32B adapter": (134_217_728, 448),
    "32B checkpoint state": (3 * 134_217_728, 3 * 448),
}
WAYS = ("bytes", "copied", "packed")


def _rank(conn: Any, params: int, tensors: int, way: str, repeats: int) -> None:
    state = {f"t{i}": torch.randn(params // tensors) for i in range(tensors)}
    for _ in range(repeats):
        conn.recv()
        start = time.perf_counter()
        if way == "bytes":
            payload: Any = safetensors_bytes(state, metadata=None)
        else:
            copies = {k: v.to("cpu", copy=True) for k, v in state.items()} if way == "copied" else state
            payload = PackedTensors.pack(copies)
            del copies
        conn.send((payload, start))
    conn.recv()


def measure(params: int, tensors: int, way: str, repeats: int) -> float:
    """Median seconds from the rank starting to pack to the parent holding its own tensors."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_rank, args=(child, params, tensors, way, repeats))
    proc.start()
    times = []
    try:
        for _ in range(repeats):
            parent.send("go")
            payload, start = parent.recv()
            got = load_tensors(payload) if way == "bytes" else payload.unpack()
            times.append(time.perf_counter() - start)  # perf_counter is system-wide on Linux (CLOCK_MONOTONIC)
            del got, payload
        parent.send("done")
    finally:
        proc.join(60)
        if proc.is_alive():
            proc.kill()
    return statistics.median(times)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    p.add_argument("--out", type=Path, default=RESULTS / "rank_transfer.json")
    args = p.parse_args(argv)
    rows = []
    for case in args.cases:
        params, tensors = CASES[case]
        result = {way: measure(params, tensors, way, args.repeats) for way in WAYS}
        rows.append({"case": case, "mb": params * 4 / 1e6, "tensors": tensors, **result})
    machine = machine_info("cpu")
    write_json({"rows": rows, "repeats": args.repeats, "machine": machine}, args.out)
    print_table(
        f"A rank's tensors to its parent, seconds (median of {args.repeats}; {machine['device_name']})",
        ["case", "MB", "tensors", "safetensors bytes s", "copied, packed s", "packed s", "packed vs copied"],
        [
            [r["case"], r["mb"], r["tensors"], r["bytes"], r["copied"], r["packed"], r["copied"] / r["packed"]]
            for r in rows
        ],
    )
    return {"rows": rows}


if __name__ == "__main__":
    main()
