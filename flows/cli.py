"""`lora-rl` command line: train, eval, adapters.

User errors (bad config, missing data, unloadable reward or model, store
problems) print one line `lora-rl: error: ...` and exit with code 2.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from flows.cli_adapters import adapters_app
from lora_rl_core import progress
from lora_rl_core.errors import LoraRLError

app = typer.Typer(
    add_completion=False, no_args_is_help=True, help="LoRA RL fine-tuning of LLMs (GRPO) as a Prefect flow."
)
app.add_typer(adapters_app, name="adapters", help="List and pull adapter versions from a store.")
console = Console()

ConfigOpt = Annotated[str, typer.Option("--config", "-c", help="YAML run config, e.g. configs/smollm2-arith-grpo.yaml")]


@app.command()
def train(
    config: ConfigOpt,
    overrides: Annotated[list[str] | None, typer.Argument(help="dotted overrides, e.g. lora.rank=32")] = None,
    run_id: Annotated[str | None, typer.Option(help="run id (default run.id or <name>-<timestamp>)")] = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="show Prefect's INFO logs too")] = False,
) -> None:
    """Run the `lora-rl-train` flow with a progress bar and one line per step."""
    # Before prefect is imported: the progress bar replaces Prefect's per-task console lines.
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "INFO" if verbose else "WARNING")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    from lora_rl_core.config import load_config
    from lora_rl_core.session import preflight

    preflight(load_config(config, overrides or []))  # bad config, data, reward or model: one line, before Prefect
    from flows.grpo_lora import train as train_flow

    bar = Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=console,
    )
    task_id = bar.add_task("training", total=None)

    def on_event(event: str, data: dict[str, Any]) -> None:
        if event == "run_started":
            bar.update(task_id, total=data["steps"], description=f"training {data['run_id']}")
        elif event == "step":
            bar.console.print(progress.format_step(data))
            bar.advance(task_id)
        elif event == "eval":
            bar.console.print(
                f"greedy accuracy {data['phase']} training: {100 * data['accuracy']:.1f}% ({data['n']} problems)"
            )

    unsubscribe = progress.subscribe(on_event)
    try:
        with bar:
            summary = train_flow(config_path=config, overrides=list(overrides or []), run_id=run_id)
    finally:
        unsubscribe()
    _print_summary(summary)


def _print_summary(s: dict[str, Any]) -> None:
    pct = lambda v: "n/a" if v is None else f"{100 * v:.1f}%"  # noqa: E731
    console.print(
        f"[bold green]done[/] run {s['run_id']}: accuracy {pct(s['base_accuracy'])} -> {pct(s['final_accuracy'])}, "
        f"{s['steps']} steps, {s['wall_seconds']:.0f} s wall, {s['seconds_per_step']:.1f} s/step, "
        f"{s['completions_per_second']:.2f} completions/s"
    )
    console.print(f"adapter {s['final_adapter']} in {s['store_uri']}; report {s['report']}")


@app.command("eval")
def eval_(
    config: ConfigOpt,
    adapter: Annotated[str | None, typer.Option(help="RUN@VERSION, RUN@latest or RUN; omit for the base model")] = None,
    overrides: Annotated[list[str] | None, typer.Argument(help="dotted overrides")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="print the result as JSON")] = False,
) -> None:
    """Greedy accuracy on the config's held-out split, for a stored adapter or the base model."""
    from lora_rl_core.config import load_config
    from lora_rl_core.engines import EmbeddedEngine
    from lora_rl_core.evaluation import evaluate_accuracy
    from lora_rl_core.models import load_model
    from lora_rl_core.session import build_problems

    cfg = load_config(config, overrides or [])
    problems = build_problems(cfg.data, "test", cfg.run.seed)
    model, tokenizer = load_model(cfg.model)
    engine = EmbeddedEngine(model, tokenizer, max_batch_size=cfg.engine.max_batch_size)
    name = None
    if adapter:
        store = cfg.store.build()
        ref = store.resolve(adapter)
        tensors, adapter_cfg = store.load_tensors(ref.run_id, ref.version)
        engine.load_adapter(ref.name, tensors=tensors, config=adapter_cfg)
        name = ref.name
    result = evaluate_accuracy(
        engine,
        tokenizer,
        problems,
        adapter=name,
        rollout=cfg.rollout,
        max_new_tokens=cfg.run.eval_max_new_tokens or cfg.rollout.max_new_tokens,
    )
    if json_out:
        console.print_json(json.dumps(result))
    else:
        console.print(
            f"{name or 'base model'}: greedy accuracy {100 * result['accuracy']:.1f}% on {result['n']} problems "
            f"({result['seconds']:.1f} s)"
        )


def main() -> None:
    """Console-script entry point: run the app, turning user errors into one line and exit code 2."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        app(standalone_mode=False)
    except LoraRLError as exc:
        print(f"lora-rl: error: {exc}", file=sys.stderr)
        sys.exit(2)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except typer.Abort:
        sys.exit(1)
    except Exception as exc:  # click usage errors
        import click

        if isinstance(exc, click.ClickException):
            exc.show()
            sys.exit(exc.exit_code)
        raise


if __name__ == "__main__":
    main()
