"""The trainer's logprobs and entropy from logits, forward and backward: `token_logprobs` (the written-out
backward, `lora_rl_core.algorithm.logprobs`) against TRL's `selective_log_softmax` formula under autograd plus a
separate entropy pass (what the trainer ran before), on the same logits, alternating, in one process.

The default shape is one micro-batch of the default job on the CPU: 16 rows x 48 completion positions x
SmolLM2's 49,152-token vocabulary, bfloat16 logits (the model's output dtype). Each repeat times both: the
forward (logprobs and the entropy metric) and the backward of a weighted sum of the logprobs.

    PYTHONPATH=. .venv/bin/python benchmarks/token_logprobs.py                  # the default job's micro-batch
    PYTHONPATH=. .venv/bin/python benchmarks/token_logprobs.py --device cuda --rows 4 --tokens 256 --vocab 152064

Writes `benchmarks/results/token_logprobs-<device>.json` (or `--out`) and prints a table naming the machine.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from _common import RESULTS, machine_info, print_table, write_json
from torch import Tensor

from lora_rl_core.algorithm import token_logprobs_and_entropy
from lora_rl_core.runtime import cpu_description


def trl_formula(logits_BTV: Tensor, ids_BT: Tensor, temperature: float) -> tuple[Tensor, Tensor]:
    """The baseline: each row copied to float32 (and divided by the temperature), TRL's `logit_y - logsumexp`
    under autograd, and the entropy from a `log_softmax` of the detached logits."""
    logits = logits_BTV.float()
    if temperature != 1.0:
        logits = logits / temperature
    lse_BT = torch.stack([torch.logsumexp(row.float(), dim=-1) for row in logits])
    logprobs_BT = logits.gather(-1, ids_BT.unsqueeze(-1)).squeeze(-1).float() - lse_BT
    with torch.no_grad():  # as the trainer's `entropy_from_logits` did: one log_softmax per row
        logp_rows = [torch.log_softmax(r, -1) for r in logits.detach()]
        entropy_BT = torch.stack([-(logp.exp() * logp).sum(-1) for logp in logp_rows])
    return logprobs_BT, entropy_BT


def ours(logits_BTV: Tensor, ids_BT: Tensor, temperature: float) -> tuple[Tensor, Tensor]:
    return token_logprobs_and_entropy(logits_BTV, ids_BT, temperature=temperature)


def time_once(
    fn: Callable[[Tensor, Tensor, float], tuple[Tensor, Tensor]],
    logits: Tensor,
    ids: Tensor,
    weights: Tensor,
    temperature: float,
) -> tuple[float, float, Tensor]:
    """(forward seconds, backward seconds, the logits' gradient) of one call of `fn`."""
    leaf = logits.detach().requires_grad_(True)
    sync = torch.cuda.synchronize if leaf.is_cuda else (lambda: None)
    sync()
    start = time.perf_counter()
    logprobs_BT, _ = fn(leaf, ids, temperature)
    sync()
    mid = time.perf_counter()
    (logprobs_BT * weights).sum().backward()
    sync()
    assert leaf.grad is not None
    return mid - start, time.perf_counter() - mid, leaf.grad


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", type=Path, help="default: benchmarks/results/token_logprobs-<device>.json")
    args = parser.parse_args()
    out = args.out or RESULTS / f"token_logprobs-{args.device.split(':')[0]}.json"

    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(args.rows, args.tokens, args.vocab, generator=gen) * 3).to(args.device, torch.bfloat16)
    ids = torch.randint(0, args.vocab, (args.rows, args.tokens), generator=gen).to(args.device)
    weights = torch.randn(args.rows, args.tokens, generator=gen).to(args.device)
    arms = {"trl-formula": trl_formula, "token_logprobs": ours}
    times: dict[str, dict[str, list[float]]] = {name: {"forward": [], "backward": []} for name in arms}
    grads: dict[str, Tensor] = {}
    for i in range(args.repeats + 1):  # the first round warms up and is not counted
        for name in arms if i % 2 == 0 else reversed(list(arms)):
            fwd, bwd, grads[name] = time_once(arms[name], logits, ids, weights, args.temperature)
            if i:
                times[name]["forward"].append(fwd)
                times[name]["backward"].append(bwd)
    max_grad_diff = (grads["token_logprobs"].float() - grads["trl-formula"].float()).abs().max().item()
    summary = {
        name: {part: statistics.median(v) for part, v in t.items()}
        | {"total": statistics.median([f + b for f, b in zip(t["forward"], t["backward"], strict=True)])}
        for name, t in times.items()
    }
    rows = [[name, f"{s['forward']:.3f}", f"{s['backward']:.3f}", f"{s['total']:.3f}"] for name, s in summary.items()]
    machine = machine_info(args.device) | {"cpu": cpu_description(), "threads": torch.get_num_threads()}
    print_table(
        f"logprobs + entropy of [{args.rows}, {args.tokens}, {args.vocab}] bf16 logits, forward and backward, "
        f"median of {args.repeats} (s), {machine['device_name'] if args.device != 'cpu' else machine['cpu']}",
        ["arm", "forward", "backward", "total"],
        rows,
    )
    speedup = summary["trl-formula"]["total"] / summary["token_logprobs"]["total"]
    print(f"token_logprobs: {speedup:.2f}x the baseline; largest gradient difference {max_grad_diff:.2e}")
    write_json(
        {
            "benchmark": "token_logprobs",
            "shape": {"rows": args.rows, "tokens": args.tokens, "vocab": args.vocab, "dtype": "bfloat16"},
            "temperature": args.temperature,
            "repeats": args.repeats,
            "seconds": times,
            "median_seconds": summary,
            "speedup": speedup,
            "max_grad_abs_diff": max_grad_diff,
            "machine": machine,
        },
        out,
    )


if __name__ == "__main__":
    main()
