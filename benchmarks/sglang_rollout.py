"""Where a rollout's time goes on a real SGLang: the run's rollout batch under launch and request variants.

The main job's rollout (`benchmarks/gpu_scale.py`: 16 prompts x 8 samples x 256 new tokens, temperature 1,
logprobs, each request seeded, one LoRA adapter) timed through our SGLang client (`HTTPEngine`, the SGLANG
dialect, as `phases.rollout` sends it), on servers started with the command the run resolves
(`launch.resolve_launch` for this batch, SGLang's own memory fraction) and then changed per variant:

    default          the resolved command
    no-lora          the same without `--enable-lora` and its flags: the ceiling LoRA is measured against
    NAME=FLAGS       the resolved command plus FLAGS (later flags win), e.g. `lora-triton=--lora-backend triton`

On each server, cases: `lora-seeded` (what the run sends), `lora-unseeded` (no `sampling_seed`: SGLang
samples with `torch.multinomial` instead of its float64 Gumbel hash), `base-seeded` and `base-unseeded` (no
adapter). tokens/s = completion tokens / wall seconds of one `generate` of the whole batch (median of
`--repeats` after a warm-up). Random weights in the Qwen2.5 shapes (`gpu_scale.build_model`) rarely stop
before `max_new_tokens`, so every case decodes about the same tokens.

Usage, on the GPU host (docs/SGLANG.md, "GPU host")::

    PYTHONPATH=/tmp/ours:$PWD:$PWD/benchmarks python3 benchmarks/sglang_rollout.py --shape 1.5b \\
        --sglang-pythonpath /tmp/sglsite --variant default --variant no-lora \\
        --variant "lora-triton=--lora-backend triton" --out benchmarks/results/gpu_scale/rollout-1.5b.json
    PYTHONPATH=.:benchmarks python benchmarks/sglang_rollout.py --model-dir DIR --tiny \\
        --sglang-python "$(which python)" --sglang-pythonpath lora_rl_testing/fake_sglang:.   # CPU smoke test
"""

from __future__ import annotations

import argparse
import gzip
import json
import shlex
import statistics
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import torch
from _common import ALL_LINEAR, RESULTS, machine_info, print_table, write_json
from _timeline import GPU_CATEGORIES, busy_us, gpu_spans

from lora_rl_core.config import config_from_dict, sglang_section
from lora_rl_core.engines import GenerationRequest, SamplingParams
from lora_rl_core.engines.launch.command import render, sglang_server_command
from lora_rl_core.engines.launch.probe import probe_sglang
from lora_rl_core.engines.launch.process import SGLangServer
from lora_rl_core.engines.launch.resolve import resolve_launch
from lora_rl_core.engines.remote import SGLANG, HTTPEngine
from lora_rl_testing.adapters import random_lora_factory, write_peft_folder

CASES = {
    "lora-seeded": (True, True),
    "lora-unseeded": (True, False),
    "base-seeded": (False, True),
    "base-unseeded": (False, False),
}
LORA_FLAGS = {  # the LoRA pool's flags (`command.sglang_launch_command`) -> how many values follow each
    "--enable-lora": 0,
    "--max-lora-rank": 1,
    "--max-loras-per-batch": 1,
    "--max-loaded-loras": 1,
    "--lora-eviction-policy": 1,
}


def without_lora(argv: list[str]) -> list[str]:
    """`argv` without `--enable-lora` and the LoRA pool's flags (`--lora-target-modules` takes a list)."""
    out: list[str] = []
    skip_list = False
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--lora-target-modules":
            skip_list, i = True, i + 1
            continue
        if skip_list and not arg.startswith("--"):
            i += 1
            continue
        skip_list = False
        if arg in LORA_FLAGS:
            i += 1 + LORA_FLAGS[arg]
            continue
        out.append(arg)
        i += 1
    return out


def variant_argv(base: list[str], variant: str) -> tuple[str, list[str]]:
    """(name, argv) of one `--variant`."""
    if variant == "default":
        return variant, base
    if variant == "no-lora":
        return variant, without_lora(base)
    name, _, flags = variant.partition("=")
    if not flags:
        raise SystemExit(f"--variant {variant!r}: expected default, no-lora or NAME=FLAGS")
    return name, base + shlex.split(flags)


def requests(prompts: list[list[int]], group: int, adapter: str | None, seeded: bool, tokens: int, seed: int) -> list:
    """`group` samples of each prompt, temperature 1, as `phases.rollout` sends them: one `SamplingParams` for
    the batch (one `/generate` call; seeded, the client gives request `i` the seed `seed + i`)."""
    params = SamplingParams(max_new_tokens=tokens, temperature=1.0, seed=seed if seeded else None)
    return [GenerationRequest(prompt, adapter, params) for prompt in prompts for _ in range(group)]


def time_case(engine: HTTPEngine, args: argparse.Namespace, prompts: list, adapter: str | None, seeded: bool) -> dict:
    """Median seconds and tokens/s of `--repeats` whole-batch `generate` calls after one warm-up."""
    runs = []
    for r in range(args.repeats + 1):
        batch = requests(prompts, args.group, adapter, seeded, args.max_new_tokens, seed=1000 * r)
        start = time.perf_counter()
        done = engine.generate(batch, timeout_s=1800.0)
        seconds = time.perf_counter() - start
        aborted = [c for c in done if c.finish_reason == "abort"]
        if aborted:
            raise RuntimeError(f"{len(aborted)} requests aborted, e.g. {aborted[0].abort_reason}")
        if r:
            runs.append((seconds, sum(len(c.completion_ids) for c in done)))
    seconds = statistics.median(s for s, _ in runs)
    tokens = round(statistics.median(t for _, t in runs))
    return {"seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds, "seconds_all": [s for s, _ in runs]}


def profile_case(engine: HTTPEngine, args: argparse.Namespace, prompts: list, adapter: str | None, out: Path) -> dict:
    """One seeded batch with SGLang's torch profiler on for its first `--profile-steps` forward steps (the
    prefill, then decode steps; fewer than `max_new_tokens`, so the profiler stops itself), summarised from its
    chrome trace: the profiled window and GPU-busy time per step and the kernels that took the most GPU time.
    The trace itself stays on the machine."""
    batch = requests(prompts, args.group, adapter, True, args.max_new_tokens, seed=7)
    body = {"output_dir": str(out), "num_steps": args.profile_steps, "activities": ["CPU", "GPU"]}
    httpx.post(f"{engine.url}/start_profile", json=body, timeout=60).raise_for_status()
    engine.generate(batch, timeout_s=1800.0)
    deadline = time.monotonic() + 120
    while not (traces := sorted(out.rglob("*.trace.json.gz"))) and time.monotonic() < deadline:
        time.sleep(1.0)
    if not traces:
        return {"error": f"no trace in {out} after 120 s"}
    time.sleep(2.0)  # let the writer finish the file
    return summarize_trace(traces[-1], args.profile_steps)


def summarize_trace(path: Path, steps: int, top: int = 25) -> dict:
    """Window, GPU-busy time (the union of kernel, memcpy and memset intervals) and the top kernels by GPU time,
    in milliseconds, of one torch-profiler chrome trace covering `steps` forward steps."""
    with gzip.open(path, "rt") as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    gpu = [e for e in events if e.get("ph") == "X" and e.get("cat") in GPU_CATEGORIES]
    if not gpu:
        return {"error": "no GPU events in the trace"}
    spans = gpu_spans(gpu)
    start, end = spans[0][0], max(b for _, b in spans)
    busy, window = busy_us(spans, start, end), end - start
    totals: Counter[str] = Counter()
    counts: Counter[str] = Counter()
    for e in gpu:
        totals[e["name"][:90]] += e["dur"]
        counts[e["name"][:90]] += 1
    kernels = [[name, round(us / 1e3, 3), counts[name]] for name, us in totals.most_common(top)]
    return {
        "steps": steps,
        "window_ms": round(window / 1e3, 2),
        "window_ms_per_step": round(window / 1e3 / steps, 3),
        "gpu_busy_ms_per_step": round(busy / 1e3 / steps, 3),
        "gpu_busy_fraction": round(busy / window, 3),
        "kernels": kernels,
    }


def run_variant(args: argparse.Namespace, name: str, argv: list[str], adapter: Path, prompts: list) -> dict:
    """Start the server of one variant, time the cases it can serve, stop it."""
    log = Path(tempfile.mkdtemp(prefix=f"sglang-rollout-{name}-")) / "server.log"
    env = {"PYTHONPATH": args.sglang_pythonpath} if args.sglang_pythonpath else {}
    lora = "--enable-lora" in argv
    start = time.perf_counter()
    server = SGLangServer(argv, url=f"http://127.0.0.1:{args.port}", log_path=log, env=env, label=f"SGLang ({name})")
    server.start()
    record: dict[str, Any] = {"command": render(argv), "startup_seconds": time.perf_counter() - start, "cases": {}}
    try:
        with HTTPEngine(SGLANG, server.url, timeout_s=1800, max_batch_requests=len(prompts) * args.group) as engine:
            if lora:
                engine.load_adapter("policy", path=str(adapter))
            for case, (with_lora, seeded) in CASES.items():
                if with_lora and not lora:
                    continue
                record["cases"][case] = time_case(engine, args, prompts, "policy" if with_lora else None, seeded)
                print(f"{name} {case}: {record['cases'][case]['tokens_per_s']:.0f} tok/s", flush=True)
            if args.profile_steps and name in args.profile:
                record["profile"] = profile_case(engine, args, prompts, "policy" if lora else None, log.parent / "prof")
                print(f"{name} profile: {json.dumps(record['profile'])[:3000]}", flush=True)
    finally:
        server.stop()
    return record


def main() -> None:
    """Build the model and adapter, run every variant, print the table, write the JSON."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=["0.5b", "1.5b", "7b"], default="1.5b", help="Qwen2.5 shape, random weights")
    p.add_argument("--model-dir", type=Path, default=None, help="an existing HF model folder instead of --shape")
    p.add_argument("--tokenizer", type=Path, default=Path("/tmp/models/meta"), help="for --shape")
    p.add_argument("--models", type=Path, default=Path("/tmp/models"), help="where --shape's folder is built")
    p.add_argument("--sglang-python", default="python3", help="interpreter of the server")
    p.add_argument("--sglang-pythonpath", default=None, help="PYTHONPATH of the server (where sglang imports)")
    p.add_argument("--variant", action="append", default=[], help="default | no-lora | NAME=FLAGS (repeatable)")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--group", type=int, default=8, help="samples per prompt")
    p.add_argument("--prompt-len", type=int, default=48)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--profile-steps", type=int, default=0, help="also profile this many decode steps (0: off)")
    p.add_argument("--profile", action="append", default=["default"], help="variants to profile (default: default)")
    p.add_argument("--tiny", action="store_true", help="smoke test: 2 prompts x 2 samples x 8 tokens, 1 repeat")
    p.add_argument("--out", type=Path, default=None, help="default: results/gpu_scale/rollout-<model>.json")
    args = p.parse_args()
    if args.tiny:
        args.prompts, args.group, args.max_new_tokens, args.prompt_len, args.repeats = 2, 2, 8, 8, 1
    variants = args.variant or ["default", "no-lora"]
    from transformers import AutoConfig, AutoModelForCausalLM

    if args.model_dir is None:
        from gpu_scale import build_model

        args.model_dir = build_model(args.shape, args.tokenizer, args.models / f"qwen2.5-{args.shape}-random")
    hf = AutoConfig.from_pretrained(args.model_dir)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, hf.vocab_size, (args.prompt_len,), generator=gen).tolist() for _ in range(args.prompts)]
    batch = args.prompts * args.group
    cfg = config_from_dict(
        {
            "model": {"name_or_path": str(args.model_dir)},
            "lora": {"rank": args.rank},
            "engine": {"type": "sglang", "launch": {"enabled": True, "python": args.sglang_python, "port": args.port}},
        }
    )
    engine = sglang_section(cfg.engine, "this benchmark")
    launch = engine.launch.model_copy(update={"env": {"PYTHONPATH": args.sglang_pythonpath or ""}})
    resolved = resolve_launch(launch, probe_sglang(launch), rollout_batch=batch)
    base = sglang_server_command(engine, cfg.model, cfg.lora, str(args.model_dir), resolved)
    record: dict[str, Any] = {
        "benchmark": "sglang_rollout",
        "model": args.model_dir.name,
        "batch": {"prompts": args.prompts, "group_size": args.group, "prompt_len": args.prompt_len},
        "max_new_tokens": args.max_new_tokens,
        "lora": {"rank": args.rank, "targets": list(ALL_LINEAR)},
        "resolved": resolved.reasons,
        "variants": {},
        "machine": machine_info("cuda" if torch.cuda.is_available() else "cpu"),
    }
    out = args.out or RESULTS / "gpu_scale" / f"rollout-{args.model_dir.name}.json"
    with tempfile.TemporaryDirectory(prefix="sglang-rollout-adapter-") as tmp:
        with torch.device("meta"):
            shapes = AutoModelForCausalLM.from_config(hf)
        tensors, config = random_lora_factory(shapes, rank=args.rank, targets=ALL_LINEAR, scale=0.02)(1)
        adapter = write_peft_folder(tensors, config, Path(tmp) / "policy")
        for variant in variants:
            name, argv = variant_argv(base, variant)
            record["variants"][name] = run_variant(args, name, argv, adapter, prompts)
            write_json(record, out)  # after each variant: a time limit loses at most the one in progress
    rows = [
        [name, case, r["tokens"], r["seconds"], r["tokens_per_s"], v["startup_seconds"]]
        for name, v in record["variants"].items()
        for case, r in v["cases"].items()
    ]
    title = f"{args.model_dir.name}: {args.prompts} x {args.group} x {args.max_new_tokens} tokens, temperature 1"
    print_table(title, ["variant", "case", "tokens", "seconds", "tok/s", "startup s"], rows)


if __name__ == "__main__":
    main()
