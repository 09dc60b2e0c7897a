"""Run report: `report.md` and `reward_curve.png` in the run's output folder."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from lora_rl_core.config import RunConfig
from lora_rl_core.progress import cut_change, format_accuracy, format_sampled, lora_compute_part
from lora_rl_core.rewards.answers import ANSWER_FORMATS

_TABLE_COLUMNS = (
    "step",
    "reward_mean",
    "accuracy",
    "groups_with_signal",
    "clip_fraction",
    "kl",
    "entropy",
    "grad_norm",
    "completion_length",
    "truncated_fraction",
    "ended_fraction",
    "finish_reasons",
    "rollout_seconds",
    "train_seconds",
    "sync_seconds",
    "step_seconds",
    "version_lag",
    "is_weight_mean",
    "is_masked_fraction",
    "value_loss",
    "explained_variance",
    "value_clip_fraction",
    "value_mean",
)


def plot_reward_curve(history: list[dict[str, Any]], path: Path) -> Path:
    """Plot reward mean (±std) and batch accuracy per step to a PNG at `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [h["step"] for h in history]
    mean = [h.get("reward_mean", 0.0) for h in history]
    std = [h.get("reward_std", 0.0) for h in history]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, mean, label="reward mean", color="tab:blue")
    ax.fill_between(
        steps,
        [m - s for m, s in zip(mean, std, strict=True)],
        [m + s for m, s in zip(mean, std, strict=True)],
        alpha=0.2,
        color="tab:blue",
    )
    ax.plot(
        steps,
        [h.get("accuracy", 0.0) for h in history],
        label="rollout accuracy",
        color="tab:green",
        linestyle="--",
        marker=".",
    )
    ax.set_xlabel("step")
    ax.set_ylabel("reward")
    ax.set_title("reward per training step")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def step_table(history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """History rows reduced to the report's columns (each reward term's mean, `rewards/<name>/mean`, after
    `reward_mean`), floats rounded to 4 places."""
    terms = sorted({k for h in history for k in h if k.startswith("rewards/")})
    at = _TABLE_COLUMNS.index("reward_mean") + 1
    columns = [*_TABLE_COLUMNS[:at], *terms, *_TABLE_COLUMNS[at:]]
    return [{k: _cell(h.get(k)) for k in columns} for h in history]


def _cell(value: Any) -> Any:
    """A table cell: floats rounded to 4 places, a histogram `{lag: n}` as `0:12 1:4` (finish reasons as
    `eos:40 stop:0 length:24`)."""
    if isinstance(value, float):
        return round(value, 4)
    if isinstance(value, dict):
        return " ".join(f"{k}:{v}" for k, v in value.items())
    return value


def _markdown_table(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "(no steps)\n"
    head = list(rows[0])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(str(r[k]) for k in head) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def summary_markdown(run_id: str, cfg: RunConfig, summary: dict[str, Any]) -> str:
    """The report's headline section: accuracies, timing, throughput, settings."""
    base, final = summary.get("base_eval") or {}, summary.get("final_eval") or {}
    graded = base or final or summary.get("final_preview") or {}  # not evaluated: the preview's grader
    acc = lambda e: f"{format_accuracy(e)} ({e['n']} problems){_sampled(e)}" if e else "not measured"  # noqa: E731
    return (
        f"# lora-rl run `{run_id}`\n\n"
        f"- model: `{cfg.model.name_or_path}`; LoRA rank {cfg.lora.rank}, alpha {cfg.lora.alpha}, "
        f"targets {cfg.lora.target_modules}\n"
        f"- data: {cfg.data.source}; {cfg.rollout.prompts_per_step} prompts x {cfg.rollout.group_size} samples, "
        f"{cfg.rollout.max_new_tokens} new tokens; {cfg.algorithm.advantage}, lr {cfg.trainer.lr}\n"
        f"{_runtime_line(summary.get('runtime'))}"
        f"- graded by {_grader(graded)}, apart from the training reward\n"
        f"- greedy accuracy before training: {acc(base)}\n"
        f"- greedy accuracy after training: {acc(final)} (adapter `{summary.get('final_adapter')}`)\n"
        f"- greedy completions cut at the token limit, before -> after training: {cut_change(summary)}\n"
        f"- steps: {summary.get('steps')}; wall time {summary.get('wall_seconds', 0):.0f} s; "
        f"{summary.get('seconds_per_step', 0):.1f} s/step; "
        f"{summary.get('completions_per_second', 0):.2f} completions/s\n"
        f"- adapters: `{summary.get('store_uri')}/{run_id}/adapters/`\n" + _critic_line(summary.get("critic"))
    )


def _critic_line(critic: dict[str, Any] | None) -> str:
    """What PPO's critic cost (`run_summary`'s `critic`), or nothing without one."""
    if not critic:
        return ""
    return (
        f"- critic (PPO): {100 * critic['train_share']:.0f} % of the train phase "
        f"({critic['seconds_per_step']:.2f} s/step), {critic['state_bytes'] / 2**20:.1f} MiB of float32 state "
        f"(adapter, head, gradients, AdamW); final explained variance {critic['explained_variance']:.2f}\n"
    )


def artifact_markdown(run_id: str, cfg: RunConfig, summary: dict[str, Any]) -> str:
    """The run's summary for the Prefect artifact: `summary_markdown` and the rollout completions of the first,
    middle and last steps (`summary["step_samples"]`)."""
    return summary_markdown(run_id, cfg, summary) + _step_samples_section(summary)


def _step_samples_section(summary: dict[str, Any]) -> str:
    return "\n## Rollout completions (first, middle and last step)\n" + samples_markdown(
        summary.get("step_samples") or []
    )


def _grader(evaluation: dict[str, Any]) -> str:
    metrics = evaluation.get("metrics") or []
    if tuple(metrics) == ANSWER_FORMATS:
        return "the answer checker (strict: after `####` or in `\\boxed{}`; flexible: else the last number)"
    return f"`{metrics[0]}` (eval.grader)" if metrics else "the run's reward (an older run)"


def samples_markdown(samples: list[dict[str, Any]]) -> str:
    """Sample completions of the run's steps (`lora_rl_core.run.samples.step_samples`) as markdown: per step, each
    with its prompt, the completion (`cut` where it hit the token limit), the gold answer and every reward term."""
    if not samples:
        return "(none)\n"
    lines = []
    for step in sorted({s["step"] for s in samples}):
        lines.append(f"\n### Step {step}\n")
        for s in (s for s in samples if s["step"] == step):
            terms = " ".join(f"{k} {_value(v)}" for k, v in s["rewards"].items())
            lines.append(
                f"- **Q:** {_one_line(s['prompt'])} (gold {s['gold']})  \n"
                f"  **A:** `{s['completion']!r}` ({s['tokens']} tokens{_finish(s['finish_reason'])})  \n"
                f"  reward {s['reward']:.3f}: {terms}\n"
            )
    return "".join(lines)


_FINISH = {
    "eos": "ended by end-of-sequence",
    "stop": "ended by a stop sequence",
    "length": "cut at the token limit",
    "abort": "aborted",
}
"""How a completion ended (its `finish_reason`), as a sample in the report says it."""


def _finish(reason: str) -> str:
    return f", {_FINISH.get(reason, reason)}"


def greedy_markdown(summary: dict[str, Any]) -> str:
    """The greedy held-out completions of the trained adapter: the final evaluation's samples, or where the run
    did not evaluate the few of `summary["final_preview"]` (`lora_rl_core.run.samples.heldout_preview`); each
    with its question, gold answer, verdict per grader metric, length and how it ended."""
    final = summary.get("final_eval")
    shown = final or summary.get("final_preview") or {}
    preview = not final and shown
    note = f"Not evaluated (`run.eval_before_after: false`): the first {shown['n']} problems.\n\n" if preview else ""
    metrics = shown.get("metrics") or []
    lines = "".join(_greedy_sample(s, metrics) for s in shown.get("samples", []))
    return note + (lines or "(none)\n")


def _greedy_sample(s: dict[str, Any], metrics: list[str]) -> str:
    verdicts = "".join(f"; {m} {'right' if s.get(m) else 'wrong'}" for m in metrics)
    length = f"; {s['tokens']} tokens{_finish(s['finish_reason'])}" if "tokens" in s else ""  # older: not kept
    answer = f"`{s['completion']!r}` (gold {s['gold']}{verdicts}{length})"
    return f"- **Q:** {_one_line(s['question'])}  \n  **A:** {answer}\n"


def _value(v: float | None) -> str:
    return "none" if v is None else f"{v:g}"


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _sampled(evaluation: dict[str, Any]) -> str:
    """`; pass@1/strict 40.0% ... (4 samples at temperature 1.0)` when sampled, else ``."""
    values = format_sampled(evaluation)
    if not values:
        return ""
    return f"; {values} ({evaluation['samples_per_prompt']} samples at temperature {evaluation['temperature']:g})"


def _runtime_line(runtime: dict[str, Any] | None) -> str:
    if not runtime:
        return ""
    return (
        f"- compute: {runtime['device']}, {runtime['dtype']} ({runtime['dtype_reason']}); "
        + lora_compute_part(runtime)
        + f"{runtime['cpu_threads']} CPU threads\n"
    )


def run_summary(
    run_id: str,
    history: list[dict[str, Any]],
    base_eval: dict[str, Any] | None,
    final_eval: dict[str, Any] | None,
    final_adapter: str,
    wall_seconds: float,
    store_uri: str,
    runtime: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The run's headline numbers from its step metrics and evaluations.

    Returns:
        run_id, final_adapter, steps, wall_seconds, seconds_per_step (mean step wall time, s),
        completions_per_second (completions / rollout seconds), base_accuracy / final_accuracy
        (fractions, None when not measured), base_truncated_fraction / final_truncated_fraction (the share of
        greedy held-out completions cut at the token limit; None when not measured or in an evaluation older
        than it), base_eval, final_eval, store_uri, runtime (device, dtype and why, CPU threads:
        `lora_rl_core.run.runtime_info`), critic (PPO only, else None: `train_share` of the train phase's
        seconds its passes took, `seconds_per_step`, `state_bytes`, the last step's `explained_variance`).
    """
    steps = len(history)
    critic_steps = [h for h in history if "critic_seconds" in h]
    critic = None
    if critic_steps:
        seconds = sum(h["critic_seconds"] for h in critic_steps)
        critic = {
            "train_share": seconds / max(1e-9, sum(h["train_seconds"] for h in critic_steps)),
            "seconds_per_step": seconds / len(critic_steps),
            "state_bytes": critic_steps[-1]["critic_state_bytes"],
            "explained_variance": critic_steps[-1].get("explained_variance", 0.0),
        }
    rollout_seconds = sum(h["rollout_seconds"] for h in history)
    return {
        "run_id": run_id,
        "final_adapter": final_adapter,
        "steps": steps,
        "wall_seconds": wall_seconds,
        "seconds_per_step": sum(h["step_seconds"] for h in history) / max(1, steps),
        "completions_per_second": sum(h["completions"] for h in history) / max(rollout_seconds, 1e-9),
        "base_accuracy": base_eval["accuracy"] if base_eval else None,
        "final_accuracy": final_eval["accuracy"] if final_eval else None,
        "base_truncated_fraction": (base_eval or {}).get("truncated_fraction"),
        "final_truncated_fraction": (final_eval or {}).get("truncated_fraction"),
        "base_eval": base_eval,
        "final_eval": final_eval,
        "store_uri": store_uri,
        "runtime": runtime,
        "critic": critic,
    }


def write_report(
    workdir: Path, run_id: str, cfg: RunConfig, history: list[dict[str, Any]], summary: dict[str, Any]
) -> Path:
    """Write `<workdir>/report.md` (summary, metric table, sample rollout completions of the first, middle and
    last steps from `summary["step_samples"]`, greedy held-out completions: `greedy_markdown`),
    `reward_curve.png`, and `history.json` (every step's metrics, one object per step).

    Returns:
        the path of report.md.
    """
    workdir.mkdir(parents=True, exist_ok=True)
    plot_reward_curve(history, workdir / "reward_curve.png")
    (workdir / "history.json").write_text(json.dumps(history, indent=1))
    text = (
        summary_markdown(run_id, cfg, summary)
        + "\n![reward curve](reward_curve.png)\n\n## Steps\n\n"
        + _markdown_table(step_table(history))
        + _step_samples_section(summary)
        + "\n## Greedy completions after training (held-out)\n\n"
        + greedy_markdown(summary)
    )
    path = workdir / "report.md"
    path.write_text(text)
    return path
