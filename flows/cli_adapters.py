"""``lora-rl adapters list|pull``: browse and fetch adapters in a store.

The main CLI mounts this with ``app.add_typer(adapters_app, name="adapters")``.
A ``StoreError`` prints ``lora-rl: error: <message>`` on stderr and exits 2.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from lora_rl_core.errors import StoreError
from lora_rl_core.store import AdapterManifest, AdapterStore

adapters_app = typer.Typer(help="List and pull LoRA adapters from a store.", no_args_is_help=True)

STORE_OPTION = typer.Option("file://./runs", "--store", help="Store URI (file://, s3://, memory://, ...).")


@contextmanager
def _store_errors() -> Iterator[None]:
    """Turn a StoreError into one line on stderr and exit code 2."""
    try:
        yield
    except StoreError as e:
        message = " ".join(str(e).split())
        typer.echo(f"lora-rl: error: {message}", err=True)
        raise typer.Exit(2) from None


def _human_size(n_bytes: int) -> str:
    """Bytes as a short human-readable string, e.g. ``12.3 KiB``."""
    size = float(n_bytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{int(size)} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GiB"


def _runs_table(store: AdapterStore) -> Table:
    """One row per run: run id, number of complete versions, latest version."""
    table = Table("run", "versions", "latest")
    for run_id in store.runs():
        versions = store.versions(run_id)
        table.add_row(run_id, str(len(versions)), str(versions[-1]) if versions else "-")
    return table


def _version_row(m: AdapterManifest) -> list[str]:
    """version, step, created, reward, size, sha256 prefix of one manifest."""
    reward = m.metrics.get("reward_mean")
    model = m.files.get("adapter_model.safetensors")
    return [
        str(m.version),
        str(m.step),
        m.created_at.replace("T", " ").removesuffix("+00:00"),
        "-" if reward is None else f"{reward:.4f}",
        _human_size(sum(f.size for f in m.files.values())),
        model.sha256[:12] if model else "-",
    ]


def _versions_table(store: AdapterStore, run_id: str) -> Table:
    """One row per complete version of ``run_id``; StoreError if it has none."""
    versions = store.versions(run_id)
    if not versions:
        raise StoreError(
            f"run {run_id!r} has no complete adapter versions in {store.uri}; "
            f"runs in the store: {store.runs() or 'none'}"
        )
    table = Table("version", "step", "created (UTC)", "reward", "size", "sha256")
    for version in versions:
        table.add_row(*_version_row(store.manifest(run_id, version)))
    return table


@adapters_app.command("list")
def list_adapters(
    store: str = STORE_OPTION,
    run: str | None = typer.Option(None, "--run", help="Show the versions of this run."),
) -> None:
    """List runs and their version counts, or the versions of one run."""
    with _store_errors():
        adapter_store = AdapterStore(store)
        table = _runs_table(adapter_store) if run is None else _versions_table(adapter_store, run)
        console = Console()
        console.print(adapter_store.uri + ("" if run is None else f"/{run}"), markup=False, highlight=False)
        console.print(table)


@adapters_app.command("pull")
def pull_adapter(
    spec: str = typer.Argument(..., help="RUN@VERSION, RUN@latest or RUN."),
    store: str = STORE_OPTION,
    out: Path = typer.Option(..., "--out", help="Folder to write the PEFT adapter into."),
) -> None:
    """Pull one adapter version into a local PEFT folder and print its path."""
    with _store_errors():
        adapter_store = AdapterStore(store)
        ref = adapter_store.resolve(spec)
        path = adapter_store.pull(ref.run_id, ref.version, out)
        typer.echo(str(path))
