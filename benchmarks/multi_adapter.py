"""Multi-adapter batching: tokens/s with 1, 4 and 8 distinct LoRA adapters in one mixed batch vs serving the
same requests one adapter at a time.

On a random-weight Qwen2.5-0.5B-shaped model (`benchmarks/model_configs/qwen2.5-0.5b.json`) in an in-process
`EmbeddedEngine` (`max_batch_size = --batch`, `max_loras_per_batch = max adapters + 1`, the base model's slot
kept free, sglang#23141). `--batch` prompts of `--prompt-len` random tokens, `--max-new-tokens` greedy tokens
each; request i names adapter `i % k` (rank `--rank`, all linear layers, random non-zero weights).

* mixed: one `generate` call with every request: one forward batch routing each row through its own adapter
  (PEFT `adapter_names=`);
* one at a time: one `generate` call per adapter with its requests (k smaller batches, in turn).

tokens/s = completion tokens returned / wall seconds of the calls (median of `--repeats` after a warm-up),
end to end through the engine: admission, the decode loop, and the engine's per-token logprobs (taken in
the loop, from each step's logits). A `base` row (no adapter) is the reference.

Usage::

    PYTHONPATH=. python benchmarks/multi_adapter.py --device cuda
    PYTHONPATH=. python benchmarks/multi_adapter.py --device cpu --tiny    # smoke test
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import _common
import torch
from _common import ALL_LINEAR, MODEL_CONFIGS, RESULTS, machine_info, print_table, random_model, write_json

from lora_rl_core.engines import EmbeddedEngine, GenerationRequest, SamplingParams
from lora_rl_testing.adapters import random_lora_factory


def requests_for(prompts: list[list[int]], names: list[str | None], params: SamplingParams) -> list[GenerationRequest]:
    """Request i names adapter `names[i % len(names)]`."""
    return [GenerationRequest(p, names[i % len(names)], params) for i, p in enumerate(prompts)]


def timed_generate(engine: EmbeddedEngine, batches: list[list[GenerationRequest]]) -> tuple[float, int]:
    """Run the batches in turn; wall seconds and completion tokens (every request must complete)."""
    start = time.perf_counter()
    tokens = 0
    for batch in batches:
        for c in engine.generate(batch, timeout_s=1800.0):
            if c.finish_reason == "abort":
                raise RuntimeError(f"request {c.request_id} aborted: {c.abort_reason}")
            tokens += len(c.completion_ids)
    return time.perf_counter() - start, tokens


def by_adapter(requests: list[GenerationRequest]) -> list[list[GenerationRequest]]:
    """The requests grouped per adapter, in first-seen order."""
    groups: dict[str | None, list[GenerationRequest]] = {}
    for r in requests:
        groups.setdefault(r.adapter, []).append(r)
    return list(groups.values())


MODES = ("mixed", "one_at_a_time")


def bench_case(
    engine: EmbeddedEngine, prompts: list, names: list, params: SamplingParams, repeats: int, modes: tuple = MODES
) -> dict:
    """Mixed vs one-at-a-time for one adapter set: median seconds, tokens, tokens/s, speed-up. With one
    adapter (or the base model) both modes are the same single batch: it runs once and is reported for both.
    `modes=("mixed",)` times the mixed batch only (no `one_at_a_time`, no `speedup`)."""
    out: dict[str, Any] = {"adapters": len([n for n in names if n is not None])}
    for mode in modes:
        if mode == "one_at_a_time" and len(names) == 1:
            out[mode] = {**out["mixed"], "same_as_mixed": True}
            continue
        runs = []
        for _ in range(repeats):
            requests = requests_for(prompts, names, params)  # fresh request ids
            batches = [requests] if mode == "mixed" else by_adapter(requests)
            runs.append(timed_generate(engine, batches))
        seconds = statistics.median(s for s, _ in runs)
        tokens = runs[0][1]
        out[mode] = {"batches": len(batches), "seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds}
        out[mode]["seconds_all"] = [s for s, _ in runs]
    if "one_at_a_time" in out:
        out["speedup"] = out["mixed"]["tokens_per_s"] / out["one_at_a_time"]["tokens_per_s"]
    return out


def load_adapters(engine: EmbeddedEngine, model: torch.nn.Module, count: int, rank: int) -> list[str]:
    """Load `count` random adapters `adapter-0..`; returns their names."""
    make = random_lora_factory(model, rank=rank, targets=ALL_LINEAR, scale=0.02)
    names = [f"adapter-{j}" for j in range(count)]
    for j, name in enumerate(names):
        tensors, config = make(j + 1)
        engine.load_adapter(name, tensors=tensors, config=config)
    return names


def main() -> None:
    """Parse arguments, build the model, engine and adapters, run every case, print the table, write JSON."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="auto", help="cpu | cuda | auto")
    parser.add_argument("--dtype", default="auto", help="auto = bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--adapters", default="1,4,8", help="distinct adapters per batch")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=1, help="timed runs per case (median); ~3 min each on an H200")
    parser.add_argument("--model-config", type=Path, default=MODEL_CONFIGS / "qwen2.5-0.5b.json")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--tiny", action="store_true", help="smoke test: tiny model, batch 16, 16 new tokens")
    parser.add_argument("--out", type=Path, default=None, help="default: results/multi_adapter_<device>.json")
    args = parser.parse_args()
    if args.tiny:
        args.batch, args.max_new_tokens, args.prompt_len, args.repeats = 16, 16, 16, 1
    device = _common.resolve_device(args.device)
    dtype = _common.default_dtype(device, args.dtype)
    counts = [int(k) for k in args.adapters.split(",")]
    cfg = _common.model_config(None if args.tiny else args.model_config, layers=args.layers)

    model = random_model(cfg, device=device, dtype=dtype)
    gen = torch.Generator().manual_seed(0)
    vocab = cfg["vocab_size"]
    prompts = [torch.randint(3, vocab, (args.prompt_len,), generator=gen).tolist() for _ in range(args.batch)]
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=0.0)
    engine = EmbeddedEngine(
        model, _common.stub_tokenizer(cfg), max_batch_size=args.batch, max_loras_per_batch=max(counts) + 1
    )
    with engine:
        names = load_adapters(engine, model, max(counts), args.rank)
        cases = {"base": [None], **{str(k): names[:k] for k in counts}}
        timed_generate(engine, [requests_for(prompts, [None], params)])  # warm-up at full size: allocations
        warm = SamplingParams(max_new_tokens=4, temperature=0.0)
        for case in cases.values():  # warm-up: every adapter resident, kernels compiled
            bench_case(engine, prompts, case, warm, 1)
        results: dict[str, Any] = {}
        for label, case in cases.items():
            results[label] = bench_case(engine, prompts, case, params, args.repeats)
            save(args, cfg, device, dtype, results, complete=False)  # partial results survive a time limit
    save(args, cfg, device, dtype, results, complete=True)
    show(args, device, results)


def show(args: argparse.Namespace, device: str, results: dict[str, Any]) -> None:
    """The rich table: tokens/s of both modes and the speed-up, per case."""
    model_name = "tiny-qwen2" if args.tiny else args.model_config.stem
    rows = [
        [label, r["adapters"], r["mixed"]["tokens_per_s"], r["one_at_a_time"]["tokens_per_s"], r["speedup"]]
        for label, r in results.items()
    ]
    title = f"{model_name}, {device}, {args.batch} requests x {args.max_new_tokens} tokens, rank {args.rank}"
    print_table(title, ["case", "adapters", "mixed tok/s", "one at a time tok/s", "speed-up"], rows)


def save(
    args: argparse.Namespace,
    cfg: dict,
    device: str,
    dtype: torch.dtype,
    results: dict,
    *,
    complete: bool,
) -> None:
    """Write the JSON record (`complete` is False until every case is in)."""
    write_json(
        {
            "benchmark": "multi_adapter",
            "complete": complete,
            "model": {"name": "tiny-qwen2" if args.tiny else args.model_config.stem, "config": cfg},
            "dtype": str(dtype),
            "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "lora": {"rank": args.rank, "targets": list(ALL_LINEAR)},
            "machine": machine_info(device),
            "results": results,
        },
        args.out or RESULTS / f"multi_adapter_{device.split(':')[0]}.json",
    )


if __name__ == "__main__":
    sys.exit(main())
