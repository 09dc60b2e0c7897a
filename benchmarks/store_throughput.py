"""Adapter store throughput: publish and pull a rank-32 LoRA of the Qwen2.5-0.5B shape.

Builds random LoRA weights of the right shapes for all-linear targets (q, k, v,
o, gate, up, down in every layer) from a model config JSON (no model needed),
then publishes and pulls them ``--repeats`` times to a ``file://`` store in a
temp folder and to a local S3 server (moto's standalone server, started here
in a subprocess on 127.0.0.1 so it does not share this process's GIL).
Prints a table and writes ``benchmarks/results/store_throughput.json``.

A publish includes serialising to safetensors, sha256, the checks on the
tensors and config, the uploads, the exclusive manifest create and its read
back, and the LATEST hint; a pull includes downloads, sha256 and format
checks, and writing the PEFT folder. MB = 10**6 bytes; times are medians.
moto keeps objects in memory and speaks HTTP from Python, so the S3 numbers
measure the client path against a local server, not AWS.

Usage::

    .venv/bin/python benchmarks/store_throughput.py [--repeats 3] [--rank 32] [--dtype float32]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from datetime import UTC, datetime
from importlib.metadata import version as package_version
from pathlib import Path

import fsspec
import torch
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from lora_rl_core.store import AdapterStore  # noqa: E402

MODEL_CONFIGS = Path(__file__).resolve().parent / "model_configs"
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def linear_shapes(cfg: dict) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each all-linear LoRA target of a Llama/Qwen2-style decoder layer."""
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    head_dim = cfg.get("head_dim") or hidden // cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads", cfg["num_attention_heads"]) * head_dim
    return {
        "q_proj": (hidden, cfg["num_attention_heads"] * head_dim),
        "k_proj": (hidden, kv),
        "v_proj": (hidden, kv),
        "o_proj": (cfg["num_attention_heads"] * head_dim, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }


def lora_state(cfg: dict, rank: int, dtype: torch.dtype) -> tuple[dict[str, torch.Tensor], dict]:
    """Random PEFT-keyed LoRA weights (A: [r, in], B: [out, r]) for every layer and target, and their config."""
    gen = torch.Generator().manual_seed(0)
    tensors = {}
    for layer in range(cfg["num_hidden_layers"]):
        for module, (n_in, n_out) in linear_shapes(cfg).items():
            part = "self_attn" if module in TARGETS[:4] else "mlp"
            key = f"base_model.model.model.layers.{layer}.{part}.{module}"
            tensors[f"{key}.lora_A.weight"] = (torch.randn(rank, n_in, generator=gen) * 0.01).to(dtype)
            tensors[f"{key}.lora_B.weight"] = (torch.randn(n_out, rank, generator=gen) * 0.01).to(dtype)
    config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": 2 * rank,
        "target_modules": list(TARGETS),
        "task_type": "CAUSAL_LM",
    }
    return tensors, config


def start_moto() -> tuple[subprocess.Popen, str]:
    """Start moto's S3 server on a free 127.0.0.1 port; returns the process and the endpoint."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{port}"
    for _ in range(300):
        try:
            urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=1)
            return proc, endpoint
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("moto server did not start")


def bench(store: AdapterStore, tensors: dict, config: dict, repeats: int, workdir: Path) -> dict:
    """Publish then pull ``repeats`` versions; returns the median seconds of each and the adapter size."""
    publish_s, pull_s = [], []
    for version in range(repeats):
        start = time.perf_counter()
        store.publish(
            "bench", version, tensors=tensors, adapter_config=config, step=version, base_model="Qwen/Qwen2.5-0.5B"
        )
        publish_s.append(time.perf_counter() - start)
        start = time.perf_counter()
        store.pull("bench", version, workdir / f"pull-{version}")
        pull_s.append(time.perf_counter() - start)
    size = sum(f.size for f in store.manifest("bench", 0).files.values())
    return {
        "bytes": size,
        "publish_s": statistics.median(publish_s),
        "pull_s": statistics.median(pull_s),
        "publish_s_all": publish_s,
        "pull_s_all": pull_s,
    }


def run_backends(tensors: dict, config: dict, repeats: int) -> dict[str, dict]:
    """Benchmark a file:// store in a temp folder and an S3 store on a fresh local moto server."""
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        results["file"] = bench(AdapterStore(f"file://{tmp}/store"), tensors, config, repeats, tmp / "pull-file")
        os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1")
        proc, endpoint = start_moto()
        try:
            options = {"client_kwargs": {"endpoint_url": endpoint}}
            fsspec.filesystem("s3", **options).mkdir("bench")
            store = AdapterStore("s3://bench/store", storage_options=options)
            results["s3 (moto, 127.0.0.1)"] = bench(store, tensors, config, repeats, tmp / "pull-s3")
        finally:
            proc.terminate()
            proc.wait(10)
    for r in results.values():
        mb = r["bytes"] / 1e6
        r.update(mb=mb, publish_mb_s=mb / r["publish_s"], pull_mb_s=mb / r["pull_s"])
    return results


def print_table(results: dict[str, dict], title: str) -> None:
    """One row per backend: size, median publish and pull seconds, and MB/s."""
    table = Table("backend", "MB", "publish s", "publish MB/s", "pull s", "pull MB/s", title=title)
    for backend, r in results.items():
        row = [f"{r['mb']:.1f}", f"{r['publish_s']:.3f}", f"{r['publish_mb_s']:.0f}"]
        table.add_row(backend, *row, f"{r['pull_s']:.3f}", f"{r['pull_mb_s']:.0f}")
    Console().print(table)


def main() -> None:
    """Parse arguments, run both backends, print the table and write the JSON record."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-config", type=Path, default=MODEL_CONFIGS / "qwen2.5-0.5b.json")
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).resolve().parent / "results" / "store_throughput.json"
    )
    args = parser.parse_args()

    cfg = json.loads(args.model_config.read_text())
    tensors, config = lora_state(cfg, args.rank, getattr(torch, args.dtype))
    results = run_backends(tensors, config, args.repeats)
    print_table(results, f"rank-{args.rank} LoRA, {args.model_config.stem}, {args.dtype}, median of {args.repeats}")
    record = {
        "benchmark": "store_throughput",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "model_config": args.model_config.name,
        "rank": args.rank,
        "dtype": args.dtype,
        "targets": list(TARGETS),
        "tensors": len(tensors),
        "parameters": sum(t.numel() for t in tensors.values()),
        "repeats": args.repeats,
        "machine": {
            "cpus": os.cpu_count(),
            "load_average_1m": os.getloadavg()[0],
            "platform": platform.platform(),
            "python": platform.python_version(),
        },
        "versions": {p: package_version(p) for p in ("torch", "safetensors", "fsspec", "s3fs", "moto")},
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
