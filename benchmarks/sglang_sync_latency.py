"""Sync latency on a real SGLang server: publish -> first completion served by the new adapter version, for the
disk path and the tensor paths (issue: GPU + SGLang, benchmark 5a; goal: at most 50 ms on the tensor path).

The server is started by `launch_sglang` on a random-weight model of `--model-config`'s shapes (default
Qwen2.5-0.5B: 24 layers, hidden 896, MLP 4864), written as a bf16 HF folder next to the tokenizer of
`--tokenizer-dir`; the vocabulary is the tokenizer's (SmolLM2's 49152 instead of Qwen's 151936: only the
embedding and LM head change, the LoRA-carrying linear layers keep Qwen's shapes). Adapters: random LoRA
of rank 8/32/64 on all linear layers (q, k, v, o, gate, up, down), float32 on the GPU as the trainer holds
them. One measurement, from the trainer's state dict to the first completion served by the new version:

* `disk`: `AdapterStore.publish` to a `file://` store (safetensors + sha256 + manifest) -> `SGLangEngine.
  load_adapter(name, path=ref.uri)` (`/load_lora_adapter` reads the folder) -> first `generate`;
* `ipc`: `load_adapter(name, tensors=..., config=...)` with `tensor_transport="ipc"`: the tensors' CUDA IPC
  handles in `/load_lora_adapter_from_tensors` (same host) -> first `generate`;
* `inline`: the same with the data inline (CPU copy, pickle, base64 in the JSON body).

First `generate`: one 16-token prompt, 1 greedy token, naming the new version (its version is checked).
Columns: publish (store write; 0 on the tensor paths, where the flow writes the store as well but the
engine does not wait for it), load, first completion, total; medians over `--repeats` after one untimed
warm-up per path; MB = 10**6 bytes of the adapter's safetensors file. The previous version is unloaded
between measurements (untimed, no n>1 traffic: sglang#36894).

Usage, on the GPU host (docs/SGLANG.md, "GPU host")::

    PYTHONPATH=/tmp/ours:. python3 benchmarks/sglang_sync_latency.py --tokenizer-dir /tmp/models/meta \\
        --sglang-pythonpath /tmp/sglsite
    PYTHONPATH=. python benchmarks/sglang_sync_latency.py --tiny --tokenizer-dir TOKENIZER_DIR \\
        --sglang-python "$(which python)" --sglang-pythonpath tests/support/fake_sglang:. --paths disk,inline
        # CPU smoke test against the fake server
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import _common
import torch
from _common import ALL_LINEAR, MODEL_CONFIGS, RESULTS, machine_info, print_table, write_json
from sync_latency import PARTS, summarize

from lora_rl_core.config import config_from_dict
from lora_rl_core.engines import GenerationRequest, SamplingParams
from lora_rl_core.engines.http import SGLangEngine
from lora_rl_core.engines.sglang_server import launch_sglang
from lora_rl_core.store import AdapterStore
from tests.support.adapters import random_lora_factory

PATHS = ("disk", "ipc", "inline")


def write_model(cfg: dict[str, Any], tokenizer_dir: Path, out: Path) -> torch.nn.Module:
    """A random-weight bf16 model of `cfg` with the tokenizer's vocabulary, saved with the tokenizer to `out`;
    returns it (CPU, float32 copy not kept) for the adapters' shapes."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    cfg = {**cfg, "vocab_size": len(tokenizer), "bos_token_id": tokenizer.bos_token_id}
    cfg["eos_token_id"] = tokenizer.eos_token_id
    model = _common.random_model(cfg, device="cpu", dtype=torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.02)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return model


def first_completion(engine: SGLangEngine, name: str, prompt: list[int], version: int) -> None:
    """One greedy 1-token request naming `name`; fails unless that version served it."""
    request = GenerationRequest(prompt, name, SamplingParams(max_new_tokens=1, temperature=0.0))
    (done,) = engine.generate([request], timeout_s=600.0)
    if done.finish_reason == "abort" or done.adapter_version != version:
        raise RuntimeError(f"{name}: first completion {done.finish_reason}, version {done.adapter_version}")


def measure(ctx: dict[str, Any], path: str, rank: int, version: int) -> dict[str, float]:
    """One publish -> load -> first completion on `path`; seconds of each part and the total."""
    engine: SGLangEngine = ctx["engines"][path]
    run = f"{path}-r{rank}"
    name = f"{run}-v{version:06d}"
    tensors, config = ctx["trainer"][rank]
    t0 = time.perf_counter()
    if path == "disk":
        ref = ctx["store"].publish(run, version, tensors=tensors, adapter_config=config, step=version, base_model="x")
        t1 = time.perf_counter()
        engine.load_adapter(name, path=ref.uri)
    else:
        t1 = t0
        engine.load_adapter(name, tensors=tensors, config=config)
    t2 = time.perf_counter()
    first_completion(engine, name, ctx["prompt"], version)
    t3 = time.perf_counter()
    for other in engine.list_adapters():  # untimed: keep one version resident
        if other != name:
            engine.unload_adapter(other)
    return {"publish_s": t1 - t0, "load_s": t2 - t1, "first_s": t3 - t2, "total_s": t3 - t0}


def bench_rank(ctx: dict[str, Any], rank: int, repeats: int) -> dict[str, Any]:
    """A warm-up per path, then `repeats` rounds over the paths (interleaved); medians per path and part."""
    for path in ctx["paths"]:
        measure(ctx, path, rank, 900000)
    runs: dict[str, list[dict[str, float]]] = {p: [] for p in ctx["paths"]}
    for version in range(1, repeats + 1):
        for path in ctx["paths"]:
            runs[path].append(measure(ctx, path, rank, version))
    return summarize(runs, ctx["trainer"][rank][0])


def main() -> None:
    """Write the model, start SGLang, measure every rank and path, print the table, write JSON."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokenizer-dir", type=Path, required=True, help="HF folder with a tokenizer")
    parser.add_argument("--model-config", type=Path, default=MODEL_CONFIGS / "qwen2.5-0.5b.json")
    parser.add_argument("--sglang-python", default="python3", help="interpreter of the server")
    parser.add_argument("--sglang-pythonpath", default=None, help="PYTHONPATH of the server (where sglang imports)")
    parser.add_argument("--ranks", default="8,32,64")
    parser.add_argument("--paths", default=",".join(PATHS))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--eager", action="store_true", help="no decode CUDA graphs on the server")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--startup-timeout", type=float, default=900.0)
    parser.add_argument("--tiny", action="store_true", help="smoke test: tiny Qwen2 shapes, ranks 8, 1 repeat")
    parser.add_argument("--out", type=Path, default=None, help="default: results/sglang_sync_latency_<device>.json")
    args = parser.parse_args()
    if args.tiny:
        args.ranks, args.repeats = "8", 1
    ranks = [int(r) for r in args.ranks.split(",")]
    paths = [p for p in args.paths.split(",") if p]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    cfg = _common.model_config(None if args.tiny else args.model_config)
    with tempfile.TemporaryDirectory(prefix="sglang-sync-") as tmp:
        model_dir = Path(tmp) / ("tiny-random" if args.tiny else f"{args.model_config.stem}-random")
        shapes = write_model(cfg, args.tokenizer_dir, model_dir)
        trainer = {}
        for rank in ranks:
            tensors, config = random_lora_factory(shapes, rank=rank, targets=ALL_LINEAR, scale=0.01)(rank)
            trainer[rank] = ({k: v.to(device) for k, v in tensors.items()}, config)
        del shapes
        launch: dict[str, Any] = {"enabled": True, "port": args.port, "startup_timeout_s": args.startup_timeout}
        launch["python"] = args.sglang_python
        launch["cuda_graph_max_bs"] = None if args.eager else 8
        if args.sglang_pythonpath:
            launch["env"] = {"PYTHONPATH": args.sglang_pythonpath}
        run_cfg = config_from_dict(
            {
                "model": {"name_or_path": str(model_dir), "dtype": "bfloat16"},
                "lora": {"rank": max(ranks), "target_modules": list(ALL_LINEAR)},
                "engine": {"type": "sglang", "max_loras_per_batch": 2, "max_lora_rank": max(ranks), "launch": launch},
            }
        )
        server = launch_sglang(run_cfg, Path(tmp) / "server.log")
        try:
            engines = {p: SGLangEngine(server.url, timeout_s=600, tensor_transport=p) for p in paths}
            gen = torch.Generator().manual_seed(0)
            prompt = torch.randint(3, cfg["vocab_size"] if args.tiny else 49152, (16,), generator=gen).tolist()
            ctx = {"engines": engines, "paths": paths, "trainer": trainer, "prompt": prompt}
            ctx["store"] = AdapterStore(f"file://{tmp}/store")
            results = {str(rank): bench_rank(ctx, rank, args.repeats) for rank in ranks}
            for engine in engines.values():
                engine.close()
        finally:
            server.stop()
    write_json(
        {
            "benchmark": "sglang_sync_latency",
            "model": {"shapes": "tiny" if args.tiny else args.model_config.stem, "vocab": "the tokenizer's"},
            "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "argv": server.argv,
            "machine": machine_info(device),
            "ranks": results,
        },
        args.out or RESULTS / f"sglang_sync_latency_{device}.json",
    )
    rows = [
        [rank, f"{r['mb']:.1f}", path, *(1000 * p[part] for part in PARTS)]
        for rank, r in results.items()
        for path, p in r["paths"].items()
    ]
    columns = ["rank", "MB", "path", "publish ms", "load ms", "first completion ms", "total ms"]
    print_table(f"publish -> first completion on SGLang ({device}), medians of {args.repeats}", columns, rows)


if __name__ == "__main__":
    sys.exit(main())
