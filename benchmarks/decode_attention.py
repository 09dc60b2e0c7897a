"""One decode step's attention on the CPU: the embedded engine's `decode_attention` (grouped heads as batched
matmuls, `lora_rl_core.engines.embedded.attention`) against transformers' SDPA function as it runs it there
(`sdpa_attention_forward`: `enable_gqa` without a mask, `pack_gqa` with one), on the same tensors,
alternating, in one process.

The default shapes are the default job's decode steps (SmolLM2-135M: 9 query heads over 3 key/value heads of
64 dims, bfloat16) for 64, 40 and 16 rows over 40 and 100 cached positions, with and without a padding mask.

    PYTHONPATH=. .venv/bin/python benchmarks/decode_attention.py

Writes `benchmarks/results/decode_attention.json` (or `--out`) and prints a table naming the CPU.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from _common import RESULTS, machine_info, print_table, write_json
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from lora_rl_core.engines.embedded.attention import decode_attention
from lora_rl_core.runtime import configure_threads, cpu_description


class _Layer(torch.nn.Module):
    def __init__(self, groups: int) -> None:
        super().__init__()
        self.num_key_value_groups = groups
        self.is_causal = True


def time_arm(fn: Any, layer: _Layer, args: tuple[Any, ...], repeats: int) -> float:
    """Median seconds of one call over `repeats` calls (after one warm-up call)."""
    fn(layer, *args, scaling=0.125)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(layer, *args, scaling=0.125)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--rows", type=int, nargs="+", default=[64, 40, 16])
    parser.add_argument("--positions", type=int, nargs="+", default=[40, 100])
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--out", type=Path, default=RESULTS / "decode_attention.json")
    args = parser.parse_args()
    threads = configure_threads()
    layer = _Layer(args.heads // args.kv_heads)
    gen = torch.Generator().manual_seed(0)
    results, rows = [], []
    for batch in args.rows:
        for positions in args.positions:
            for masked in (False, True):
                query = torch.randn(batch, args.heads, 1, args.head_dim, generator=gen).bfloat16()
                key, value = (
                    torch.randn(batch, args.kv_heads, positions, args.head_dim, generator=gen).bfloat16()
                    for _ in range(2)
                )
                mask = None
                if masked:  # a quarter of the rows left-padded by 8 positions
                    mask = torch.ones(batch, 1, 1, positions, dtype=torch.bool)
                    mask[: batch // 4, ..., :8] = False
                call = (query, key, value, mask)
                arms = {"sdpa": sdpa_attention_forward, "decode_attention": decode_attention}
                seconds: dict[str, list[float]] = {name: [] for name in arms}
                for i in range(4):  # alternate the arms' order
                    for name in arms if i % 2 == 0 else reversed(list(arms)):
                        seconds[name].append(time_arm(arms[name], layer, call, args.repeats // 4))
                diff = (
                    (
                        decode_attention(layer, *call, scaling=0.125)[0]
                        - sdpa_attention_forward(layer, *call, scaling=0.125)[0]
                    )
                    .abs()
                    .max()
                    .item()
                )
                sdpa_ms, ours_ms = (statistics.median(seconds[n]) * 1e3 for n in arms)
                results.append(
                    {
                        "rows": batch,
                        "positions": positions,
                        "mask": masked,
                        "sdpa_ms": sdpa_ms,
                        "decode_attention_ms": ours_ms,
                        "max_abs_diff": diff,
                    }
                )
                rows.append(
                    [batch, positions, "yes" if masked else "no", sdpa_ms, ours_ms, f"{sdpa_ms / ours_ms:.1f}x"]
                )
    cpu = cpu_description()
    print_table(
        f"one decode step's attention, {args.heads} heads over {args.kv_heads} kv heads x {args.head_dim}, bf16, "
        f"{cpu}, {threads} threads (ms per call, median)",
        ["rows", "cached positions", "padding mask", "sdpa", "decode_attention", "speed-up"],
        rows,
    )
    write_json(
        {
            "benchmark": "decode_attention",
            "heads": args.heads,
            "kv_heads": args.kv_heads,
            "head_dim": args.head_dim,
            "results": results,
            "machine": machine_info("cpu") | {"cpu": cpu, "threads": threads},
        },
        args.out,
    )


if __name__ == "__main__":
    main()
