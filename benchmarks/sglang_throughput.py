"""Tokens/s of a real SGLang server with 1, 4 and 8 distinct LoRA adapters in one batch vs the base model, and
of our embedded engine on the same GPU, model and batch (issue: GPU + SGLang, benchmarks 5b and 5c).

The server is started by `lora_rl_core.engines.launch.process.launch_sglang` from `--model-dir` (an HF
folder with its tokenizer, e.g. SmolLM2-135M shapes with random weights), with decode CUDA graphs up to
`--batch` unless `--eager`, `--max-loras-per-batch` = the most adapters + 1 (the base model keeps a slot).
Adapters: random rank-`--rank` LoRA on every linear layer, written as PEFT folders and loaded by path.
`--batch` prompts of `--prompt-len` random tokens, `--max-new-tokens` greedy tokens each; request i names
adapter `i % k`. tokens/s = completion tokens returned / wall seconds of one `generate` call through
`SGLangEngine` (median of `--repeats` after a warm-up), i.e. end to end over HTTP. With `--compare-embedded`
the same cases (same model folder, dtype, prompts, batch, adapters and greedy token count) run on an
`EmbeddedEngine` on `--device` afterwards, the server stopped first: the mixed batch only (one `generate` of
every request, what SGLang's row measures), `--embedded-repeats` times (default 1: one 8-adapter batch of
32 x 128 tokens is ~30-40 s of PEFT on an H100/H200, `benchmarks/results/multi_adapter_cuda.json`), and no
case is started once `--embedded-budget` seconds have passed (it is recorded as skipped). The SGLang table
is printed and the JSON written before the embedded part starts; the JSON is rewritten after each embedded
case (`complete` is False until the end), so a time limit loses at most the case in progress.

Goal (issue): 8 adapters at least 0.7x the single-adapter tokens/s on SGLang (our PEFT engine: 0.22x).

Usage, on the GPU host (docs/SGLANG.md, "GPU host")::

    PYTHONPATH=/tmp/ours:. python3 benchmarks/sglang_throughput.py --model-dir /tmp/models/smollm2-random \\
        --sglang-pythonpath /tmp/sglsite --compare-embedded
    PYTHONPATH=. python benchmarks/sglang_throughput.py --model-dir DIR --tiny \\
        --sglang-python "$(which python)" --sglang-pythonpath lora_rl_testing/fake_sglang:. \
        --dtype float32 --device cpu --compare-embedded         # CPU smoke test against the fake server
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import _common
import torch
from _common import ALL_LINEAR, RESULTS, machine_info, print_table, write_json
from multi_adapter import MODES, bench_case, requests_for, timed_generate
from safetensors.torch import save_file

from lora_rl_core.config import config_from_dict, sglang_section
from lora_rl_core.engines import EmbeddedEngine, SamplingParams, ServingEngine
from lora_rl_core.engines.launch.process import launch_sglang
from lora_rl_core.engines.remote import SGLANG, HTTPEngine
from lora_rl_testing.adapters import random_lora_factory


def adapter_folders(model: torch.nn.Module, count: int, rank: int, root: Path) -> dict[str, str]:
    """`count` random adapters `adapter-0..` as PEFT folders under `root`: name -> folder."""
    make = random_lora_factory(model, rank=rank, targets=ALL_LINEAR, scale=0.02)
    folders = {}
    for j in range(count):
        tensors, config = make(j + 1)
        folder = root / f"adapter-{j}"
        folder.mkdir(parents=True)
        save_file(tensors, folder / "adapter_model.safetensors")
        (folder / "adapter_config.json").write_text(json.dumps(config))
        folders[f"adapter-{j}"] = str(folder)
    return folders


def run_cases(
    engine: ServingEngine,
    folders: dict[str, str],
    counts: list[int],
    prompts: list,
    args: argparse.Namespace,
    *,
    repeats: int,
    modes: tuple[str, ...] = MODES,
    budget_s: float | None = None,
    on_case: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Load the adapters by path, warm up every case, then time base and each adapter count (`repeats` runs
    each, median). With `budget_s`, a case not started within that many seconds of this call is recorded as
    `{"skipped": ...}`; `on_case(results)` runs after each case (partial results)."""
    start = time.monotonic()
    for name, folder in folders.items():
        engine.load_adapter(name, path=folder)
    names = list(folders)
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=0.0)
    cases = {"base": [None], **{str(k): names[:k] for k in counts}}
    timed_generate(engine, [requests_for(prompts, [None], params)])  # warm-up at full size
    for case in cases.values():
        bench_case(engine, prompts, case, SamplingParams(max_new_tokens=4, temperature=0.0), 1, modes)
    results: dict[str, Any] = {}
    for label, case in cases.items():
        spent = time.monotonic() - start
        if budget_s is not None and spent > budget_s:
            results[label] = {"adapters": len([n for n in case if n]), "skipped": f"budget: {spent:.0f} s spent"}
            print(f"{label}: skipped ({spent:.0f} s > budget {budget_s:g} s)", flush=True)
        else:
            results[label] = bench_case(engine, prompts, case, params, repeats, modes)
            print(f"{label}: {results[label]['mixed']['tokens_per_s']:.1f} tok/s", flush=True)
        _vs_single(results, str(min(counts)))
        if on_case is not None:
            on_case(results)
    return results


def _vs_single(results: dict[str, Any], single: str) -> None:
    """`vs_single_adapter` of every timed case, once the single-adapter case is timed."""
    one = results.get(single, {}).get("mixed", {}).get("tokens_per_s")
    for r in results.values():
        if one and "mixed" in r:
            r["vs_single_adapter"] = r["mixed"]["tokens_per_s"] / one


def sglang_results(args: argparse.Namespace, folders: dict[str, str], counts: list[int], prompts: list) -> dict:
    """Start SGLang for `--model-dir`, run the cases through `SGLangEngine`, stop it."""
    launch: dict[str, Any] = {"enabled": True, "port": args.port, "startup_timeout_s": args.startup_timeout}
    launch["python"] = args.sglang_python
    launch["cuda_graph_max_bs"] = None if args.eager else args.batch
    if args.sglang_pythonpath:
        launch["env"] = {"PYTHONPATH": args.sglang_pythonpath}
    for item in args.launch:  # e.g. lora_backend=csgmv
        key, _, value = item.partition("=")
        launch[key] = value
    cfg = config_from_dict(
        {
            "model": {"name_or_path": str(args.model_dir), "dtype": args.dtype},
            "lora": {"rank": args.rank},
            "engine": {
                "type": "sglang",
                "sync": "store",
                "max_loras_per_batch": max(counts) + 1,
                "max_lora_rank": args.rank,
                "launch": launch,
            },
        }
    )
    log = Path(tempfile.mkdtemp(prefix="sglang-bench-")) / "server.log"
    server = launch_sglang(sglang_section(cfg.engine, "this benchmark"), cfg.model, cfg.lora, log)
    try:
        with HTTPEngine(SGLANG, server.url, timeout_s=1800, max_batch_requests=args.batch) as engine:
            cases = run_cases(engine, folders, counts, prompts, args, repeats=args.repeats)
            return {"argv": server.argv, "cases": cases}
    finally:
        server.stop()


def embedded_results(
    args: argparse.Namespace,
    folders: dict[str, str],
    counts: list[int],
    prompts: list,
    on_case: Callable[[dict[str, Any]], None] | None = None,
) -> dict:
    """The same cases on an `EmbeddedEngine` over the same model folder, dtype and batch on `--device`: the
    mixed batch only, `--embedded-repeats` runs each, within `--embedded-budget` seconds."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = _common.resolve_device(args.device)
    dtype = _common.default_dtype(device, "auto" if args.dtype == "auto" else args.dtype)
    start = time.monotonic()
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=dtype).to(device)
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    record: dict[str, Any] = {"device": device, "dtype": str(dtype), "repeats": args.embedded_repeats}
    record["modes"] = ["mixed"]

    def partial(cases: dict[str, Any]) -> None:
        if on_case is not None:
            on_case({**record, "cases": cases})

    budget = args.embedded_budget - (time.monotonic() - start)
    with EmbeddedEngine(model, tokenizer, max_batch_size=args.batch, max_loras_per_batch=max(counts) + 1) as engine:
        cases = run_cases(
            engine, folders, counts, prompts, args,
            repeats=args.embedded_repeats, modes=("mixed",), budget_s=budget, on_case=partial,
        )  # fmt: skip
    record["cases"] = cases
    record["seconds"] = time.monotonic() - start
    return record


def main() -> None:
    """Parse arguments, write the adapters, run SGLang (and the embedded engine), print the table, write JSON."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", type=Path, required=True, help="HF model folder with its tokenizer")
    parser.add_argument("--sglang-python", default="python3", help="interpreter of the server")
    parser.add_argument("--sglang-pythonpath", default=None, help="PYTHONPATH of the server (where sglang imports)")
    parser.add_argument("--adapters", default="1,4,8", help="distinct adapters per batch")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="bfloat16", help="model dtype on both engines")
    parser.add_argument("--device", default="auto", help="the embedded engine's device")
    parser.add_argument("--eager", action="store_true", help="no decode CUDA graphs on the server")
    parser.add_argument("--launch", action="append", default=[], help="engine.launch KEY=VALUE (lora_backend=csgmv)")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--startup-timeout", type=float, default=900.0)
    parser.add_argument("--compare-embedded", action="store_true", help="also run our embedded engine")
    parser.add_argument("--embedded-repeats", type=int, default=1, help="timed runs per embedded case")
    parser.add_argument(
        "--embedded-budget", type=float, default=240.0, help="seconds; no embedded case starts after this"
    )
    parser.add_argument("--tiny", action="store_true", help="smoke test: batch 8, 8 new tokens, 1 repeat")
    parser.add_argument("--out", type=Path, default=None, help="default: results/sglang_throughput_<device>.json")
    args = parser.parse_args()
    if args.tiny:
        args.batch, args.max_new_tokens, args.prompt_len, args.repeats = 8, 8, 8, 1
    counts = [int(k) for k in args.adapters.split(",")]
    from transformers import AutoConfig, AutoModelForCausalLM

    vocab = AutoConfig.from_pretrained(args.model_dir).vocab_size
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, vocab, (args.prompt_len,), generator=gen).tolist() for _ in range(args.batch)]
    device = _common.resolve_device(args.device)
    out = args.out or RESULTS / f"sglang_throughput_{device.split(':')[0]}.json"
    record: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="sglang-bench-adapters-") as tmp:
        shapes = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)
        folders = adapter_folders(shapes, max(counts), args.rank, Path(tmp))
        del shapes
        record["sglang"] = sglang_results(args, folders, counts, prompts)
        save(args, device, record, out, complete=not args.compare_embedded)
        show(args, record)
        if args.compare_embedded:

            def partial(part: dict[str, Any]) -> None:
                save(args, device, {**record, "embedded": part}, out, complete=False)

            record["embedded"] = embedded_results(args, folders, counts, prompts, on_case=partial)
            save(args, device, record, out, complete=True)
            show(args, record)
            compare(args, record)


def save(args: argparse.Namespace, device: str, record: dict[str, Any], out: Path, *, complete: bool) -> None:
    """Write the JSON record (`complete` is False until every part asked for is in)."""
    write_json(
        {
            "benchmark": "sglang_throughput",
            "complete": complete,
            "model": {"dir_name": args.model_dir.name},
            "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "lora": {"rank": args.rank, "targets": list(ALL_LINEAR)},
            "machine": machine_info(device),
            **record,
        },
        out,
    )


def show(args: argparse.Namespace, record: dict[str, Any]) -> None:
    """One row per engine and case: tokens/s of the mixed batch and the ratio to one adapter."""
    rows = [
        [engine, label, r["adapters"], _tps(r), r.get("vs_single_adapter", "-")]
        for engine, part in record.items()
        for label, r in part["cases"].items()
    ]
    title = f"{args.model_dir.name}, {args.batch} requests x {args.max_new_tokens} tokens, rank {args.rank}"
    print_table(title, ["engine", "case", "adapters", "tok/s (one batch)", "vs 1 adapter"], rows)


def compare(args: argparse.Namespace, record: dict[str, Any]) -> None:
    """5c: SGLang vs the embedded engine, per case, same model, batch and tokens."""
    rows = []
    for label, ours in record["embedded"]["cases"].items():
        theirs = record["sglang"]["cases"][label]
        timed = "mixed" in ours and "mixed" in theirs
        ratio = theirs["mixed"]["tokens_per_s"] / ours["mixed"]["tokens_per_s"] if timed else "-"
        rows.append([label, ours["adapters"], _tps(theirs), _tps(ours), ratio])
    title = f"SGLang vs embedded, {args.batch} requests x {args.max_new_tokens} tokens, {args.dtype}"
    print_table(title, ["case", "adapters", "SGLang tok/s", "embedded tok/s", "SGLang / embedded"], rows)


def _tps(result: dict[str, Any]) -> float | str:
    return result["mixed"]["tokens_per_s"] if "mixed" in result else "skipped"


if __name__ == "__main__":
    sys.exit(main())
