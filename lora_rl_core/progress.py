"""In-process progress events, so a front end (the CLI's progress bar) can follow a run.

The flow calls `emit(event, data)`; listeners registered with `subscribe` get
every event in the emitting thread. Events: `run_started` {run_id, steps},
`step` {step metrics}, `eval` {phase, accuracy, ...}, `run_finished` {summary}.
A listener that raises is dropped from that event's delivery, never the run.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

Listener = Callable[[str, dict[str, Any]], None]
_listeners: list[Listener] = []
_log = logging.getLogger(__name__)


def subscribe(listener: Listener) -> Callable[[], None]:
    """Register `listener(event, data)`; returns a function that unregisters it."""
    _listeners.append(listener)
    return lambda: _listeners.remove(listener) if listener in _listeners else None


def emit(event: str, data: dict[str, Any]) -> None:
    """Deliver an event to every listener; listener errors are logged, not raised."""
    for listener in list(_listeners):
        try:
            listener(event, data)
        except Exception:  # noqa: BLE001 - a broken UI must not stop training
            _log.exception("progress listener failed on %s", event)


def format_step(m: dict[str, Any]) -> str:
    """One line per step: `step 3/30 reward 0.42±0.31 acc 41% signal 50% clip 0.000 kl 0.0000 ent 1.23 gnorm 0.5
    len 21.0 cut 3% end 97% 2.5 compl/s 18.2s`, then each reward term's mean (`len`: mean completion length,
    tokens; `cut`: completions that hit `rollout.max_new_tokens`, verl's `response_length/clip_ratio`; `end`:
    completions that ended with end-of-sequence or a stop sequence; under M2PO `m2`, the batch's mean squared
    log ratio before its mask, and the share of tokens the mask left out; under PPO (`advantage: gae`) the
    critic's `vloss` (value loss), `ev` (explained variance of its values for the returns), `vclip` (value clip
    fraction) and `v` (mean value), and `(critic only)` in its pre-training steps)."""
    return (
        f"step {m['step']}/{m.get('steps', '?')} reward {m.get('reward_mean', 0):.3f}±{m.get('reward_std', 0):.3f} "
        f"acc {100 * m.get('accuracy', 0):.0f}% signal {100 * m.get('groups_with_signal', 0):.0f}% "
        f"clip {m.get('clip_fraction', 0):.3f} kl {m.get('kl', 0):.4f} ent {m.get('entropy', 0):.2f} "
        f"gnorm {m.get('grad_norm', 0):.3f} len {m.get('completion_length', 0):.1f} "
        f"cut {100 * m.get('truncated_fraction', 0):.0f}% end {100 * m.get('ended_fraction', 0):.0f}% "
        f"{m.get('completions_per_second', 0):.1f} compl/s {m.get('step_seconds', 0):.1f}s"
        + (f" lag {' '.join(f'{k}:{v}' for k, v in lag.items())}" if (lag := m.get("version_lag")) else "")
        + (
            f" m2 {m2:.4f} masked {100 * m.get('m2_masked_fraction', 0):.1f}%"
            if (m2 := m.get("m2")) is not None
            else ""
        )
        + (
            f" vloss {vloss:.4f} ev {m.get('explained_variance', 0):.2f} vclip {m.get('value_clip_fraction', 0):.3f}"
            f" v {m.get('value_mean', 0):.3f}" + ("" if m.get("policy_trained", 1.0) else " (critic only)")
            if (vloss := m.get("value_loss")) is not None
            else ""
        )
        + "".join(f" {k.removeprefix('rewards/').removesuffix('/mean')} {v:.3f}" for k, v in m.items() if _term(k, v))
    )


def format_accuracy(evaluation: dict[str, Any]) -> str:
    """`strict 3.9% flexible 10.2%`: an evaluation's greedy accuracy under each grader metric
    (`lora_rl_core.evaluation`; an evaluation of an older version, with one `accuracy`, as that)."""
    metrics = evaluation.get("metrics") or []
    if not metrics:
        return f"{100 * evaluation['accuracy']:.1f}%"
    return " ".join(f"{m} {100 * evaluation[f'accuracy/{m}']:.1f}%" for m in metrics)


def format_sampled(evaluation: dict[str, Any]) -> str:
    """`pass@1/strict 40.0% pass@4/strict 71.0% mean@4/strict 40.0% ...`: an evaluation's pass@k and mean@n per
    grader metric, or `` when it drew no samples (`eval.samples_per_prompt: 1`)."""
    return " ".join(f"{k} {100 * v:.1f}%" for k, v in evaluation.items() if k.startswith(("pass@", "mean@")))


def accuracy_change(summary: dict[str, Any]) -> str:
    """`strict 3.9% -> 40.6%, flexible 10.2% -> 71.9%` from a run summary (`lora_rl_core.report.run_summary`);
    `n/a` where an evaluation was not run or has no such metric (a cached one from an older version)."""
    base, final = summary.get("base_eval") or {}, summary.get("final_eval") or {}
    metrics = (final or base).get("metrics") or [None]

    def pct(evaluation: dict[str, Any], metric: str | None) -> str:
        value = evaluation.get(f"accuracy/{metric}" if metric else "accuracy")  # None: not run, or another grader
        return "n/a" if value is None else f"{100 * value:.1f}%"

    return ", ".join(f"{m + ' ' if m else ''}{pct(base, m)} -> {pct(final, m)}" for m in metrics)


def format_done(s: dict[str, Any]) -> str:
    """The run's last line after `done`, from its summary (`lora_rl_core.report.run_summary`): `run r: accuracy
    strict 0.0% -> 40.6%, flexible 4.7% -> 71.9%; cut 62% -> 3%, 25 steps, 798 s wall, 29.5 s/step, 3.81
    completions/s` (`cut`: greedy held-out completions cut at the token limit, before -> after training)."""
    return (
        f"run {s['run_id']}: accuracy {accuracy_change(s)}; cut {cut_change(s)}, {s['steps']} steps, "
        f"{s['wall_seconds']:.0f} s wall, {s['seconds_per_step']:.1f} s/step, "
        f"{s['completions_per_second']:.2f} completions/s"
    )


def cut_change(summary: dict[str, Any]) -> str:
    """`62% -> 3%`: the share of greedy held-out completions cut at the token limit before and after training,
    from a run summary (`base_truncated_fraction`, `final_truncated_fraction`); `n/a` where an evaluation was
    not run, or the summary is older than these keys."""

    def pct(value: float | None) -> str:
        return "n/a" if value is None else f"{100 * value:.0f}%"

    return f"{pct(summary.get('base_truncated_fraction'))} -> {pct(summary.get('final_truncated_fraction'))}"


def format_runtime(runtime: dict[str, Any]) -> str:
    """The run's plan for the run log, printed once when the run opens (`lora_rl_core.plan.RunPlan.summary`):
    a first line with the device, the model dtype and why, the LoRA compute dtype and why, CPU threads; then
    one line per other resolved setting (`  <setting> = <value>: <reason>`), the memory plan (GiB), and what
    each Ray replica resolved on its host (`replicas`)."""
    head = (
        f"model dtype {runtime['dtype']} on {runtime['device']}: {runtime['dtype_reason']}; "
        + lora_compute_part(runtime)
        + f"{runtime['cpu_threads']} CPU threads"
    )
    shown = {"model.dtype", "trainer.lora_compute_dtype"}
    lines = [
        f"  {name} = {c['value']}: {c['reason']}" for name, c in runtime.get("choices", {}).items() if name not in shown
    ]
    if runtime.get("memory_plan"):
        lines.append(f"  memory plan (GiB): {runtime['memory_plan']}")
    for i, replica in enumerate(runtime.get("replicas", [])):
        told = {k: v for k, v in replica.items() if k not in ("node", "reasons", "dtype_reason")}
        lines.append(f"  engine replica {i} on {replica.get('node')}, resolved there: {told}")
    return "\n".join([head, *lines])


def lora_compute_part(runtime: dict[str, Any]) -> str:
    """`LoRA compute bfloat16 (<why>); ` from a run's runtime facts; empty where they do not say (older runs)."""
    if "lora_compute_dtype" not in runtime:
        return ""
    return f"LoRA compute {runtime['lora_compute_dtype']} ({runtime['lora_compute_dtype_reason']}); "


def _term(key: str, value: Any) -> bool:
    """A reward term's mean (`rewards/<name>/mean`) that was measured, for the step line."""
    return key.startswith("rewards/") and isinstance(value, float) and value == value  # NaN: no row scored
