"""Decode steps of one adapter on the CPU: the embedded engine's merged weights (`merged.MergedAdapter`) against
PEFT's unmerged LoRA layers (the engine's path before), on the same model and adapter, alternating, in one
process.

The model is the default job's (SmolLM2-135M-Instruct in bfloat16, the engine's CPU attention) with a rank-16
all-linear adapter in bfloat16, as the engine holds one, whose B is random (`--b-std`) so that it changes the
logits. Each arm generates `--tokens` tokens for 1, 4, 16 and 64 rows with no end of sequence (every row runs
to the limit), `--repeats` times. Also reported: each arm's log-probabilities of a fixed completion against
the same model and adapter in float32 (mean absolute difference), and the time of one merge.

    PYTHONPATH=. .venv/bin/python benchmarks/merged_adapter.py

Writes `benchmarks/results/merged_adapter.json` (or `--out`) and prints a table naming the CPU.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from _common import RESULTS, machine_info, print_table, write_json
from peft import LoraConfig, PeftModel, get_peft_model

from lora_rl_core.config import load_config
from lora_rl_core.engines import SamplingParams
from lora_rl_core.engines.embedded.attention import use_decode_attention
from lora_rl_core.engines.embedded.generation import generate_batch
from lora_rl_core.engines.embedded.merged import MergedAdapter
from lora_rl_core.models import load_model
from lora_rl_core.runtime import configure_threads, cpu_description

ADAPTER = "policy"
TEXT = "Question: What is 23 + 58?\nAnswer: 23 + 58 = 81\n#### 81"


def build(config: str, dtype: str, b_std: float) -> tuple[PeftModel, Any]:
    """The config's model in `dtype` on the CPU with a rank-16 all-linear adapter whose B is N(0, b_std)."""
    cfg = load_config(config, ["model.device=cpu", f"model.dtype={dtype}"])
    model, tokenizer = load_model(cfg.model)
    use_decode_attention(model)
    lora = LoraConfig(r=cfg.lora.rank, lora_alpha=cfg.lora.alpha, target_modules="all-linear")
    peft_model = get_peft_model(model, lora, adapter_name=ADAPTER, autocast_adapter_dtype=False)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * b_std)
    return peft_model.eval(), tokenizer


@torch.no_grad()
def token_logprobs(model: Any, ids: torch.Tensor) -> torch.Tensor:
    """`[T - 1]` float32 log-probabilities of `ids[0, 1:]`."""
    logits = model(ids).logits.float()[0, :-1]
    return torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None]).squeeze(-1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/smollm2-arith-grpo.yaml")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--tokens", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--b-std", type=float, default=0.01)
    parser.add_argument("--out", type=Path, default=RESULTS / "merged_adapter.json")
    args = parser.parse_args()
    threads = configure_threads()
    model, tokenizer = build(args.config, "bfloat16", args.b_std)
    merged = MergedAdapter()
    start = time.perf_counter()
    with merged.applied(model, ADAPTER):
        pass
    merge_seconds = time.perf_counter() - start

    ids = torch.tensor([tokenizer(TEXT)["input_ids"]])
    reference = token_logprobs(build(args.config, "float32", args.b_std)[0], ids)
    unmerged_lp = token_logprobs(model, ids)
    with merged.applied(model, ADAPTER):
        merged_lp = token_logprobs(model, ids)
    error = {
        "unmerged": float((unmerged_lp - reference).abs().mean()),
        "merged": float((merged_lp - reference).abs().mean()),
    }

    prompt = tokenizer("What is 23 + 58? Answer:")["input_ids"]
    pad = tokenizer.pad_token_id
    rows_out: list[dict[str, Any]] = []
    for rows in args.rows:
        prompts = [prompt + [100 + i % 7] * (10 + i % 30) for i in range(rows)]  # left padding, as a rollout has
        params = SamplingParams(max_new_tokens=args.tokens, temperature=1.0, seed=0)

        def unmerged_arm(prompts: list[list[int]] = prompts, params: SamplingParams = params) -> None:
            generate_batch(model, prompts, [ADAPTER] * len(prompts), params, pad_id=pad, eos_ids=[])

        def merged_arm(prompts: list[list[int]] = prompts, params: SamplingParams = params) -> None:
            with merged.applied(model, ADAPTER):
                generate_batch(model, prompts, None, params, pad_id=pad, eos_ids=[])

        arms = {"unmerged": unmerged_arm, "merged": merged_arm}
        times: dict[str, list[float]] = {name: [] for name in arms}
        for fn in arms.values():
            fn()  # warm-up
        for _ in range(args.repeats):
            for name, fn in arms.items():
                t = time.perf_counter()
                fn()
                times[name].append((time.perf_counter() - t) / args.tokens)
        ms = {name: 1e3 * statistics.median(v) for name, v in times.items()}
        rows_out.append({"rows": rows, "unmerged_ms_per_step": ms["unmerged"], "merged_ms_per_step": ms["merged"]})

    print_table(
        f"decode step, {cpu_description()}, {threads} threads ({args.tokens} tokens, median of {args.repeats})",
        ["rows", "unmerged ms", "merged ms", "speed-up"],
        [
            [r["rows"], f"{r['unmerged_ms_per_step']:.1f}", f"{r['merged_ms_per_step']:.1f}",
             f"{r['unmerged_ms_per_step'] / r['merged_ms_per_step']:.2f}x"]
            for r in rows_out
        ],
    )  # fmt: skip
    print(f"merge: {merge_seconds:.3f} s; mean |logprob - float32| unmerged {error['unmerged']:.4f}, "
          f"merged {error['merged']:.4f}")  # fmt: skip
    write_json(
        {
            "benchmark": "merged_adapter",
            "machine": {**machine_info("cpu"), "cpu_model": cpu_description(), "threads": threads},
            "config": vars(args) | {"out": str(args.out.name)},
            "merge_seconds": merge_seconds,
            "logprob_error_vs_float32": error,
            "rows": rows_out,
        },
        args.out,
    )


if __name__ == "__main__":
    main()
