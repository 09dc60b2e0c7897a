"""What a background serialisation costs the step beside it: the interpreter lock.

A run serialises each adapter version and each checkpoint on the store writer's background thread while
the next step runs in the main thread (`trainer.background_publish`). On a GPU that step is launch-bound:
Python issuing small kernels. Here the main thread stands for it with a loop of small torch ops (a 64 x 64
multiply-add, dispatcher-bound like a kernel launch) and counts them per second, alone and while a
background thread serialises over and over:

* `safetensors.torch.save` (the baseline: what the store and the checkpoint used): copies every tensor into
  one buffer holding the interpreter lock;
* `lora_rl_core.adapters.safetensors_bytes` (ours): `safetensors.torch.save_file` into a temporary file and
  a read back, both of which release the lock; the same bytes;
* `hashlib.sha256` of the same bytes, a reference that releases the lock: what is left of the slowdown there
  is the cores' own contention (memory bandwidth, a shared core), not the lock.

Payloads: a Qwen2.5-7B LoRA adapter (rank 16 on every linear layer of its 28 layers, float32: 161 MB) and
its checkpoint (the adapter and AdamW's two moments: 3x). `main x` is the main thread's op rate beside the
serialisation over its rate alone (1.0 = untouched); `serialise s` the median seconds of one serialisation.

    PYTHONPATH=. .venv/bin/python benchmarks/serialise_gil.py [--seconds 4]

Writes `benchmarks/results/serialise_gil.json` (or `--out`) and prints a table naming the CPU.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout, before torch loads
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads, as the CLI does (lora_rl_core.runtime)

# isort: split
import torch  # noqa: E402
from _common import RESULTS, ROOT, machine_info, model_config, print_table, write_json  # noqa: E402

from lora_rl_core.adapters import safetensors_bytes  # noqa: E402


def lora_tensors(shape: str, rank: int, copies: int) -> dict[str, torch.Tensor]:
    """Float32 LoRA A `[r, in]` and B `[out, r]` for every linear layer of the shape, `copies` times over."""
    cfg = model_config(ROOT / "benchmarks" / "model_configs" / f"qwen2.5-{shape}.json")
    h, i = cfg["hidden_size"], cfg["intermediate_size"]
    kv = cfg["num_key_value_heads"] * (h // cfg["num_attention_heads"])
    linears = {"q_proj": (h, h), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (h, h)}
    linears |= {"gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}
    out: dict[str, torch.Tensor] = {}
    for copy in range(copies):
        for layer in range(cfg["num_hidden_layers"]):
            for name, (fan_in, fan_out) in linears.items():
                key = f"{copy}.layers.{layer}.{name}"
                out[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in)
                out[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank)
    return out


def ops_per_second(seconds: float) -> float:
    """The main thread's rate of small torch ops over `seconds`."""
    x = torch.randn(64, 64)
    n, end = 0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(100):
            x.mul(2.0).add_(1.0)
        n += 100
    return n / seconds


def beside(job: Callable[[], object], seconds: float) -> tuple[float, float]:
    """(main thread op rate, median seconds of one `job`) with `job` repeated on a background thread."""
    stop, times = threading.Event(), []

    def loop() -> None:
        while not stop.is_set():
            start = time.perf_counter()
            job()
            times.append(time.perf_counter() - start)

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        rate = ops_per_second(seconds)
    finally:
        stop.set()
        thread.join()
    return rate, statistics.median(times)


def cpu_model() -> str:
    """The CPU's model name (`/proc/cpuinfo`), or what `platform` knows."""
    import platform

    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return next(ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=4.0, help="main-thread measuring time per case")
    p.add_argument("--shape", default="7b", choices=["0.5b", "1.5b", "7b"])
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--out", type=Path, default=RESULTS / "serialise_gil.json")
    args = p.parse_args(argv)
    from safetensors.torch import save

    torch.set_num_threads(1)  # one core for the main thread's ops, the other for the serialising thread
    rows, records = [], []
    for payload, copies in (("adapter", 1), ("checkpoint", 3)):
        tensors = lora_tensors(args.shape, args.rank, copies)
        data = safetensors_bytes(tensors)
        assert data == save(tensors, metadata={"format": "pt"})  # the same file either way
        alone = ops_per_second(args.seconds)
        cases: dict[str, Callable[[], object]] = {
            "safetensors.torch.save (baseline)": functools.partial(save, tensors, metadata={"format": "pt"}),
            "safetensors_bytes (ours)": functools.partial(safetensors_bytes, tensors),
            "sha256 (releases the lock)": functools.partial(hashlib.sha256, data),
        }
        for name, job in cases.items():
            rate, job_s = beside(job, args.seconds)
            record = {"payload": payload, "mb": len(data) / 1e6, "job": name, "main_x": rate / alone}
            records.append({**record, "serialise_s": job_s, "main_ops_per_s": rate, "alone_ops_per_s": alone})
            rows.append([payload, f"{len(data) / 1e6:.0f}", name, rate / alone, job_s])
    machine = machine_info("cpu")
    machine["cpu_model"] = cpu_model()
    print_table(
        f"main thread beside a background serialisation ({machine['cpu_model']}, "
        f"{torch.backends.cpu.get_cpu_capability()}, {machine['cpus']} cores)",
        ["payload", "MB", "background job", "main x", "serialise s"],
        rows,
    )
    write_json(
        {
            "shape": f"qwen2.5-{args.shape}",
            "rank": args.rank,
            "seconds": args.seconds,
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "results": records,
            "machine": machine,
        },
        args.out,
    )


if __name__ == "__main__":
    main()
