"""`lora-rl` command line: train, plan, eval, serve, subscribe, adapters.

User errors (bad config, missing data, unloadable reward or model, store
problems) print one line `lora-rl: error: ...` and exit with code 2; a bad command line (unknown option or
command, missing option, bad value) prints click's short usage error and exits with code 2, no traceback.
SIGINT or SIGTERM stops what the command started (trainer workers, engine,
Prefect's ephemeral server), prints one line `lora-rl: interrupted by ...`
and exits with 130 or 143 (`cli.shutdown`). Even on SIGKILL nothing that train, eval or serve started
outlives it: a reaper process ends it (`cli.reaper`).
"""

from __future__ import annotations

import json
import os
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from cli import reaper, shutdown
from cli.adapters import adapters_app
from lora_rl_core import progress
from lora_rl_core.config import SGLANG_DEFAULT_PORT, SGLANG_DEFAULTS, RemoteEngine, RunConfig, SGLangEngineConfig
from lora_rl_core.errors import LoraRLError
from lora_rl_core.subscriber import ENGINE_KIND, KEEP_VERSIONS, POLL_INTERVAL_S

app = typer.Typer(
    add_completion=False, no_args_is_help=True, help="LoRA RL fine-tuning of LLMs (GRPO) as a Prefect flow."
)
app.add_typer(adapters_app, name="adapters", help="List and pull adapter versions from a store.")
API_KEY_ENV = SGLANG_DEFAULTS.api_key_env  # the config's default, for commands without one
PREFECT_STARTUP_TIMEOUT_S = 180  # for Prefect's temporary API server (Prefect's default: 20 s)
console = Console(soft_wrap=True)  # step lines stay whole when output is a file

ConfigOpt = Annotated[str, typer.Option("--config", "-c", help="YAML run config, e.g. configs/smollm2-arith-grpo.yaml")]
OverridesArg = Annotated[
    list[str] | None, typer.Argument(help="dotted overrides, e.g. lora.rank=32 engine.max_loras_per_batch=4")
]


@app.command()
@shutdown.stops("trainer workers, engine and Prefect server")
def train(
    config: ConfigOpt,
    overrides: OverridesArg = None,
    run_id: Annotated[
        str | None, typer.Option(help="run id (default run.id or <run.name>-<8 random hex digits>)")
    ] = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="show Prefect's INFO logs too")] = False,
) -> None:
    """Run the `lora-rl-train` flow with a progress bar and one line per step."""
    # Before prefect is imported: the progress bar replaces Prefect's per-task console lines.
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "INFO" if verbose else "WARNING")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    # Prefect gives its temporary server 20 s to answer; a fresh PREFECT_HOME on a busy 2-core CPU takes longer.
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", str(PREFECT_STARTUP_TIMEOUT_S))
    from lora_rl_core.config import load_config
    from lora_rl_core.plan import make_plan
    from lora_rl_core.run import components, load_inputs

    cfg = load_config(config, overrides or [])  # the one parse and the one validation
    # the inputs and the plan, checked before anything starts: a user error is one line and leaves nothing behind
    with load_inputs(cfg) as inputs:  # the run owns them once built (closing twice is harmless)
        plan = make_plan(cfg, tokenizer=inputs.tokenizer, problems=inputs.train)
        reaper.watch()  # before the engine, the trainer and Prefect: nothing outlives this process, even on SIGKILL
        run_id = run_id or components.default_run_id(cfg, uuid.uuid4().hex)  # passed on: a retry resumes it
        # the engine and the trainer, once, before Prefect; the flow takes the run by its id
        with components.build_run(plan, inputs, run_id):
            from flows.grpo_lora import train as train_flow

            shutdown.quiet_console_logs()  # Prefect's handlers exist now: its crash lines on SIGTERM stay quiet
            shutdown.isolate_prefect_server()  # a terminal's Ctrl-C reaches lora-rl, which stops the server last

            with _progress_lines():
                summary = train_flow.with_options(flow_run_name=run_id)(
                    config_path=config, overrides=list(overrides or []), run_id=run_id
                )
    _print_summary(summary)


@contextmanager
def _progress_lines() -> Iterator[None]:
    """Within the block, a progress bar over the run's steps, and one line per step and evaluation."""
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
            bar.console.print(progress.format_runtime(data["runtime"]), markup=False)
        elif event == "step":
            bar.console.print(progress.format_step(data))
            bar.advance(task_id)
        elif event == "eval":
            bar.console.print(
                f"greedy accuracy {data['phase']} training: {progress.format_accuracy(data)} ({data['n']} problems)"
            )

    unsubscribe = progress.subscribe(on_event)
    try:
        with bar:
            yield
    finally:
        unsubscribe()


def _print_summary(s: dict[str, Any]) -> None:
    console.print(f"[bold green]done[/] {progress.format_done(s)}")
    console.print(f"adapter {s['final_adapter']} in {s['store_uri']}; report {s['report']}")


@app.command("eval")
def eval_(
    config: ConfigOpt,
    overrides: OverridesArg = None,
    adapter: Annotated[str | None, typer.Option(help="RUN@VERSION, RUN@latest or RUN; omit for the base model")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="print the result as JSON")] = False,
) -> None:
    """Greedy accuracy on the config's held-out split, for a stored adapter or the base model, graded by the
    evaluation's fixed grader (strict and flexible answer checks, or `eval.grader`), never the training reward;
    with `eval.samples_per_prompt=N` (N > 1) also pass@k and mean@N.

    The engine is the config's (`engine` section: embedded with its limits, or the remote engines at
    `engine.urls`); the adapter is loaded from the config's store by path unless the engine lists it.
    """
    from lora_rl_core.config import load_config
    from lora_rl_core.evaluation import evaluate_run_policy
    from lora_rl_core.plan import make_plan
    from lora_rl_core.run import build_evaluation, load_inputs

    cfg = load_config(config, overrides or [])
    with load_inputs(cfg, train=False) as inputs:  # the store, held-out data and grader, as a run builds them
        plan = make_plan(cfg, tokenizer=inputs.tokenizer, problems=inputs.train, train=False)
        reaper.watch()  # nothing started from here on outlives this process, even on SIGKILL
        with build_evaluation(plan, inputs) as built:
            engine, name = built.engine, None
            if adapter:
                ref = inputs.store.resolve(adapter)
                if ref.name not in engine.list_adapters():
                    engine.load_adapter(ref.name, path=ref.uri)  # the engine reads the version sha256-verified
                name = ref.name
            result = evaluate_run_policy(engine, inputs.tokenizer, inputs.test, inputs.grader, cfg, adapter=name)
    if json_out:
        console.print_json(json.dumps(result))
    else:
        sampled = progress.format_sampled(result)
        console.print(
            f"{name or 'base model'}: greedy accuracy {progress.format_accuracy(result)} on {result['n']} problems"
            + (f"; {sampled} ({result['samples_per_prompt']} samples each)" if sampled else "")
            + f" ({result['seconds']:.1f} s)"
        )


@app.command("plan")
def plan_(
    config: ConfigOpt,
    overrides: OverridesArg = None,
    json_out: Annotated[bool, typer.Option("--json", help="print the plan as JSON")] = False,
) -> None:
    """Print the run's plan without training: every resolved setting with its value and the reason (`auto`
    resolved on this machine, or set in the config), and on a GPU the memory plan. The inputs are loaded and
    checked as `train` checks them (store, data, rewards, grader, model); no engine or trainer is started."""
    from lora_rl_core.config import load_config
    from lora_rl_core.plan import make_plan
    from lora_rl_core.run import load_inputs

    cfg = load_config(config, overrides or [])
    with load_inputs(cfg) as inputs:  # its worker processes stop at the end: nothing else is started
        summary = make_plan(cfg, tokenizer=inputs.tokenizer, problems=inputs.train).summary()
    if json_out:
        console.print_json(json.dumps(summary))
    else:
        console.print(progress.format_runtime(summary), markup=False)  # what the run log shows when it opens


def _check_port_is_not_sglangs(cfg: RunConfig, port: int, servers: int = 1) -> None:
    """Raise `ConfigError` when `serve` would bind the port of an SGLang server it launches (`servers` of them,
    one per GPU of the placement, on `engine.launch.port + i`): SGLang binds it first (on 127.0.0.1, which any
    of our hosts overlaps), and then uvicorn fails with `address already in use`."""
    from lora_rl_core.errors import ConfigError

    if not isinstance(cfg.engine, SGLangEngineConfig):
        return
    launch = cfg.engine.launch
    if launch.enabled and launch.port <= port < launch.port + servers:
        if servers > 1:
            raise ConfigError(
                f"lora-rl serve --port {port} is the port of one of the {servers} SGLang servers it launches "
                f"(engine.launch.port {launch.port} .. {launch.port + servers - 1}); pass another --port (e.g. "
                f"{launch.port + servers}) or set engine.launch.port"
            )
        other = port + 1 if port < 65535 else port - 1
        raise ConfigError(
            f"lora-rl serve --port {port} is the port of the SGLang it launches (engine.launch.port); "
            f"pass another --port (e.g. {other}) or set engine.launch.port"
        )


@app.command()
@shutdown.stops("the HTTP server and the engine")
def serve(
    config: Annotated[
        str | None,
        typer.Option("--config", "-c", help="YAML run config (model, engine, store sections); omitted: the defaults"),
    ] = None,
    overrides: OverridesArg = None,
    host: Annotated[str, typer.Option(help="bind address; beyond loopback needs --api-key")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=1, max=65535, help="port")] = SGLANG_DEFAULT_PORT,
    api_key: Annotated[
        str | None,
        typer.Option(help="Bearer key for the control endpoints (default: the variable named by engine.api_key_env)"),
    ] = None,
    served_model_name: Annotated[
        str | None, typer.Option(help="the base model's id in /v1/models (default: the model folder's name)")
    ] = None,
) -> None:
    """Serve the config's model through the SGLang HTTP API subset (/generate, LoRA load/unload, /metrics) and
    OpenAI's /v1/completions and /v1/chat/completions; an adapter may be named RUN@latest, RUN@N or RUN@TAG.

    Model, engine limits (engine.max_loras_per_batch, max_loaded_loras, eviction_policy, max_lora_rank,
    max_batch_size, timeout_s) and the store (loads by RUN@VERSION) come from the config and its overrides,
    e.g. `lora-rl serve -c configs/smollm2-arith-grpo.yaml engine.max_loras_per_batch=4 --port 30001`.
    With engine.type=sglang it is the front door of that SGLang (engine.urls, or engine.launch.enabled=true):
    clients talk to it, never to SGLang, so unloads never hang (docs/HOTSWAP.md).
    """
    from lora_rl_core.config import load_config
    from lora_rl_core.engines.registry import build_serving_engine
    from lora_rl_core.engines.serve.app import check_bind
    from lora_rl_core.engines.serve.app import serve as serve_engine
    from lora_rl_core.models import load_tokenizer
    from lora_rl_core.plan import make_plan
    from lora_rl_core.run.components import engine_inputs
    from lora_rl_core.runtime import configure_threads

    cfg = load_config(config, overrides or [])
    _check_port_is_not_sglangs(cfg, port)
    api_key = api_key or os.environ.get(cfg.engine.api_key_env if isinstance(cfg.engine, RemoteEngine) else API_KEY_ENV)
    check_bind(host, api_key)
    store = cfg.store.build()  # a bad store URI: one line before the model loads
    reaper.watch()  # nothing started from here on outlives this process, even on SIGKILL
    configure_threads()  # before loading the model
    model = cfg.model.name_or_path
    console.print(f"serving {model} on http://{host}:{port} (control endpoints {'need a key' if api_key else 'open'})")
    if isinstance(cfg.engine, SGLangEngineConfig):
        console.print(f"in front of SGLang at {cfg.engine.urls or 'a server launched here'}", markup=False)
    plan = make_plan(cfg, train=False)  # the engine's `auto` settings, resolved once
    _check_port_is_not_sglangs(cfg, port, plan.engine.launch.servers if plan.engine.launch else 1)
    if cfg.engine.type != "sglang":
        dtype = plan.choices["model.dtype"]
        console.print(f"model dtype {dtype.value}: {dtype.reason}", markup=False)
    tokenizer = load_tokenizer(cfg.model)
    serve_engine(
        build_serving_engine(engine_inputs(plan, tokenizer, Path.cwd(), store)),
        model_path=model,
        tokenizer=tokenizer,
        store=store,
        request_timeout_s=cfg.engine.timeout_s,
        host=host,
        port=port,
        api_key=api_key,
        served_model_name=served_model_name,
    )


@app.command()
@shutdown.stops("the subscriber and closed its engine connections")
def subscribe(
    store: Annotated[str, typer.Option(help="adapter store URI, e.g. file://./runs")],
    run: Annotated[str, typer.Option(help="run id to follow")],
    engine: Annotated[list[str], typer.Option(help="engine URL (repeat for several)")],
    api_key: Annotated[
        str | None, typer.Option(envvar=API_KEY_ENV, help="Bearer key for the engines' control endpoints")
    ] = None,
    keep: Annotated[int, typer.Option(help="versions kept loaded per engine")] = KEEP_VERSIONS,
    poll_interval: Annotated[float, typer.Option(help="seconds between store polls")] = POLL_INTERVAL_S,
    engine_kind: Annotated[str, typer.Option(help="server (lora-rl serve) or sglang")] = ENGINE_KIND,
    max_seconds: Annotated[float | None, typer.Option(help="stop after this many seconds")] = None,
) -> None:
    """Load every new adapter version of RUN into the engines, retire old ones (Ctrl-C stops)."""
    import threading

    from lora_rl_core.subscriber import open_subscriber

    def on_sync(result: Any) -> None:
        console.print(result.summary(), markup=False)

    with open_subscriber(
        store,
        run,
        engine,
        engine_kind=engine_kind,
        api_key=api_key,
        keep=keep,
        poll_interval_s=poll_interval,
        on_sync=on_sync,
    ) as subscriber:
        console.print(f"following {run} in {store} for {len(engine)} engine(s); Ctrl-C stops")
        stop = threading.Event()
        try:
            subscriber.run(stop, max_seconds=max_seconds)
        except KeyboardInterrupt:
            stop.set()
    console.print(f"active: {subscriber.active.name if subscriber.active else 'none'}")


# click's ClickException as typer raises it: recent typer (0.29 here) vendors click as `typer._click`, whose
# exceptions are no `click.ClickException`; found through the public `typer.BadParameter`, so either kind works.
_CLICK_EXCEPTION: type[Any] = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException")


def main() -> None:
    """Console-script entry point: run the app, turning user errors into one line and exit code 2,
    and SIGINT/SIGTERM into an orderly shutdown, one line and exit code 128 + signal (`cli.shutdown`)."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # Before torch loads, which reads it once: waiting OpenMP threads sleep, not spin (`lora_rl_core.runtime`).
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    shutdown.install()
    with reaper.enabled():  # this process is lora-rl itself: its commands start a reaper (`cli.reaper`)
        try:
            code = app(standalone_mode=False)  # returns the exit code of typer.Exit instead of raising it
            sys.exit(code if isinstance(code, int) else 0)
        except LoraRLError as exc:
            signum = shutdown.signal_of(exc)
            if signum is not None:  # failed while shutting down after a signal: the signal is the news
                shutdown.exit_interrupted(signum)
            print(f"lora-rl: error: {exc}", file=sys.stderr)
            sys.exit(2)
        except typer.Exit as exc:
            sys.exit(exc.exit_code)
        except typer.Abort:
            sys.exit(1)
        except BaseException as exc:  # SIGINT/SIGTERM (`shutdown.Interrupted`), click usage errors, crashes
            signum = shutdown.signal_of(exc)
            if signum is not None:
                shutdown.exit_interrupted(signum)
            if isinstance(exc, _CLICK_EXCEPTION):  # a usage error: click's short message, exit 2, no traceback
                if type(exc).__name__ != "NoArgsIsHelpError":  # that one's help is already printed
                    exc.show()
                sys.exit(exc.exit_code)
            raise


if __name__ == "__main__":
    main()
