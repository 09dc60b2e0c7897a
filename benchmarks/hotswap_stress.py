"""Hot-swap stress at full size: 200 adapter swaps while 32 clients sample groups of n=4, with random aborts
and pauses, in-process and over HTTP; prints the counts and writes `benchmarks/results/hotswap_stress.json`.

The run and its checks are `lora_rl_testing.stress.run_hotswap_stress` (read its docstring for the invariants).
Targets: `in-process` (`EmbeddedEngine`, groups of n requests), `http-n` (our engine server over HTTP, one
SGLang `/generate` with `sampling_params.n` per group, versions as the server reports them) and `http-group`
(n requests per group through `ServerEngine.generate`, the rollout path); the server runs in a thread of
this process on 127.0.0.1. The model is a tiny random Qwen2-shaped one by default (this measures protocol
correctness, not speed); `--model-config` gives a real shape, `--layers` truncates it. Exits 1 when an
invariant is breached.

Real SGLang (`sglang-group`, `sglang-n`; GPU host): one server is launched by `launch_sglang` on
`--model-dir` and the targets run on it in the order given; adapters are random rank-`--rank` LoRA on
q_proj/v_proj, loaded from tensors (`--tensor-transport`, default auto: CUDA IPC). `sglang-group` sends each
group as `n` requests (the rollout path); `sglang-n` as one `/generate` with `sampling_params.n`, after
which SGLang's unload hangs (sglang#36894): run it last, with a short `--deadline`. `--sglang-retire` is the
client's retire policy (`engine.sglang_retire`): `unload` calls `/unload_lora_adapter`; `keep` retires in the
client only, so every version stays resident (no `--max-loaded-loras`: SGLang's CPU pool is unbounded, and
its LRU eviction would unload, i.e. wait as an unload does). After each target its table is printed and the
JSON written (`complete` False until the last), with the client's metrics and the server's adapter count and
resident memory (`sglang.targets`).

Usage::

    PYTHONPATH=. python benchmarks/hotswap_stress.py [--swaps 200 --clients 32 --n 4] [--targets in-process,http-n]
    PYTHONPATH=/tmp/ours:. python3 benchmarks/hotswap_stress.py --targets sglang-group,sglang-n \
        --model-dir /tmp/models/smollm2-random --sglang-pythonpath /tmp/sglsite --device cuda \
        [--sglang-retire keep]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import _common
from _common import RESULTS, machine_info, model_config, print_table, random_model, stub_tokenizer, write_json
from _sglang import launch_small_sglang, server_facts

from lora_rl_core.config import SGLANG_RETIRE_POLICIES
from lora_rl_core.engines import EmbeddedEngine
from lora_rl_testing.adapters import random_lora_factory
from lora_rl_testing.servers import serve_in_thread
from lora_rl_testing.stress import StressReport, run_hotswap_stress

TARGETS = ("in-process", "http-n", "http-group", "sglang-group", "sglang-n")
ROWS = (
    "wall_s", "swaps", "retired", "pauses", "groups", "requests", "completed", "aborted",
    "rejected", "abort_calls", "aborts_acknowledged",
    "latency_mean_s", "latency_p50_s", "latency_p99_s", "latency_max_s",
    *StressReport.VIOLATIONS,
)  # fmt: skip


def run_target(target: str, args: argparse.Namespace, cfg: dict) -> StressReport:
    """One stress run against a fresh engine on a fresh random model."""
    model = random_model(cfg, device=args.device, dtype=_common.default_dtype(args.device, "auto"))
    make_adapter = random_lora_factory(model, rank=args.rank)
    engine = EmbeddedEngine(model, stub_tokenizer(cfg), max_batch_size=args.max_batch_size)
    options = {
        "swaps": args.swaps, "clients": args.clients, "n": args.n, "deadline_s": args.deadline,
        "abort_prob": args.abort_prob, "pause_prob": args.pause_prob, "seed": args.seed,
        "vocab_size": cfg["vocab_size"], "run_id": target.replace("-", ""),
    }  # fmt: skip
    with engine:
        if target == "in-process":
            return run_hotswap_stress(engine, make_adapter, **options)
        with serve_in_thread(engine, request_timeout_s=args.request_timeout, control_timeout_s=30.0) as url:
            return run_hotswap_stress(url, make_adapter, **options, samples=target.removeprefix("http-"))


def run_sglang_targets(
    targets: list[str], args: argparse.Namespace, on_target: Callable[[dict[str, StressReport], dict], None]
) -> tuple[dict[str, StressReport], dict[str, Any]]:
    """The `sglang-*` targets, in order, on one SGLang server launched on `--model-dir` (stopped after);
    `on_target(reports, facts)` runs after each target. Returns the reports and per-target facts: the client's
    metrics, the adapters the server lists and its resident memory."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from lora_rl_core.engines.remote import SGLANG, HTTPEngine

    if args.model_dir is None:
        raise SystemExit("the sglang-* targets need --model-dir (an HF model folder with its tokenizer)")
    shapes = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)
    make_adapter = random_lora_factory(shapes, rank=args.rank)
    vocab = AutoConfig.from_pretrained(args.model_dir).vocab_size
    log = Path(tempfile.mkdtemp(prefix="stress-sglang-")) / "server.log"
    server = launch_small_sglang(
        args.model_dir, log, rank=args.rank, port=args.sglang_port, python=args.sglang_python,
        pythonpath=args.sglang_pythonpath,
    )  # fmt: skip
    reports: dict[str, StressReport] = {}
    facts: dict[str, Any] = {"retire": args.sglang_retire, "argv": server.argv, "targets": {}}
    facts["server_at_start"] = server_facts(server.url, server.pid)
    try:
        for target in targets:
            options = {
                "swaps": args.swaps, "clients": args.clients, "n": args.n, "deadline_s": args.deadline,
                "abort_prob": args.abort_prob, "pause_prob": args.pause_prob, "seed": args.seed,
                "vocab_size": vocab, "run_id": target.replace("-", ""), "samples": target.removeprefix("sglang-"),
                "request_timeout_s": args.request_timeout,
            }  # fmt: skip
            timeouts = {"timeout_s": args.request_timeout, "control_timeout_s": 30.0}
            engine = HTTPEngine(
                SGLANG, server.url, **timeouts, tensor_transport=args.tensor_transport, retire=args.sglang_retire
            )
            with engine:
                reports[target] = run_hotswap_stress(engine, make_adapter, **options)
                metrics = engine.metrics()
            metrics.pop("adapters", None)  # per-adapter request counts: hundreds of names
            facts["targets"][target] = {"client": metrics, "server": server_facts(server.url, server.pid)}
            print(f"{target}: ok={reports[target].ok} {facts['targets'][target]}", flush=True)
            on_target(reports, facts)
    finally:
        print("server log tail:\n" + server.log_tail(80), flush=True)
        server.stop()
    return reports, facts


def show(reports: dict[str, StressReport], title: str) -> None:
    """One row per count, one column per target."""
    rows = []
    for key in ROWS:
        values = [getattr(r, key) for r in reports.values()]
        rows.append([key, *[_cell(v) for v in values]])
    rows.append(["ok", *[str(r.ok) for r in reports.values()]])
    print_table(title, ["count", *reports], rows)
    for target, report in reports.items():
        for example in report.examples[:5]:
            print(f"{target}: {example}")


def _cell(value: object) -> object:
    if isinstance(value, dict):
        return ", ".join(f"{k}={v}" for k, v in value.items()) or "-"
    return value


def main() -> int:
    """Parse arguments, run each target, print the table, write the JSON; 1 when an invariant broke."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--swaps", type=int, default=200)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--abort-prob", type=float, default=0.1)
    parser.add_argument("--pause-prob", type=float, default=0.1, help="per 0.1 s tick")
    parser.add_argument("--deadline", type=float, default=600.0, help="seconds, per target")
    parser.add_argument("--request-timeout", type=float, default=60.0, help="server-side /generate deadline (s)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rank", type=int, default=2)
    parser.add_argument("--max-batch-size", type=int, default=32)
    parser.add_argument("--targets", default=",".join(TARGETS))
    parser.add_argument("--model-config", type=Path, default=None, help="default: a tiny Qwen2-shaped model")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--model-dir", type=Path, default=None, help="sglang-* targets: the server's model")
    parser.add_argument("--sglang-python", default=None, help="sglang-* targets: the server's interpreter")
    parser.add_argument("--sglang-pythonpath", default=None, help="sglang-* targets: the server's PYTHONPATH")
    parser.add_argument("--sglang-port", type=int, default=30001, help="sglang-* targets: the server's port")
    parser.add_argument("--tensor-transport", default="auto", help="sglang-* targets: ipc | inline | auto")
    parser.add_argument(
        "--sglang-retire",
        choices=SGLANG_RETIRE_POLICIES,
        default="unload",
        help="sglang-* targets: unload (/unload_lora_adapter) | keep (retire in the client only)",
    )
    parser.add_argument("--out", type=Path, default=RESULTS / "hotswap_stress.json")
    args = parser.parse_args()
    args.device = _common.resolve_device(args.device)
    cfg = model_config(args.model_config, layers=args.layers)

    targets = [t for t in args.targets.split(",") if t]
    unknown = sorted(set(targets) - set(TARGETS))
    if unknown:
        parser.error(f"unknown targets {unknown}; choose from {TARGETS}")
    ours = [t for t in targets if not t.startswith("sglang-")]
    real = [t for t in targets if t.startswith("sglang-")]
    model_name = args.model_config.stem if args.model_config else "tiny-qwen2"
    if real:
        model_name = f"{model_name} (ours), {args.model_dir.name} (SGLang)" if ours else args.model_dir.name
    title = f"hot-swap stress: {args.swaps} swaps, {args.clients} clients, n={args.n}, {model_name}"
    reports = {target: run_target(target, args, cfg) for target in ours}
    sglang: dict[str, Any] | None = None
    if real:

        def partial(done: dict[str, StressReport], facts: dict[str, Any]) -> None:
            last = list(done)[-1]
            show({last: done[last]}, f"{title}, retire={args.sglang_retire}")
            save(args, cfg, model_name, {**reports, **done}, facts, complete=len(done) == len(real))

        real_reports, sglang = run_sglang_targets(real, args, partial)
        reports.update(real_reports)
    show(reports, title)
    save(args, cfg, model_name, reports, sglang, complete=True)
    return 0 if all(r.ok for r in reports.values()) else 1


def save(
    args: argparse.Namespace,
    cfg: dict,
    model_name: str,
    reports: dict[str, StressReport],
    sglang: dict[str, Any] | None,
    *,
    complete: bool,
) -> None:
    """Write the JSON record (`complete` is False until every target is in)."""
    record: dict[str, Any] = {
        "benchmark": "hotswap_stress",
        "complete": complete,
        "model": {"name": model_name, "config": cfg},
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "machine": machine_info(args.device),
        "ok": all(r.ok for r in reports.values()),
        "results": {target: report.as_dict() for target, report in reports.items()},
    }
    if sglang is not None:
        record["sglang"] = sglang
    write_json(record, args.out)


if __name__ == "__main__":
    sys.exit(main())
