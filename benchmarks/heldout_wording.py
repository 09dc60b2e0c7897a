"""Does a trained adapter hold up when the prompt is worded differently? (issue 31)

The base model and the adapter, in one run, on the config's held-out problems under several wordings, graded
by the fixed answer grader (`lora_rl_core.rewards.grader.AnswerGrader`: strict, the answer after `####` or in
`\\boxed{}`; flexible, else the last number), never by the run's training reward:

* `trained`: the prompt as the run trained on it (`rollout.instruction`, the data source's question);
* `reworded`: another instruction asking for the same answer format, and arithmetic questions
  (`What is 76 + 57?`) asked as `Calculate 76 + 57.`;
* `no-instruction`: the question alone (only the flexible grade is meaningful: nothing asks for `####`).

Usage (CPU, the default job's adapter in the default store)::

    PYTHONPATH=. .venv/bin/python benchmarks/heldout_wording.py -c configs/smollm2-arith-grpo.yaml \\
        --adapter RUN@latest --out benchmarks/results/learning/make_run_wording.json

`--adapter` is `RUN@VERSION` in the config's store, or a PEFT folder (`lora-rl adapters pull`). `--set` takes
config overrides (`model.name_or_path=...`, `store.uri=...`). Prints a table and writes JSON with the machine.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import _common
from _common import machine_info, print_table, write_json

INSTRUCTION_REWORDED = "State the result after ####."
_WHAT_IS = re.compile(r"^What is (.+)\?$")


def reworded_question(question: str) -> str:
    """`What is 76 + 57?` -> `Calculate 76 + 57.`; any other question unchanged."""
    found = _WHAT_IS.match(question.strip())
    return f"Calculate {found.group(1)}." if found else question


def wordings(trained_instruction: str) -> dict[str, tuple[str, Any]]:
    """`{name: (instruction, question rewrite or None)}`."""
    return {
        "trained": (trained_instruction, None),
        "reworded": (INSTRUCTION_REWORDED, reworded_question),
        "no-instruction": ("", None),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-c", "--config", required=True)
    parser.add_argument("--adapter", required=True, help="RUN@VERSION in the config's store, or a PEFT folder")
    parser.add_argument("--set", nargs="*", default=[], help="config overrides, key=value")
    parser.add_argument("--out", type=Path, default=None, help="JSON path (default: print only)")
    parser.add_argument(
        "--max-new-tokens", type=int, default=None, help="token cap (default: run.eval_max_new_tokens, else rollout's)"
    )
    args = parser.parse_args(argv)

    from lora_rl_core.config import load_config
    from lora_rl_core.data import Problem, PromptStyle, load_problems, prompt_instruction
    from lora_rl_core.engines import EngineInputs
    from lora_rl_core.engines.registry import build_engine
    from lora_rl_core.evaluation import evaluate_policy
    from lora_rl_core.models import load_tokenizer, resolve_device
    from lora_rl_core.rewards import AnswerGrader
    from lora_rl_core.runtime import configure_threads

    cfg = load_config(args.config, args.set)
    configure_threads()
    problems = load_problems(cfg.data, "test", cfg.run.seed)
    tokenizer = load_tokenizer(cfg.model)
    grader = AnswerGrader(verify_timeout_s=cfg.reward.verify_timeout_s)
    store = cfg.store.build()
    built = build_engine(EngineInputs(cfg.engine, cfg.model, cfg.lora, store, tokenizer=tokenizer))
    engine = built.engine
    results: dict[str, dict[str, Any]] = {}
    try:
        folder = Path(args.adapter)
        if folder.is_dir():
            name, uri = "heldout-wording-adapter", str(folder.resolve())
        else:
            ref = store.resolve(args.adapter)
            name, uri = ref.name, ref.uri
        engine.load_adapter(name, path=uri)
        for wording, (instruction, rewrite) in wordings(prompt_instruction(cfg.data, cfg.rollout)).items():
            asked: list[Problem] = (
                [replace(p, prompt=rewrite(p.prompt)) if isinstance(p.prompt, str) else p for p in problems]
                if rewrite
                else list(problems)
            )
            style = PromptStyle(cfg.rollout.system_prompt, instruction)
            for policy, adapter in (("base", None), ("adapter", name)):
                results[f"{wording}/{policy}"] = evaluate_policy(
                    engine,
                    tokenizer,
                    asked,
                    grader,
                    adapter=adapter,
                    prompt=style,
                    max_new_tokens=args.max_new_tokens or cfg.run.eval_max_new_tokens or cfg.rollout.max_new_tokens,
                    settings=cfg.eval.model_copy(update={"samples_per_prompt": 1}),
                )
            results[f"{wording}/example"] = {"question": asked[0].question, "instruction": instruction}
    finally:
        built.close()
        grader.close()

    rows = []
    for wording in wordings(""):
        base, trained = results[f"{wording}/base"], results[f"{wording}/adapter"]
        for metric in ("strict", "flexible"):
            b, a = 100 * base[f"accuracy/{metric}"], 100 * trained[f"accuracy/{metric}"]
            rows.append([wording, metric, f"{b:.1f}%", f"{a:.1f}%", f"{a - b:+.1f}", str(trained["truncated"])])
    print_table(
        f"{cfg.data.source} held-out ({len(problems)} problems), greedy, fixed grader: base vs {args.adapter}",
        ["wording", "grade", "base", "adapter", "points", "adapter cut"],
        rows,
    )
    for wording in wordings(""):
        for sample in results[f"{wording}/adapter"]["samples"]:
            print(f"[{wording}] Q: {sample['question']!r}\n  A: {sample['completion']!r} (gold {sample['gold']})")
    if args.out:
        record = {"config": args.config, "overrides": args.set, "adapter": args.adapter,
                  "max_new_tokens": args.max_new_tokens,
                  "machine": machine_info(str(resolve_device(cfg.model.device))), "results": results}  # fmt: skip
        write_json(record, args.out)
    return 0


if __name__ == "__main__":
    assert _common.ROOT  # the import put the checkout on sys.path
    sys.exit(main())
