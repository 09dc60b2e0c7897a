"""Sync latency: publish -> first completion served by the new adapter version, tensor path vs store path.

On a random-weight Qwen2.5-0.5B-shaped model (`benchmarks/model_configs/qwen2.5-0.5b.json`) in an in-process
`EmbeddedEngine`, for LoRA ranks 8/32/64 on all linear layers (q, k, v, o, gate, up, down of every layer).
The trainer's adapter state dict lives on the device (float32, as PEFT trains it). One measurement, from
the trainer's state dict to the first completion the engine serves with the new version:

* `tensor`: export (`detach().to("cpu")`, what the colocated trainer hands over) -> `engine.load_adapter(name,
  tensors=..., config=...)` -> first `generate` (one 16-token prompt, 1 greedy token) naming the new version;
* `store`: `AdapterStore.publish` (safetensors + sha256 + files + manifest, a `file://` temp folder) ->
  `engine.load_adapter(name, path=ref.uri)` (reads and sha256-verifies it) -> first `generate`;
* `sync_version`: publish -> `subscriber.sync_version(engine, ref, store=store, keep=2)` (the flow's path:
  verifies the version in the store, loads it as above, checks the listing, retires stale versions) ->
  first `generate`.

Columns: publish (export or store publish), load, first completion, total; medians over `--repeats` after one
untimed warm-up load per rank; MB = 10**6 bytes of the adapter's safetensors file. Between measurements the
previous version is unloaded (untimed), so the engine holds one or two versions, as with `keep=2`.

Usage::

    PYTHONPATH=. python benchmarks/sync_latency.py --device cpu [--ranks 8,32,64] [--repeats 3] [--layers N]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import _common
import torch
from _common import ALL_LINEAR, MODEL_CONFIGS, RESULTS, machine_info, print_table, random_model, write_json

from lora_rl_core.adapters import safetensors_bytes
from lora_rl_core.engines import EmbeddedEngine, GenerationRequest, SamplingParams
from lora_rl_testing.adapters import random_lora_factory

PATHS = ("tensor", "store", "sync_version")
PARTS = ("publish_s", "load_s", "first_s", "total_s")


def first_completion(engine: EmbeddedEngine, name: str, prompt: list[int], version: int) -> None:
    """One greedy 1-token request naming `name`; fails unless the new version served it."""
    request = GenerationRequest(prompt, name, SamplingParams(max_new_tokens=1, temperature=0.0))
    (done,) = engine.generate([request], timeout_s=600.0)
    if done.finish_reason == "abort" or done.adapter_version != version:
        raise RuntimeError(f"{name}: first completion {done.finish_reason}, version {done.adapter_version}")


def measure(engine: EmbeddedEngine, path: str, ctx: dict[str, Any], rank: int, version: int) -> dict[str, float]:
    """One publish -> load -> first completion on `path`; seconds of each part and the total."""
    run = f"{path.replace('_', '')}-r{rank}"
    name = f"{run}-v{version:06d}"
    trainer_tensors, config = ctx["trainer"][rank]
    t0 = time.perf_counter()
    if path == "tensor":
        tensors = {k: v.detach().to("cpu").contiguous() for k, v in trainer_tensors.items()}
        t1 = time.perf_counter()
        engine.load_adapter(name, tensors=tensors, config=config)
    else:
        store = ctx["store"]
        ref = store.publish(run, version, tensors=trainer_tensors, adapter_config=config, step=version, base_model="x")
        t1 = time.perf_counter()
        _load_from_store(engine, path, ref, store)
    t2 = time.perf_counter()
    first_completion(engine, name, ctx["prompt"], version)
    t3 = time.perf_counter()
    _keep_only(engine, name)
    return {"publish_s": t1 - t0, "load_s": t2 - t1, "first_s": t3 - t2, "total_s": t3 - t0}


def _load_from_store(engine: EmbeddedEngine, path: str, ref: Any, store: Any) -> None:
    if path == "store":
        engine.load_adapter(ref.name, path=ref.uri)
        return
    from lora_rl_core.subscriber import sync_version

    result = sync_version(engine, ref, store=store, keep=2)
    if not result.ok:
        raise RuntimeError(result.summary())


def _keep_only(engine: EmbeddedEngine, name: str) -> None:
    """Unload every adapter but `name` (untimed), so the model stays wrapped and memory flat."""
    for other in engine.list_adapters():
        if other != name:
            engine.unload_adapter(other)


def bench_rank(engine: EmbeddedEngine, ctx: dict[str, Any], rank: int, repeats: int) -> dict[str, Any]:
    """Warm up once, then `repeats` rounds over the paths (interleaved); medians per path and part."""
    measure(engine, "tensor", ctx, rank, 0)
    runs: dict[str, list[dict[str, float]]] = {p: [] for p in ctx["paths"]}
    for version in range(1, repeats + 1):
        for path in ctx["paths"]:
            runs[path].append(measure(engine, path, ctx, rank, version))
    return summarize(runs, ctx["trainer"][rank][0])


def summarize(runs: dict[str, list[dict[str, float]]], tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """`{"mb": adapter file size (10**6 bytes), "paths": {path: medians of each part, total_s_all}}`."""
    out: dict[str, Any] = {"mb": len(safetensors_bytes(tensors)) / 1e6, "paths": {}}
    for path, samples in runs.items():
        medians = {part: statistics.median(s[part] for s in samples) for part in PARTS}
        out["paths"][path] = {**medians, "total_s_all": [s["total_s"] for s in samples]}
    return out


def trainer_state(model: torch.nn.Module, rank: int, device: str) -> tuple[dict[str, torch.Tensor], dict]:
    """Random all-linear LoRA weights of `rank` on `device` (float32), and their PEFT config."""
    tensors, config = random_lora_factory(model, rank=rank, targets=ALL_LINEAR, scale=0.01)(rank)
    return {k: v.to(device) for k, v in tensors.items()}, config


def open_store(tmp: str) -> tuple[Any, str | None]:
    """A `file://` store in `tmp`, or (None, why) when the store cannot be imported here (no pydantic)."""
    try:
        from lora_rl_core.store import AdapterStore
    except ImportError as exc:
        return None, f"store paths skipped: {exc}"
    return AdapterStore(f"file://{tmp}/store"), None


def main() -> None:
    """Parse arguments, build the model and engine, measure every rank, print the table, write the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="auto", help="cpu | cuda | auto")
    parser.add_argument("--dtype", default="auto", help="base model dtype; auto = bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--ranks", default="8,32,64")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model-config", type=Path, default=MODEL_CONFIGS / "qwen2.5-0.5b.json")
    parser.add_argument("--layers", type=int, default=None, help="truncate the number of layers (quick CPU runs)")
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--out", type=Path, default=None, help="default: results/sync_latency_<device>.json")
    args = parser.parse_args()
    device = _common.resolve_device(args.device)
    ranks = [int(r) for r in args.ranks.split(",")]
    cfg = _common.model_config(args.model_config, layers=args.layers)

    start = time.perf_counter()
    model = random_model(cfg, device=device, dtype=_common.default_dtype(device, args.dtype))
    build_s = time.perf_counter() - start
    ctx: dict[str, Any] = {"prompt": [(17 * i + 3) % cfg["vocab_size"] for i in range(args.prompt_len)]}
    ctx["trainer"] = {rank: trainer_state(model, rank, device) for rank in ranks}
    with tempfile.TemporaryDirectory() as tmp, EmbeddedEngine(model, _common.stub_tokenizer(cfg)) as engine:
        ctx["store"], skipped = open_store(tmp)
        ctx["paths"] = PATHS if ctx["store"] is not None else ("tensor",)
        results = {str(rank): bench_rank(engine, ctx, rank, args.repeats) for rank in ranks}

    model_name = f"{args.model_config.stem}" + (f" ({cfg['num_hidden_layers']} layers)" if args.layers else "")
    rows = [
        [rank, path, r["mb"], *[p[part] for part in PARTS]]
        for rank, r in results.items()
        for path, p in r["paths"].items()
    ]
    title = f"publish -> first completion, {model_name}, {device}, median of {args.repeats} (seconds)"
    print_table(title, ["rank", "path", "MB", "publish", "load", "first completion", "total"], rows)
    if skipped:
        print(skipped)
    write_json(
        {
            "benchmark": "sync_latency",
            "model": {"config_file": args.model_config.name, "layers": cfg["num_hidden_layers"], "config": cfg},
            "dtype": str(_common.default_dtype(device, args.dtype)),
            "lora": {"targets": list(ALL_LINEAR), "trainer_dtype": "float32", "alpha": "2 * rank"},
            "ranks": ranks,
            "repeats": args.repeats,
            "prompt_len": args.prompt_len,
            "model_build_s": build_s,
            "skipped": skipped,
            "machine": machine_info(device),
            "results": results,
        },
        args.out or RESULTS / f"sync_latency_{device.split(':')[0]}.json",
    )


if __name__ == "__main__":
    sys.exit(main())
