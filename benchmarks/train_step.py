"""Benchmark one GRPO-shaped training step: LoRA vs full fine-tuning, FSDP2 on 1 or more devices.

Random-weight Qwen2.5 models built from `benchmarks/model_configs/qwen2.5-*.json`
(no weights to carry). Every case runs in fresh processes (one per rank,
`torch.multiprocessing` spawn, NCCL on CUDA / gloo on CPU) through the same
FSDP2 path the trainer workers use (`lora_rl_core.distributed.shard_model`:
per-layer `fully_shard`, bf16 compute with fp32 reduction on CUDA, summed
gradients), so 1-GPU and 2-GPU numbers are comparable.

One step = the global batch of `--batch` sequences of `--seq-len` tokens (the
last `seq-len - prompt-len` are the completion), split evenly over ranks and
into micro-batches of `--micro-batch-size` per rank; per micro-batch: forward,
float32 logits / logprobs, PPO-clip token-mean loss (`lora_rl_core.algorithm`),
backward; then global-norm clipping and AdamW. The same loop as
`PolicyTrainer` without its bookkeeping.

* lora: base weights bf16 (frozen), LoRA rank `--lora-rank` (alpha 2r) on all
  linear layers, float32 adapter params (PEFT default), AdamW lr 1e-4.
* full: every parameter trainable, float32 master weights and AdamW state,
  bf16 compute through FSDP2 mixed precision (on CUDA), AdamW lr 1e-5.

Reported per case: median step seconds over `--steps` after `--warmup`,
tokens/s (processed tokens of the global batch / step time), peak memory
(max over ranks of `torch.cuda.max_memory_allocated` during the timed steps,
GiB), memory after setup, trainable / total params; for LoRA also the seconds
to gather the full adapter onto rank 0's CPU (what publishing a version costs
the trainer) and its size. Writes JSON (`--out`) and
prints a rich table. Imports only torch, transformers, peft, rich, stdlib and
pydantic-free `lora_rl_core` modules, so it runs where the project is not
installed. `--device cpu --tiny` is a smoke test with tiny shapes.

Reading the numbers: with small micro-batches the step is host-bound (Python,
kernel launches and the per-micro-batch syncs of the metric floats), and LoRA's
extra modules cost more host time than its skipped weight gradients save, so
compare LoRA and full fine-tuning at the largest micro-batch that fits
(`--micro-batch-size 16`); LoRA's clear gain is memory.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from a checkout without installing the project

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from _common import TINY_CONFIG  # noqa: E402  (benchmarks/ is on sys.path when run as a script)

from lora_rl_core import distributed  # noqa: E402
from lora_rl_core.algorithm import ppo_clip_loss, token_logprobs  # noqa: E402
from lora_rl_core.lora import cpu_copies  # noqa: E402
from lora_rl_testing.plans import loss_kwargs  # noqa: E402

GIB = 1024**3
LOSS_ARGS = loss_kwargs()  # the run's defaults, as its plan makes them: clip ranges, aggregation


@dataclass(frozen=True)
class Settings:
    """What every case shares (from the command line)."""

    device: str
    batch: int
    seq_len: int
    prompt_len: int
    micro_batch_size: int
    warmup: int
    steps: int
    lora_rank: int
    activation_checkpointing: bool
    tiny: bool
    model_configs: str


@dataclass(frozen=True)
class Case:
    model: str  # e.g. qwen2.5-0.5b
    mode: str  # lora | full
    world_size: int


def model_config(case: Case, settings: Settings) -> Any:
    """The transformers config of `case.model` (or the tiny smoke-test shape)."""
    from transformers import AutoConfig

    data = (
        dict(TINY_CONFIG)
        if settings.tiny
        else json.loads(Path(settings.model_configs, f"{case.model}.json").read_text())
    )
    for key in ("architectures", "torch_dtype", "transformers_version"):
        data.pop(key, None)
    return AutoConfig.for_model(**data)


def build_model(case: Case, settings: Settings, device: torch.device) -> torch.nn.Module:
    """A random-weight causal LM on `device`: LoRA-wrapped (bf16 base) or fully trainable (fp32 master)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if case.mode == "lora" and cuda else torch.float32
    torch.manual_seed(0)
    with device:
        model = AutoModelForCausalLM.from_config(model_config(case, settings), dtype=dtype)
    model.config.use_cache = False
    if case.mode == "full":
        return model
    lora = LoraConfig(r=settings.lora_rank, lora_alpha=2 * settings.lora_rank, target_modules="all-linear")
    return get_peft_model(model, lora)


def make_batch(settings: Settings, vocab: int, rank: int, world_size: int, device: torch.device) -> tuple:
    """This rank's rows: token ids `[b, L]`, completion mask `[b, L-1]` (shifted frame), advantages `[b]`."""
    g = torch.Generator().manual_seed(1234)
    ids_BL = torch.randint(0, vocab, (settings.batch, settings.seq_len), generator=g)
    advantages_B = torch.randn(settings.batch, generator=g)
    rows = slice(rank * settings.batch // world_size, (rank + 1) * settings.batch // world_size)
    mask_BT = torch.zeros(settings.batch, settings.seq_len - 1)
    mask_BT[:, settings.prompt_len - 1 :] = 1.0
    return ids_BL[rows].to(device), mask_BT[rows].to(device), advantages_B[rows].to(device)


def train_step(model, optimizer, params, batch: tuple, settings: Settings) -> None:
    """Micro-batched PPO-clip step, loss weighted by GLOBAL completion tokens (gradients are summed over ranks)."""
    ids_BL, mask_BT, advantages_B = batch
    total_tokens = float(settings.batch * (settings.seq_len - settings.prompt_len))
    model.train()
    for lo in range(0, ids_BL.shape[0], settings.micro_batch_size):
        ids, mask, adv = (t[lo : lo + settings.micro_batch_size] for t in (ids_BL, mask_BT, advantages_B))
        logits = model(input_ids=ids, use_cache=False).logits[:, :-1].float()  # [b, L-1, V]
        logprobs_BT = token_logprobs(logits, ids[:, 1:])
        loss, _ = ppo_clip_loss(logprobs_BT, logprobs_BT.detach(), adv, mask, **LOSS_ARGS)
        (loss * (float(mask.sum()) / total_tokens)).backward()
    distributed.sum_gradients(params)  # LoRA weights are replicated over ranks (lora_rl_core.distributed)
    distributed.clip_grad_norm_(params, 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def run_rank(rank: int, case: Case, settings: Settings, port: int, results: Any) -> None:
    """One rank of one case: build, shard, time the steps, report to the parent's queue."""
    device = torch.device(settings.device, rank) if settings.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(max(1, torch.get_num_threads() // case.world_size))
    distributed.init_process_group(device, rank=rank, world_size=case.world_size, port=port)
    try:
        results.put(measure(rank, case, settings, device))
    finally:
        distributed.destroy_process_group()


def measure(rank: int, case: Case, settings: Settings, device: torch.device) -> dict[str, Any]:
    """Build and shard the model, time the steps; for LoRA also time gathering the full adapter on rank 0."""
    model = build_model(case, settings, device)
    total_params = sum(p.numel() for p in model.parameters())
    distributed.shard_model(
        model,
        mixed_precision=True,
        activation_checkpointing=settings.activation_checkpointing,
        replicate_trainable=case.mode == "lora",  # full fine-tuning shards every weight
    )
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4 if case.mode == "lora" else 1e-5)
    batch = make_batch(settings, model.config.vocab_size, rank, case.world_size, device)
    report = time_steps(lambda: train_step(model, optimizer, params, batch, settings), settings, device)
    if case.mode == "lora":
        report.update(time_adapter_gather(model, device))
    return {"rank": rank, **report, "trainable_params": sum(p.numel() for p in params), "total_params": total_params}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(step: Any, settings: Settings, device: torch.device) -> dict[str, Any]:
    """Seconds of each timed step (after warm-up), peak memory during them and memory after setup (CUDA only)."""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.empty_cache()
    setup_bytes = torch.cuda.memory_allocated(device) if cuda else 0
    times = []
    for i in range(settings.warmup + settings.steps):
        if i == settings.warmup and cuda:
            torch.cuda.reset_peak_memory_stats(device)
        _sync(device)
        start = time.perf_counter()
        step()
        _sync(device)
        times.append(time.perf_counter() - start)
    return {
        "step_seconds_all": times[settings.warmup :],
        "peak_memory_gib": torch.cuda.max_memory_allocated(device) / GIB if cuda else None,
        "setup_memory_gib": setup_bytes / GIB if cuda else None,
    }


def time_adapter_gather(model: torch.nn.Module, device: torch.device) -> dict[str, Any]:
    """What publishing a version costs the trainer: gathering the full adapter onto rank 0's CPU, and its size."""
    _sync(device)
    start = time.perf_counter()
    state = cpu_copies(distributed.gather_lora_state(model) or {})
    seconds = time.perf_counter() - start
    held = distributed.all_reduce_sum({"tensors": float(len(state))})["tensors"]  # only rank 0 holds them
    return {
        "adapter_gather_seconds": seconds,
        "adapter_mib": sum(v.numel() * v.element_size() for v in state.values()) / 2**20,
        "adapter_tensors": int(held),
    }


def run_case(case: Case, settings: Settings) -> dict[str, Any]:
    """Spawn `case.world_size` ranks, wait, and merge their reports (rank 0's times, max memory)."""
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = distributed.free_port()
    try:
        mp.start_processes(run_rank, args=(case, settings, port, queue), nprocs=case.world_size, start_method="spawn")
    except Exception as exc:  # noqa: BLE001 - an OOM in one case must not lose the others
        return {**asdict(case), "error": str(exc).strip().splitlines()[-1][:500]}
    reports = sorted((queue.get() for _ in range(case.world_size)), key=lambda r: r["rank"])
    step = statistics.median(reports[0]["step_seconds_all"])
    memory = [r["peak_memory_gib"] for r in reports if r["peak_memory_gib"] is not None]
    setup = [r["setup_memory_gib"] for r in reports if r["setup_memory_gib"] is not None]
    return {
        **asdict(case),
        "step_seconds": step,
        "tokens_per_second": settings.batch * settings.seq_len / step,
        "peak_memory_gib": max(memory) if memory else None,
        "setup_memory_gib": max(setup) if setup else None,
        "adapter_gather_seconds": reports[0].get("adapter_gather_seconds"),
        "adapter_mib": reports[0].get("adapter_mib"),
        "adapter_tensors": reports[0].get("adapter_tensors"),
        "trainable_params": reports[0]["trainable_params"],
        "total_params": reports[0]["total_params"],
        "step_seconds_all": reports[0]["step_seconds_all"],
    }


def environment(settings: Settings) -> dict[str, Any]:
    import peft
    import transformers

    cuda = settings.device == "cuda"
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(0) if cuda else platform.processor() or "cpu",
        "gpus_visible": torch.cuda.device_count() if cuda else 0,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "peft": peft.__version__,
        "python": platform.python_version(),
    }


def print_table(results: list[dict[str, Any]], title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for column in ("model", "mode", "ranks", "trainable", "step s", "tokens/s", "peak GiB", "setup GiB", "gather s"):
        table.add_column(column, justify="left" if column in ("model", "mode") else "right")
    for r in results:
        if "error" in r:
            table.add_row(r["model"], r["mode"], str(r["world_size"]), "", "error", r["error"][:60], "", "", "")
            continue
        table.add_row(
            r["model"],
            r["mode"],
            str(r["world_size"]),
            f"{r['trainable_params'] / 1e6:.1f}M",
            f"{r['step_seconds']:.3f}",
            f"{r['tokens_per_second']:,.0f}",
            _gib(r["peak_memory_gib"]),
            _gib(r["setup_memory_gib"]),
            "-" if r["adapter_gather_seconds"] is None else f"{r['adapter_gather_seconds']:.3f}",
        )
    Console(width=120).print(table)  # not a terminal (logs): keep columns whole


def _gib(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["qwen2.5-0.5b", "qwen2.5-1.5b"])
    p.add_argument("--modes", nargs="+", default=["lora", "full"], choices=["lora", "full"])
    p.add_argument("--world-size", nargs="+", type=int, default=[1], help="one or more rank counts, e.g. 1 2")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--batch", type=int, default=16, help="global sequences per step")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--micro-batch-size", type=int, default=4, help="sequences per forward/backward, per rank")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--lora-rank", type=int, default=32)
    p.add_argument("--activation-checkpointing", action="store_true")
    p.add_argument("--tiny", action="store_true", help="tiny shapes for a CPU smoke test")
    p.add_argument("--model-configs", default=str(ROOT / "benchmarks" / "model_configs"))
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/train_step.json; --tiny: /tmp)")
    args = p.parse_args(argv)
    if args.out is None:
        args.out = (
            "/tmp/train_step_tiny.json" if args.tiny else str(ROOT / "benchmarks" / "results" / "train_step.json")
        )
    if args.tiny:
        args.models, args.batch, args.seq_len, args.prompt_len = ["tiny"], 4, 64, 16
        args.micro_batch_size, args.warmup, args.steps, args.lora_rank = 2, 1, 2, 8
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    settings = Settings(**{f: getattr(args, f) for f in Settings.__dataclass_fields__})  # same names as options
    for n in args.world_size:
        if settings.batch % n:
            raise SystemExit(f"--batch {settings.batch} must divide evenly over --world-size {n}")
        if settings.device == "cuda" and torch.cuda.device_count() < n:
            raise SystemExit(f"--world-size {n} needs {n} GPUs, {torch.cuda.device_count()} visible")
    cases = [Case(m, mode, n) for m in args.models for mode in args.modes for n in args.world_size]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    env, results = environment(settings), []
    for case in cases:
        print(f"running {case} ...", flush=True)
        results.append(run_case(case, settings))
        # rewritten after every case, so a run cut short keeps what it measured
        out.write_text(json.dumps({"settings": asdict(settings), "env": env, "results": results}, indent=2))
    print_table(results, f"train step: {settings.batch} x {settings.seq_len} tokens, micro {settings.micro_batch_size}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
