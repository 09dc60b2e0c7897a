"""A policy (base model or a named adapter) on held-out problems, graded by the evaluation's fixed grader
(`lora_rl_core.rewards.grader`: strict and flexible answer checks against the gold answers, or the function
`eval.grader` names), never by the run's training reward unless it is named as the grader.

Greedy accuracy always, per grader metric: one greedy completion per problem. With
`eval.samples_per_prompt: n > 1`, also `n` samples per problem at `eval.temperature`: pass@k for k = 1, 2, 4,
... n with the unbiased estimator of Chen et al. 2021 ("Evaluating Large Language Models Trained on Code",
eq. 1: `1 - C(n-c, k) / C(n, k)` per problem, averaged), and mean@n, the mean success rate over the samples.
An aborted completion counts as a failure.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence
from typing import Any

from transformers import PreTrainedTokenizerBase

from lora_rl_core.config import EvalConfig, RunConfig
from lora_rl_core.data import Problem, PromptStyle, stable_seed
from lora_rl_core.engines import Completion, GenerationRequest, RolloutEngine, SamplingParams
from lora_rl_core.rewards import Grader, RewardBatch
from lora_rl_core.rewards.score import trim_stops

SAMPLES_SHOWN = 3
"""Greedy completions an evaluation keeps (of its first problems) for the report."""
PREVIEW_PROBLEMS = 4
"""Held-out problems of `preview_run_policy`: a few greedy completions when the run does not evaluate."""


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
    engine: RolloutEngine,
    tokenizer: PreTrainedTokenizerBase,
    problems: Sequence[Problem],
    grader: Grader,
    *,
    adapter: str | None,
    prompt: PromptStyle,
    max_new_tokens: int,
    settings: EvalConfig,
    seed: int = 0,
    shown: int = SAMPLES_SHOWN,
    stop: Sequence[str] = (),
    stop_token_ids: Sequence[int] = (),
) -> dict[str, Any]:
    """Greedy accuracy of `adapter` (None = the base model) under each of the grader's metrics, and pass@k /
    mean@n when `settings.samples_per_prompt` > 1. Greedy and sampled completions end at the `stop` strings and
    `stop_token_ids` (`SamplingParams`) as well as at EOS and `max_new_tokens`.

    Returns:
        {"accuracy": greedy accuracy under the grader's headline metric (its first), "metrics": the grader's
        metric names, "accuracy/<metric>" for each, "n": problems, "adapter", "aborted": greedy completions
        aborted (counted as failures), "truncated": greedy completions cut at `max_new_tokens`,
        "truncated_fraction": their share, "mean_completion_tokens", "seconds", "samples": the first `shown`
        (question, completion, gold, verdict per metric, finish_reason, tokens)}; with samples also
        "samples_per_prompt", "temperature", and "pass@k/<metric>", "mean@n/<metric>" for each metric.

    Raises:
        RewardError: the grader failed (a row without a gold answer, or the named function failed).
    """
    start = time.perf_counter()
    ids = [prompt.render(tokenizer, p) for p in problems]
    greedy = SamplingParams(
        max_new_tokens=max_new_tokens, temperature=0.0, stop=tuple(stop), stop_token_ids=tuple(stop_token_ids)
    )
    completions = engine.generate([GenerationRequest(i, adapter, greedy) for i in ids], inline=True)
    texts, passed = _grade(tokenizer, grader, list(problems), completions, stop)
    headline = grader.metrics[0]
    result: dict[str, Any] = {
        "accuracy": _rate(passed[headline]),
        "metrics": list(grader.metrics),
        **{f"accuracy/{m}": _rate(passed[m]) for m in grader.metrics},
        "n": len(problems),
        "adapter": adapter,
        "aborted": sum(c.finish_reason == "abort" for c in completions),  # counted as failures
        "truncated": sum(c.finish_reason == "length" for c in completions),
        "truncated_fraction": sum(c.finish_reason == "length" for c in completions) / max(1, len(completions)),
        "mean_completion_tokens": sum(len(c.completion_ids) for c in completions) / max(1, len(completions)),
        "samples": [
            {
                "question": p.question,
                "completion": t,
                "gold": p.answer,
                **{m: passed[m][i] for m in grader.metrics},
                "finish_reason": c.finish_reason,
                "tokens": len(c.completion_ids),
            }
            for i, (p, t, c) in enumerate(zip(problems[:shown], texts, completions, strict=False))
        ],
    }
    if settings.samples_per_prompt > 1:
        sampled = dataclasses.replace(greedy, temperature=settings.temperature, seed=seed)
        result.update(_sampled(engine, tokenizer, problems, grader, ids, adapter, sampled, settings))
    result["seconds"] = time.perf_counter() - start
    return result


def _rate(passed: list[bool]) -> float:
    return sum(passed) / max(1, len(passed))


def evaluate_run_policy(
    engine: RolloutEngine,
    tokenizer: PreTrainedTokenizerBase,
    problems: Sequence[Problem],
    grader: Grader,
    cfg: RunConfig,
    *,
    adapter: str | None,
    prompt: PromptStyle | None = None,
    settings: EvalConfig | None = None,
    shown: int = SAMPLES_SHOWN,
) -> dict[str, Any]:
    """`evaluate_policy` with a run config's settings: its prompt style (`prompt`, default
    `PromptStyle.of(cfg.data, cfg.rollout)`: `rollout.system_prompt`, the data source's instruction),
    `run.eval_max_new_tokens` (else `rollout.max_new_tokens`), `rollout.stop` and `rollout.stop_token_ids`, the
    `eval` section (`settings`, default `cfg.eval`) and a seed from `run.seed`. What the flow, `lora-rl eval`
    and the benchmarks evaluate with.

    Raises:
        RewardError: the grader failed (naming the rows).
    """
    return evaluate_policy(
        engine,
        tokenizer,
        problems,
        grader,
        adapter=adapter,
        prompt=prompt or PromptStyle.of(cfg.data, cfg.rollout),
        max_new_tokens=cfg.run.eval_max_new_tokens or cfg.rollout.max_new_tokens,
        settings=settings or cfg.eval,
        seed=stable_seed(cfg.run.seed, "eval"),
        shown=shown,
        stop=cfg.rollout.stop,
        stop_token_ids=cfg.rollout.stop_token_ids,
    )


def preview_run_policy(
    engine: RolloutEngine,
    tokenizer: PreTrainedTokenizerBase,
    problems: Sequence[Problem],
    grader: Grader,
    cfg: RunConfig,
    *,
    adapter: str | None,
    prompt: PromptStyle | None = None,
    n: int = PREVIEW_PROBLEMS,
) -> dict[str, Any]:
    """What `adapter` writes on the first `n` of `problems`: `evaluate_run_policy` on that subset, greedy only
    (whatever `eval.samples_per_prompt` says), every completion in "samples". For the report of a run that does
    not evaluate (`run.eval_before_after: false`); its accuracy over `n` problems is no evaluation.

    Raises:
        RewardError: the grader failed (naming the rows).
    """
    greedy = cfg.eval.model_copy(update={"samples_per_prompt": 1})
    return evaluate_run_policy(
        engine, tokenizer, problems[:n], grader, cfg, adapter=adapter, prompt=prompt, settings=greedy, shown=n
    )


def _sampled(
    engine: RolloutEngine,
    tokenizer: PreTrainedTokenizerBase,
    problems: Sequence[Problem],
    grader: Grader,
    ids: list[list[int]],
    adapter: str | None,
    params: SamplingParams,
    settings: EvalConfig,
) -> dict[str, Any]:
    """pass@k for k = 1, 2, 4, ... n and mean@n from `n` samples per problem drawn with `params`, per grader
    metric (`pass@k/<metric>`, `mean@n/<metric>`)."""
    n = settings.samples_per_prompt
    requests = [GenerationRequest(i, adapter, params) for i in ids for _ in range(n)]
    completions = engine.generate(requests, inline=True)
    repeated = [p for p in problems for _ in range(n)]
    _, passed = _grade(tokenizer, grader, repeated, completions, params.stop)
    ks = sorted({*(2**j for j in range(n.bit_length()) if 2**j <= n), n})
    out: dict[str, Any] = {"samples_per_prompt": n, "temperature": settings.temperature}
    for metric in grader.metrics:
        successes = [sum(passed[metric][i * n : (i + 1) * n]) for i in range(len(problems))]
        values = {f"pass@{k}": sum(pass_at_k(n, c, k) for c in successes) / max(1, len(problems)) for k in ks}
        values[f"mean@{n}"] = sum(successes) / max(1, n * len(problems))
        out.update({f"{key}/{metric}": value for key, value in values.items()})
    return out


def _grade(
    tokenizer: PreTrainedTokenizerBase,
    grader: Grader,
    problems: list[Problem],
    completions: list[Completion],
    stops: Sequence[str],
) -> tuple[list[str], dict[str, list[bool]]]:
    """Completion texts (without the stop string that ended one, `trim_stops`), and per grader metric whether
    each succeeded (an aborted completion never does)."""
    texts = tokenizer.batch_decode([c.completion_ids for c in completions], skip_special_tokens=True)
    texts = trim_stops(texts, [c.finish_reason for c in completions], stops)
    verdicts = grader.grade(
        RewardBatch.from_problems(
            problems, texts, [c.completion_ids for c in completions], [c.finish_reason for c in completions]
        )
    )
    passed = {
        metric: [ok and c.finish_reason != "abort" for ok, c in zip(values, completions, strict=True)]
        for metric, values in verdicts.items()
    }
    return texts, passed
