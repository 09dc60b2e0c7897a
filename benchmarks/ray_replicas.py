"""Rollout throughput with 1 vs 2 engine replicas on Ray, and the in-process engine, in one run (issue: Ray).

The same rollout batch (`--prompts` prompts x `--group` samples, `--max-new-tokens` tokens, temperature 1,
seeded) goes to: the in-process `EmbeddedEngine` (torch on every core), one Ray replica holding every core,
and two Ray replicas holding half the cores each (with `--device cuda`: sharing the GPU, half each;
`engine.ray_replicas`; the samples of a prompt stay on one replica). tokens/s = completion tokens / wall
seconds of one `generate` call, median of `--repeats` after a warm-up; the model is `--model` (default the
offline SmolLM2-135M-Instruct) on `--device`.

Usage::

    PYTHONPATH=. python benchmarks/ray_replicas.py [--prompts 16 --group 4 --max-new-tokens 32]
    PYTHONPATH=/tmp/raysite:/tmp/ours:. python3 benchmarks/ray_replicas.py --device cuda \\
        --model /tmp/models/smollm2-gguf --prompts 64 --group 8 --max-new-tokens 64      # GPU host
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import _common
from _common import RESULTS, machine_info, print_table, write_json

from lora_rl_core.config import EmbeddedEngineConfig, ModelConfig
from lora_rl_core.engines import EngineInputs, GenerationRequest, SamplingParams, ServingEngine
from lora_rl_core.engines.embedded.build import build_embedded_engine, embedded_engine
from lora_rl_core.engines.launch.ray_replicas import start_ray_replicas
from lora_rl_core.models import load_tokenizer


def rollout(engine: ServingEngine, requests: list[GenerationRequest], repeats: int) -> dict[str, Any]:
    """A warm-up call, then `repeats` timed calls; median tokens/s."""
    engine.generate(requests[: max(1, len(requests) // 4)])
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        done = engine.generate(requests)
        seconds = time.perf_counter() - start
        runs.append((sum(len(c.completion_ids) for c in done) / seconds, seconds))
    rates = [r for r, _ in runs]
    return {"tokens_per_s": statistics.median(rates), "tokens_per_s_all": rates, "seconds_all": [s for _, s in runs]}


def main() -> None:
    """Run the three cases, print the table, write JSON."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None, help="default: results/ray_replicas_<device>.json")
    args = parser.parse_args()
    cores = os.cpu_count() or 2
    model_cfg = ModelConfig(name_or_path=args.model, device=args.device)
    engine_cfg = EmbeddedEngineConfig(max_batch_size=args.prompts * args.group)
    tokenizer = load_tokenizer(model_cfg)
    texts = [f"What is {13 * i % 90 + 10} + {7 * i % 90 + 10}? Give the final answer after ####." for i in range(64)]
    prompts = [tokenizer(t)["input_ids"] for t in texts[: args.prompts]]
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=1.0, seed=0)
    requests = [GenerationRequest(p, None, params) for p in prompts for _ in range(args.group)]
    results: dict[str, Any] = {}
    with build_embedded_engine(engine_cfg, model_cfg, None) as local:
        results["in-process"] = {"replicas": 0, "cpus_each": cores, **rollout(local, requests, args.repeats)}
    gpus = 1.0 if args.device.startswith("cuda") else 0.0  # on a GPU the replicas share it: 1 / replicas each
    for replicas in (1, 2):  # each group starts a local Ray and stops it when closed (`ray_cluster`)
        replica_cfg = engine_cfg.model_copy(update={"ray_replicas": replicas, "ray_gpus_per_replica": gpus / replicas})
        group = start_ray_replicas(embedded_engine, EngineInputs(replica_cfg, model_cfg), num_cpus=cores / replicas)
        try:
            case = rollout(group.engine, requests, args.repeats)
        finally:
            group.close()
        results[f"ray x{replicas}"] = {
            "replicas": replicas,
            "cpus_each": cores / replicas,
            "gpus_each": gpus / replicas,
            **case,
        }
    device = _common.resolve_device(args.device)
    write_json(
        {
            "benchmark": "ray_replicas",
            "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "machine": machine_info(device),
            "results": results,
        },
        args.out or RESULTS / f"ray_replicas_{device}.json",
    )
    base = results["ray x1"]["tokens_per_s"]
    rows = [
        [name, r["replicas"], r["cpus_each"], r["tokens_per_s"], r["tokens_per_s"] / base]
        for name, r in results.items()
    ]
    title = f"{args.model}: {args.prompts} prompts x {args.group} samples x {args.max_new_tokens} tokens, {device}"
    print_table(title, ["case", "replicas", "CPUs each", "tokens/s", "vs 1 replica"], rows)


if __name__ == "__main__":
    sys.exit(main())
