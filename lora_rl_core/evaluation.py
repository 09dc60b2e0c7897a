"""Greedy accuracy of a policy (base model or a named adapter) on held-out problems."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from transformers import PreTrainedTokenizerBase

from lora_rl_core.config import RolloutConfig
from lora_rl_core.data import Problem, render_prompt
from lora_rl_core.engines import GenerationRequest, InferenceEngine, SamplingParams
from lora_rl_core.rewards import math_reward


def evaluate_accuracy(
    engine: InferenceEngine,
    tokenizer: PreTrainedTokenizerBase,
    problems: Sequence[Problem],
    *,
    adapter: str | None,
    rollout: RolloutConfig,
    max_new_tokens: int,
) -> dict[str, Any]:
    """Greedy-decode every problem with `adapter` (None = base model) and score with the math reward.

    Returns:
        {"accuracy": fraction correct in [0, 1], "n": problems, "adapter": name or None,
         "aborted": sum(c.finish_reason == "abort" for c in completions),  # counted as wrong
        "mean_completion_tokens": float, "seconds": wall time, "samples": first 3 (question, completion, gold)}.
    """
    start = time.perf_counter()
    greedy = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0)
    requests = [
        GenerationRequest(
            render_prompt(tokenizer, p, system_prompt=rollout.system_prompt, instruction=rollout.instruction),
            adapter,
            greedy,
        )
        for p in problems
    ]
    completions = engine.generate(requests, inline=True)  # on this thread, as the trainer computes
    texts = tokenizer.batch_decode([c.completion_ids for c in completions], skip_special_tokens=True)
    correct = [math_reward(t, p.answer) for t, p in zip(texts, problems, strict=True)]
    return {
        "accuracy": sum(correct) / max(1, len(problems)),
        "n": len(problems),
        "adapter": adapter,
        "aborted": sum(c.finish_reason == "abort" for c in completions),  # counted as wrong
        "mean_completion_tokens": sum(len(c.completion_ids) for c in completions) / max(1, len(completions)),
        "seconds": time.perf_counter() - start,
        "samples": [
            {"question": p.question, "completion": t, "gold": p.answer}
            for p, t in zip(problems[:3], texts, strict=False)
        ],
    }
