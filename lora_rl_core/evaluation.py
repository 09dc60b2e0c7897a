"""A policy (base model or a named adapter) on held-out problems, scored by the run's reward functions.

Greedy accuracy always: one greedy completion per problem, a success when its summed reward reaches
`eval.pass_threshold`. With `eval.samples_per_prompt: n > 1`, also `n` samples per problem at
`eval.temperature`: pass@k for k = 1, 2, 4, ... n with the unbiased estimator of Chen et al. 2021 ("Evaluating
Large Language Models Trained on Code", eq. 1: `1 - C(n-c, k) / C(n, k)` per problem, averaged), and mean@n,
the mean success rate over the samples.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from transformers import PreTrainedTokenizerBase

from lora_rl_core.config import EvalConfig, RunConfig
from lora_rl_core.data import Problem, prompt_instruction, render_prompt, stable_seed
from lora_rl_core.engines import Completion, GenerationRequest, InferenceEngine, SamplingParams
from lora_rl_core.rewards import RewardBatch, RewardSet, ScoredRewards


@dataclass(frozen=True)
class PromptStyle:
    """How problems become prompts: the system prompt (None: the chat template's) and the instruction."""

    system_prompt: str | None
    instruction: str


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of one problem with `c` successes among `n` samples (Chen et al. 2021, eq. 1):
    `1 - C(n - c, k) / C(n, k)`, computed as a product for numerical stability.

    Raises:
        ValueError: not `0 <= c <= n` and `1 <= k <= n`.
    """
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def evaluate_policy(
    engine: InferenceEngine,
    tokenizer: PreTrainedTokenizerBase,
    problems: Sequence[Problem],
    rewards: RewardSet,
    *,
    adapter: str | None,
    prompt: PromptStyle,
    max_new_tokens: int,
    settings: EvalConfig,
    seed: int = 0,
) -> dict[str, Any]:
    """Greedy accuracy of `adapter` (None = the base model), and pass@k / mean@n when
    `settings.samples_per_prompt` > 1.

    Returns:
        {"accuracy": greedy successes / problems, "n": problems, "adapter", "aborted": greedy completions
        aborted (counted as failures), "mean_completion_tokens", "reward_mean": greedy, "rewards/<name>/mean":
        greedy, per reward function, "seconds", "samples": the first 3 (question, completion, gold)}; with
        samples also "samples_per_prompt", "temperature", "pass@k" for each k, "mean@n".

    Raises:
        RewardError: a reward function failed (naming it and the rows).
    """
    start = time.perf_counter()
    ids = [
        render_prompt(tokenizer, p, system_prompt=prompt.system_prompt, instruction=prompt.instruction)
        for p in problems
    ]
    greedy = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0)
    completions = engine.generate([GenerationRequest(i, adapter, greedy) for i in ids], inline=True)
    texts, passed, scored = _score(tokenizer, rewards, list(problems), completions, settings.pass_threshold)
    result: dict[str, Any] = {
        "accuracy": sum(passed) / max(1, len(problems)),
        "n": len(problems),
        "adapter": adapter,
        "aborted": sum(c.finish_reason == "abort" for c in completions),  # counted as failures
        "mean_completion_tokens": sum(len(c.completion_ids) for c in completions) / max(1, len(completions)),
        "reward_mean": sum(scored.totals) / max(1, len(scored.totals)),
        **{f"rewards/{name}/mean": mean for name, mean in scored.term_means().items()},
        "samples": [
            {"question": p.question, "completion": t, "gold": p.answer}
            for p, t in zip(problems[:3], texts, strict=False)
        ],
    }
    if settings.samples_per_prompt > 1:
        result.update(_sampled(engine, tokenizer, problems, rewards, ids, adapter, max_new_tokens, settings, seed))
    result["seconds"] = time.perf_counter() - start
    return result


def evaluate_run_policy(
    engine: InferenceEngine,
    tokenizer: PreTrainedTokenizerBase,
    problems: Sequence[Problem],
    rewards: RewardSet,
    cfg: RunConfig,
    *,
    adapter: str | None,
) -> dict[str, Any]:
    """`evaluate_policy` with a run config's settings: its prompt style (`rollout.system_prompt`, the data
    source's instruction), `run.eval_max_new_tokens` (else `rollout.max_new_tokens`), the `eval` section and a
    seed from `run.seed`. What the flow, `lora-rl eval` and the benchmarks evaluate with.

    Raises:
        RewardError: a reward function failed (naming it and the rows).
    """
    return evaluate_policy(
        engine,
        tokenizer,
        problems,
        rewards,
        adapter=adapter,
        prompt=PromptStyle(cfg.rollout.system_prompt, prompt_instruction(cfg.data, cfg.rollout)),
        max_new_tokens=cfg.run.eval_max_new_tokens or cfg.rollout.max_new_tokens,
        settings=cfg.eval,
        seed=stable_seed(cfg.run.seed, "eval"),
    )


def _sampled(
    engine: InferenceEngine,
    tokenizer: PreTrainedTokenizerBase,
    problems: Sequence[Problem],
    rewards: RewardSet,
    ids: list[list[int]],
    adapter: str | None,
    max_new_tokens: int,
    settings: EvalConfig,
    seed: int,
) -> dict[str, Any]:
    """pass@k for k = 1, 2, 4, ... n and mean@n from `n` samples per problem."""
    n = settings.samples_per_prompt
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=settings.temperature, seed=seed)
    requests = [GenerationRequest(i, adapter, params) for i in ids for _ in range(n)]
    completions = engine.generate(requests, inline=True)
    repeated = [p for p in problems for _ in range(n)]
    _, passed, _ = _score(tokenizer, rewards, repeated, completions, settings.pass_threshold)
    successes = [sum(passed[i * n : (i + 1) * n]) for i in range(len(problems))]
    ks = sorted({*(2**j for j in range(n.bit_length()) if 2**j <= n), n})
    out: dict[str, Any] = {"samples_per_prompt": n, "temperature": settings.temperature}
    for k in ks:
        out[f"pass@{k}"] = sum(pass_at_k(n, c, k) for c in successes) / max(1, len(problems))
    out[f"mean@{n}"] = sum(successes) / max(1, n * len(problems))
    return out


def _score(
    tokenizer: PreTrainedTokenizerBase,
    rewards: RewardSet,
    problems: list[Problem],
    completions: list[Completion],
    threshold: float,
) -> tuple[list[str], list[bool], ScoredRewards]:
    """Completion texts, whether each succeeded (summed reward >= `threshold`, not skipped, not aborted), and
    the reward functions' values."""
    texts = tokenizer.batch_decode([c.completion_ids for c in completions], skip_special_tokens=True)
    scored = rewards.score(RewardBatch.from_problems(problems, texts, [c.completion_ids for c in completions]))
    passed = [
        not skip and c.finish_reason != "abort" and total >= threshold
        for total, skip, c in zip(scored.totals, scored.skipped, completions, strict=True)
    ]
    return texts, passed, scored
