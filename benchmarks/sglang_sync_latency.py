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
* `ipc[:LAYOUT][:DTYPE]`: `load_adapter(name, tensors=..., config=...)` with `tensor_transport="ipc"`: CUDA
  IPC handles in `/load_lora_adapter_from_tensors` (same host) -> first `generate`. LAYOUT is one of
  `sglang_tensors.IPC_LAYOUTS`: `per-tensor` (each tensor its own CUDA copy: what the client sent before),
  `packed` (views into one buffer) or `host` (one buffer the server copies to host memory once); DTYPE casts
  before sending (`bfloat16`: the model's dtype, what SGLang's GPU pool holds). Without them: `per-tensor`
  and the trainer's float32, the client before `engine.tensor_layout` / `engine.tensor_dtype` (whose
  defaults are `host` and `bfloat16`);
* `inline[:DTYPE]`: the same with the data inline (CPU copy, pickle, base64 in the JSON body).

The variants reach the client's own load path: while a variant loads, `sglang_tensors.ipc_payload` (or
`inline_payload`) is wrapped with its options and timed (`payload_s`: building the payload, part of load).

First `generate`: one fresh `--prompt-len`-token prompt, 1 greedy token, naming the new version (its version
is checked). SGLang computes that token in the prefill, but its overlap scheduler launches the next decode
step of the batch before it processes the prefill's result and answers (`Scheduler.event_loop_overlap`), so
the answer waits for one decode launch: eager (`--graphs eager`, 30-45 ms on the H100) or a CUDA graph
replay (`decode`, the default, `--decode-graph-bs`). `--graphs prefill` also captures SGLang's breakable
prefill CUDA graphs up to `--prefill-graph-tokens` tokens (SGLang's default on CUDA, where it supports LoRA;
`engine.launch` turns it off). After the first completion, untimed in the total: `steady_s`, a
second 1-token completion on a fresh prompt with the adapter now in SGLang's GPU pool (first_s - steady_s
is the first-use cost: SGLang copies the adapter from its CPU pool into the GPU pool on its first request),
and with prefill graphs `steady_eager_s`, the same with a prompt longer than the captured sizes (eager
prefill). Columns: publish (store write; 0 on the tensor paths, where the flow writes the store as well but
the engine does not wait for it), load, first completion, total; medians over the rounds after one untimed
warm-up round (every variant of every rank per round, interleaved); MB = 10**6 bytes of the adapter's
safetensors file. The previous version is unloaded between measurements (untimed, no n>1 traffic:
sglang#36894). A variant that fails is dropped (the JSON's `failed` says why) and the others go on. Rounds
stop at `--budget-s` seconds after the start (the JSON, rewritten after each round, says how many ran); if
the server does not start with prefill graphs, or every variant fails its warm-up there, it is started again
with decode graphs only, once, when at least `--fallback-min-s` of the budget is left.

Usage, on the GPU host (docs/SGLANG.md, "GPU host")::

    PYTHONPATH=/tmp/ours:. python3 benchmarks/sglang_sync_latency.py --tokenizer-dir /tmp/models/meta \\
        --sglang-pythonpath /tmp/sglsite --graphs prefill --startup-timeout 270 \\
        --out $OUT/sglang_sync_latency_h100.json --server-log $OUT/sglang_server.log
    PYTHONPATH=. python benchmarks/sglang_sync_latency.py --tiny --tokenizer-dir TOKENIZER_DIR \\
        --sglang-python "$(which python)" --sglang-pythonpath lora_rl_testing/fake_sglang:. --paths disk,inline
        # CPU smoke test against the fake server
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import _common
import torch
from _common import ALL_LINEAR, MODEL_CONFIGS, RESULTS, machine_info, print_table, write_json

from lora_rl_core.adapters import safetensors_bytes
from lora_rl_core.config import config_from_dict
from lora_rl_core.engines import GenerationRequest, SamplingParams
from lora_rl_core.engines.launch.process import SGLangServer, launch_sglang
from lora_rl_core.engines.remote import SGLANG, HTTPEngine
from lora_rl_core.engines.remote import ipc as sglang_tensors
from lora_rl_core.errors import EngineError
from lora_rl_core.store import AdapterStore
from lora_rl_testing.adapters import random_lora_factory

TRANSPORTS = ("disk", "ipc", "inline")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
GRAPHS = ("eager", "decode", "prefill")
DEFAULT_PATHS = "disk,ipc:per-tensor,ipc:packed,ipc:packed:bfloat16,ipc:host:bfloat16"
PARTS = ("publish_s", "load_s", "first_s", "total_s")
EXTRA = ("payload_s", "steady_s", "steady_eager_s", "first_use_s")


@dataclass(frozen=True)
class Variant:
    """One measured path: `transport` with the payload options `layout` (ipc) and `dtype` (None: defaults)."""

    transport: str
    layout: str | None = None
    dtype: str | None = None

    @property
    def label(self) -> str:
        return ":".join(p for p in (self.transport, self.layout, self.dtype) if p)

    @property
    def slug(self) -> str:
        return self.label.replace(":", "-")

    def describe(self) -> dict[str, Any]:
        """The flags, with the defaults resolved (what was sent)."""
        out: dict[str, Any] = {"transport": self.transport, "dtype": self.dtype or "float32 (trainer)"}
        if self.transport == "ipc":
            out["layout"] = self.layout or f"{sglang_tensors.DEFAULT_IPC_LAYOUT} (default)"
        return out


def parse_path(token: str) -> Variant:
    """`disk`, `inline[:DTYPE]` or `ipc[:LAYOUT][:DTYPE]`."""
    transport, *options = token.split(":")
    if transport not in TRANSPORTS:
        raise SystemExit(f"--paths: {token!r}: transport must be one of {TRANSPORTS}")
    layout = dtype = None
    for option in options:
        if option in DTYPES and dtype is None:
            dtype = option
        elif transport == "ipc" and option in sglang_tensors.IPC_LAYOUTS and layout is None:
            layout = option
        else:
            allowed = [*DTYPES, *(sglang_tensors.IPC_LAYOUTS if transport == "ipc" else ())]
            raise SystemExit(f"--paths: {token!r}: {option!r} is not one of {allowed} (or given twice)")
    if transport == "disk" and options:
        raise SystemExit(f"--paths: {token!r}: disk takes no options")
    return Variant(transport, layout, dtype)


@contextmanager
def payload_options(variant: Variant, record: list[tuple[float, int]]) -> Iterator[None]:
    """While `variant` loads: the client's payload builder with the variant's options, timed; each call
    appends (seconds, payload characters) to `record`."""
    if variant.transport == "disk":
        yield
        return
    name = f"{variant.transport}_payload"
    original = getattr(sglang_tensors, name)
    options: dict[str, Any] = {}
    if variant.layout:
        options["layout"] = variant.layout
    if variant.dtype:
        options["dtype"] = DTYPES[variant.dtype]

    def timed(tensors: Any, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        out = original(tensors, *args, **{**kwargs, **options})
        record.append((time.perf_counter() - start, len(out[0] if isinstance(out, tuple) else out)))
        return out

    setattr(sglang_tensors, name, timed)
    try:
        yield
    finally:
        setattr(sglang_tensors, name, original)


def write_model(cfg: dict[str, Any], tokenizer_dir: Path, out: Path) -> torch.nn.Module:
    """A random-weight bf16 model of `cfg` with the tokenizer's vocabulary, saved with the tokenizer to `out`;
    returns it (CPU) for the adapters' shapes."""
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


def complete(ctx: dict[str, Any], engine: HTTPEngine, name: str, version: int, tokens: int) -> float:
    """Seconds of one greedy 1-token request naming `name` on a fresh `tokens`-token prompt (no prefix in
    SGLang's radix cache); fails unless that version served it."""
    prompt = torch.randint(3, ctx["vocab"], (tokens,), generator=ctx["gen"]).tolist()
    request = GenerationRequest(prompt, name, SamplingParams(max_new_tokens=1, temperature=0.0))
    start = time.perf_counter()
    (done,) = engine.generate([request], timeout_s=ctx["timeout"])
    seconds = time.perf_counter() - start
    if done.finish_reason == "abort" or done.adapter_version != version:
        raise RuntimeError(f"{name}: first completion {done.finish_reason}, version {done.adapter_version}")
    return seconds


def measure(ctx: dict[str, Any], variant: Variant, rank: int, version: int) -> dict[str, float]:
    """One publish -> load -> first completion of `variant`; seconds of each part, the total, and the probes."""
    engine: HTTPEngine = ctx["engines"][variant.transport]
    run = f"{variant.slug}-r{rank}"
    name = f"{run}-v{version:06d}"
    tensors, config = ctx["trainer"][rank]
    payloads: list[tuple[float, int]] = []
    t0 = time.perf_counter()
    if variant.transport == "disk":
        ref = ctx["store"].publish(run, version, tensors=tensors, adapter_config=config, step=version, base_model="x")
        t1 = time.perf_counter()
        engine.load_adapter(name, path=ref.uri)
    else:
        t1 = t0
        with payload_options(variant, payloads):
            engine.load_adapter(name, tensors=tensors, config=config)
        if len(payloads) != 1:
            raise RuntimeError(
                f"{variant.label}: HTTPEngine.load_adapter built {len(payloads)} payloads through "
                f"sglang_tensors.{variant.transport}_payload (expected 1): the variant's options were not applied"
            )
    t2 = time.perf_counter()
    first = complete(ctx, engine, name, version, ctx["prompt_len"])
    out = {"publish_s": t1 - t0, "load_s": t2 - t1, "first_s": first, "total_s": t2 - t0 + first}
    if payloads:
        out["payload_s"], out["payload_chars"] = payloads[0]
    out["steady_s"] = complete(ctx, engine, name, version, ctx["prompt_len"])
    out["first_use_s"] = first - out["steady_s"]
    if ctx["eager_prompt_len"]:
        out["steady_eager_s"] = complete(ctx, engine, name, version, ctx["eager_prompt_len"])
    for other in engine.list_adapters():  # untimed: keep one version resident
        if other != name:
            engine.unload_adapter(other)
    return out


def summarize(runs: dict[Variant, list[dict[str, float]]], tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """`{"mb": adapter file size (10**6 bytes), "paths": {label: flags, medians, all samples}}`."""
    out: dict[str, Any] = {"mb": len(safetensors_bytes(tensors)) / 1e6, "paths": {}}
    for variant, samples in runs.items():
        row: dict[str, Any] = {**variant.describe(), "n": len(samples)}
        for key in (*PARTS, *EXTRA, "payload_chars"):
            if samples and all(key in s for s in samples):
                row[key] = statistics.median(s[key] for s in samples)
        for key in ("total_s", "load_s", "first_s"):
            row[f"{key}_all"] = [s[key] for s in samples]
        out["paths"][variant.label] = row
    return out


class _WarmUpFailed(Exception):
    """Every variant failed in the warm-up round on a server that had started (with prefill graphs: retried
    without)."""


def launch_config(args: argparse.Namespace, model_dir: Path, graphs: str, port: int) -> Any:
    """The run config whose `engine.launch` starts the server with `graphs` (eager, decode, prefill)."""
    ranks = [int(r) for r in args.ranks.split(",")]
    launch: dict[str, Any] = {"enabled": True, "port": port, "python": args.sglang_python}
    launch["startup_timeout_s"] = args.startup_timeout
    launch["cuda_graph_max_bs"] = None if graphs == "eager" else args.decode_graph_bs
    extra = shlex.split(args.server_args)
    if graphs == "prefill":  # after launch_flags' `--cuda-graph-backend-prefill disabled`: the last one counts
        extra += ["--cuda-graph-backend-prefill", "breakable", "--cuda-graph-max-bs-prefill"]
        extra.append(str(args.prefill_graph_tokens))
    launch["extra_args"] = extra
    if args.sglang_pythonpath:
        launch["env"] = {"PYTHONPATH": args.sglang_pythonpath}
    return config_from_dict(
        {
            "model": {"name_or_path": str(model_dir), "dtype": "bfloat16"},
            "lora": {"rank": max(ranks), "target_modules": list(ALL_LINEAR)},
            "engine": {"type": "sglang", "max_loras_per_batch": 2, "max_lora_rank": max(ranks), "launch": launch},
        }
    )


def attempt(ctx: dict[str, Any], variant: Variant, rank: int, version: int) -> dict[str, float] | None:
    """`measure`, or None when it failed: the variant is dropped from the run, why is kept in `ctx["failed"]`
    (one variant SGLang refuses does not stop the others)."""
    try:
        return measure(ctx, variant, rank, version)
    except (EngineError, RuntimeError) as exc:
        why = " ".join(str(exc).split())[:2000]
        print(f"{variant.label} rank {rank} failed, dropped: {why[:300]}", flush=True)
        ctx["failed"][variant.label] = f"rank {rank}, version {version}: {why}"
        ctx["variants"].remove(variant)
        return None


def warm_up(ctx: dict[str, Any]) -> float:
    """One untimed measurement of every variant of every rank (Triton JIT, graphs, payload code); seconds.

    Raises:
        _WarmUpFailed: every variant failed (the server, not a variant).
    """
    start = time.monotonic()
    for rank in ctx["ranks"]:
        for variant in list(ctx["variants"]):
            attempt(ctx, variant, rank, 900000)
    if not ctx["variants"]:
        raise _WarmUpFailed(f"every variant failed in the warm-up round: {ctx['failed']}")
    return time.monotonic() - start


def run_rounds(
    ctx: dict[str, Any], repeats: int, deadline: float, last: float, on_round: Any
) -> dict[str, dict[Variant, list[dict[str, float]]]]:
    """Timed rounds (every variant of every rank, interleaved) until `repeats`, or until the next round, as long
    as the last one (`last` seconds at first), would end after `deadline` (one round at least); calls
    `on_round(runs, rounds_done)` after each. A variant that fails is dropped; its samples stay."""
    ranks = ctx["ranks"]
    runs: dict[str, dict[Variant, list[dict[str, float]]]] = {str(r): {v: [] for v in ctx["variants"]} for r in ranks}
    for version in range(1, repeats + 1):
        if version > 1 and time.monotonic() + last > deadline:
            print(f"budget: stopping after {version - 1} of {repeats} rounds", flush=True)
            break
        start = time.monotonic()
        for rank in ranks:
            for variant in list(ctx["variants"]):
                sample = attempt(ctx, variant, rank, version)
                if sample is not None:
                    runs[str(rank)][variant].append(sample)
        last = time.monotonic() - start
        print(f"[{time.monotonic() - ctx['t0']:.0f} s] round {version}: {last:.1f} s", flush=True)
        on_round(runs, version)
        if not ctx["variants"]:
            break
    return runs


def main() -> None:
    """Write the model, start SGLang, measure every rank and variant, print the table, write JSON."""
    t0 = time.monotonic()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokenizer-dir", type=Path, required=True, help="HF folder with a tokenizer")
    parser.add_argument("--model-config", type=Path, default=MODEL_CONFIGS / "qwen2.5-0.5b.json")
    parser.add_argument("--sglang-python", default="python3", help="interpreter of the server")
    parser.add_argument("--sglang-pythonpath", default=None, help="PYTHONPATH of the server (where sglang imports)")
    parser.add_argument("--ranks", default="8,32,64")
    parser.add_argument("--paths", default=DEFAULT_PATHS, help="disk, inline[:DTYPE], ipc[:LAYOUT][:DTYPE]")
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds after the warm-up round")
    parser.add_argument("--graphs", choices=GRAPHS, default="decode", help="server CUDA graphs (prefill: + decode)")
    parser.add_argument("--eager", action="store_true", help="the same as --graphs eager")
    parser.add_argument("--decode-graph-bs", type=int, default=8, help="largest decode batch captured")
    parser.add_argument("--prefill-graph-tokens", type=int, default=16, help="largest prefill captured (tokens)")
    parser.add_argument("--server-args", default="", help="more sglang.launch_server flags, one string")
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--startup-timeout", type=float, default=900.0)
    parser.add_argument("--budget-s", type=float, default=280.0, help="no round starts that would end after it")
    parser.add_argument("--fallback-min-s", type=float, default=120.0)
    parser.add_argument("--request-timeout", type=float, default=120.0, help="seconds per SGLang call")
    parser.add_argument("--server-log", type=Path, default=None, help="default: in the temporary folder")
    parser.add_argument("--tiny", action="store_true", help="smoke test: tiny Qwen2 shapes, ranks 8, 1 repeat")
    parser.add_argument("--out", type=Path, default=None, help="default: results/sglang_sync_latency_<device>.json")
    args = parser.parse_args()
    if args.eager:
        args.graphs = "eager"
    if args.tiny:
        args.ranks, args.repeats = "8", 1
    ranks = [int(r) for r in args.ranks.split(",")]
    variants = list(dict.fromkeys(parse_path(p) for p in args.paths.split(",") if p))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    out_path = args.out or RESULTS / f"sglang_sync_latency_{device}.json"
    cfg = _common.model_config(None if args.tiny else args.model_config)
    deadline = t0 + args.budget_s
    record: dict[str, Any] = {
        "benchmark": "sglang_sync_latency",
        "complete": False,
        "model": {"shapes": "tiny" if args.tiny else args.model_config.stem, "vocab": "the tokenizer's"},
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "machine": machine_info(device),
    }
    with tempfile.TemporaryDirectory(prefix="sglang-sync-") as tmp:
        model_dir = Path(tmp) / ("tiny-random" if args.tiny else f"{args.model_config.stem}-random")
        shapes = write_model(cfg, args.tokenizer_dir, model_dir)
        vocab = shapes.config.vocab_size
        trainer = {}
        for rank in ranks:
            tensors, config = random_lora_factory(shapes, rank=rank, targets=ALL_LINEAR, scale=0.01)(rank)
            trainer[rank] = ({k: v.to(device) for k, v in tensors.items()}, config)
        del shapes
        print(f"[{time.monotonic() - t0:.0f} s] model and adapters written", flush=True)
        log = args.server_log or Path(tmp) / "server.log"

        def write(runs: dict[str, dict[Variant, list[dict[str, float]]]], rounds: int) -> None:
            results = {rank: summarize(r, trainer[int(rank)][0]) for rank, r in runs.items()}
            record.update(complete=rounds == args.repeats, rounds=rounds, ranks=results)
            write_json(record, out_path)

        plans = [args.graphs] + (["decode"] if args.graphs == "prefill" else [])
        failure: str | None = None
        for try_no, graphs in enumerate(plans):
            server: SGLangServer | None = None
            try:
                launch_start = time.monotonic()
                cfg = launch_config(args, model_dir, graphs, args.port + try_no)
                server = launch_sglang(cfg.engine, cfg.model, cfg.lora, log)
                launch_s = time.monotonic() - launch_start
                print(f"[{time.monotonic() - t0:.0f} s] server up ({graphs} graphs) in {launch_s:.0f} s", flush=True)
                record["server"] = {"graphs": graphs, "launch_s": launch_s, "argv": server.argv}
                record["server"]["prefill_graphs_failed"] = failure
                timeout = args.request_timeout
                engines = {
                    # per-tensor float32 unless a variant says otherwise: the client before engine.tensor_layout
                    t: HTTPEngine(
                        SGLANG,
                        server.url,
                        timeout_s=timeout,
                        control_timeout_s=timeout,
                        tensor_transport=t,
                        tensor_layout="per-tensor",
                        tensor_dtype="keep",
                    )
                    for t in dict.fromkeys(v.transport for v in variants)
                }
                ctx: dict[str, Any] = {"engines": engines, "variants": list(variants), "ranks": ranks, "t0": t0}
                ctx["failed"] = record["failed"] = {}
                ctx |= {"trainer": trainer, "timeout": timeout, "vocab": vocab, "gen": torch.Generator().manual_seed(0)}
                ctx |= {"prompt_len": args.prompt_len, "store": AdapterStore(f"file://{tmp}/store{try_no}")}
                ctx["eager_prompt_len"] = args.prefill_graph_tokens + args.prompt_len if graphs == "prefill" else 0
                last = warm_up(ctx)
                print(f"[{time.monotonic() - t0:.0f} s] warm-up round: {last:.1f} s", flush=True)
                run_rounds(ctx, args.repeats, deadline, last, write)
                for engine in engines.values():
                    engine.close()
                break
            except (EngineError, _WarmUpFailed) as exc:  # the launch or the warm-up round
                failure = " ".join(str(exc).split())[:3000]
                retry = graphs == "prefill" and try_no + 1 < len(plans)
                if retry and deadline - time.monotonic() >= args.fallback_min_s:
                    print(f"prefill graphs failed ({failure[:300]}); starting the server without them", flush=True)
                    continue
                record["error"] = failure
                write_json(record, out_path)
                raise
            finally:
                if server is not None:
                    server.stop()
    results = record.get("ranks", {})
    rows = [
        [rank, f"{r['mb']:.1f}", label, *(1000 * p.get(k, float("nan")) for k in (*PARTS, "payload_s", "steady_s"))]
        for rank, r in results.items()
        for label, p in r["paths"].items()
    ]
    columns = ["rank", "MB", "path", "publish ms", "load ms", "first ms", "total ms", "payload ms", "steady ms"]
    title = f"publish -> first completion on SGLang ({device}, {record['server']['graphs']} graphs)"
    print_table(f"{title}, medians of {record.get('rounds', 0)}", columns, rows)


if __name__ == "__main__":
    sys.exit(main())
