"""``lora-rl adapters list|show|pull|tag|untag|gc``: browse, fetch, tag and prune adapters in a store.

The main CLI mounts this with ``app.add_typer(adapters_app, name="adapters")``.
Every command takes ``--store URI`` (env ``LORA_RL_STORE``) and
``--storage-options JSON`` (env ``LORA_RL_STORAGE_OPTIONS``; for S3 the
standard AWS variables work too, e.g. ``AWS_ENDPOINT_URL``). A version is
given as ``RUN@VERSION``, ``RUN@TAG`` (``RUN@best``), ``RUN@latest`` or ``RUN``.
A ``StoreError`` prints ``lora-rl: error: <message>`` on stderr and exits 2.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from lora_rl_core.adapters import MODEL_FILE, adapter_name
from lora_rl_core.errors import StoreError
from lora_rl_core.store import AdapterManifest, AdapterStore, RetentionPolicy

adapters_app = typer.Typer(help="List, show, pull, tag and prune LoRA adapters in a store.", no_args_is_help=True)

STORE_OPTION = typer.Option(
    "file://./runs", "--store", envvar="LORA_RL_STORE", help="Store URI (file://, s3://bucket/prefix, memory://)."
)
OPTIONS_OPTION = typer.Option(
    None,
    "--storage-options",
    envvar="LORA_RL_STORAGE_OPTIONS",
    help='fsspec storage options as JSON, e.g. \'{"client_kwargs": {"endpoint_url": "http://127.0.0.1:9000"}}\'.',
)


@contextmanager
def _store_errors() -> Iterator[None]:
    """Turn a StoreError into one line on stderr and exit code 2.

    ``SystemExit`` rather than ``typer.Exit``: ``cli.main.main`` runs the app with
    ``standalone_mode=False``, where click turns ``Exit`` into a return value.
    """
    try:
        yield
    except StoreError as e:
        message = " ".join(str(e).split())
        typer.echo(f"lora-rl: error: {message}", err=True)
        raise SystemExit(2) from None


def _open_store(uri: str, storage_options: str | None) -> AdapterStore:
    """The store at ``uri``; ``storage_options`` is a JSON object or None.

    Raises:
        StoreError: the options are not a JSON object, or the store cannot be opened.
    """
    options = None
    if storage_options:
        try:
            options = json.loads(storage_options)
        except ValueError as e:
            raise StoreError(f"--storage-options is not valid JSON: {e}") from e
        if not isinstance(options, dict):
            raise StoreError("--storage-options must be a JSON object, e.g. '{\"anon\": true}'")
    return AdapterStore(uri, storage_options=options)


def _human_size(n_bytes: int) -> str:
    """Bytes as a short human-readable string, e.g. ``12.3 KiB``."""
    size = float(n_bytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{int(size)} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GiB"


def _tags_by_version(tags: dict[str, int]) -> dict[int, str]:
    """version -> "best, release" from tag name -> version."""
    out: dict[int, list[str]] = {}
    for name, version in tags.items():
        out.setdefault(version, []).append(name)
    return {v: ", ".join(sorted(names)) for v, names in out.items()}


def _runs_table(store: AdapterStore) -> Table:
    """One row per run: run id, number of complete versions, latest version, tags."""
    table = Table("run", "versions", "latest", "tags")
    for run_id in store.runs():
        versions = store.versions(run_id)
        tags = ", ".join(f"{n}={v}" for n, v in store.tags(run_id).items())
        table.add_row(run_id, str(len(versions)), str(versions[-1]) if versions else "-", tags or "-")
    return table


def _version_row(m: AdapterManifest, tags: str) -> list[str]:
    """version, step, created, reward, size, sha256 prefix and tags of one manifest."""
    reward = m.metrics.get("reward_mean")
    model = m.files.get(MODEL_FILE)
    return [
        str(m.version),
        str(m.step),
        m.created_at.replace("T", " ").removesuffix("+00:00"),
        "-" if reward is None else f"{reward:.4f}",
        _human_size(sum(f.size for f in m.files.values())),
        model.sha256[:12] if model else "-",
        tags or "-",
    ]


def _versions_table(store: AdapterStore, run_id: str) -> Table:
    """One row per complete version of ``run_id``; StoreError if it has none."""
    versions = store.versions(run_id)
    if not versions:
        raise StoreError(
            f"run {run_id!r} has no complete adapter versions in {store.uri}; "
            f"runs in the store: {store.runs() or 'none'}"
        )
    tags = _tags_by_version(store.tags(run_id))
    table = Table("version", "step", "created (UTC)", "reward", "size", "sha256", "tags")
    for version in versions:
        table.add_row(*_version_row(store.manifest(run_id, version), tags.get(version, "")))
    return table


def _print(*renderables: object) -> None:
    """Print strings verbatim and tables; off a terminal, tables get 160 columns instead of rich's 80."""
    console = Console()
    if not console.is_terminal:
        console.width = 160
    for r in renderables:
        console.print(r, markup=False, highlight=False) if isinstance(r, str) else console.print(r)


@adapters_app.command("list")
def list_adapters(
    store: str = STORE_OPTION,
    storage_options: str | None = OPTIONS_OPTION,
    run: str | None = typer.Option(None, "--run", help="Show the versions of this run."),
) -> None:
    """List runs and their version counts, or the versions of one run."""
    with _store_errors():
        adapter_store = _open_store(store, storage_options)
        table = _runs_table(adapter_store) if run is None else _versions_table(adapter_store, run)
        _print(adapter_store.uri + ("" if run is None else f"/{run}"), table)


def _details_table(store: AdapterStore, m: AdapterManifest) -> Table:
    """Field / value rows of one manifest."""
    table = Table("field", "value", show_header=False)
    tags = _tags_by_version(store.tags(m.run_id)).get(m.version, "-")
    rows = [
        ("adapter", adapter_name(m.run_id, m.version)),
        ("uri", store.ref(m.run_id, m.version).uri),
        ("step", str(m.step)),
        ("created (UTC)", m.created_at.replace("T", " ").removesuffix("+00:00")),
        ("base model", m.base_model),
        ("rank", str(m.lora.get("rank", "-"))),
        ("alpha", str(m.lora.get("alpha", "-"))),
        ("target modules", ", ".join(m.lora.get("target_modules") or []) or "-"),
        ("metrics", ", ".join(f"{k}={v:.4g}" for k, v in sorted(m.metrics.items())) or "-"),
        ("tags", tags),
    ]
    for field, value in rows:
        table.add_row(field, value)
    return table


@adapters_app.command("show")
def show_adapter(
    spec: str = typer.Argument(..., help="RUN@VERSION, RUN@TAG, RUN@latest or RUN."),
    store: str = STORE_OPTION,
    storage_options: str | None = OPTIONS_OPTION,
    verify: bool = typer.Option(False, "--verify", help="Download the files and check sha256, format and config."),
) -> None:
    """Show one version: manifest details and a table of its files."""
    with _store_errors():
        adapter_store = _open_store(store, storage_options)
        ref = adapter_store.resolve(spec)
        manifest = adapter_store.manifest(ref.run_id, ref.version)
        files = Table("file", "size", "sha256")
        for name, entry in sorted(manifest.files.items()):
            files.add_row(name, _human_size(entry.size), entry.sha256)
        _print(_details_table(adapter_store, manifest), files)
        if verify:
            adapter_store.verify(ref.run_id, ref.version)
            _print(f"verified: {len(manifest.files)} files match their sha256; weights and config are well-formed")


@adapters_app.command("pull")
def pull_adapter(
    spec: str = typer.Argument(..., help="RUN@VERSION, RUN@TAG, RUN@latest or RUN."),
    store: str = STORE_OPTION,
    storage_options: str | None = OPTIONS_OPTION,
    out: Path = typer.Option(..., "--out", help="Folder to write the PEFT adapter into."),
) -> None:
    """Pull one adapter version into a local PEFT folder (sha256-verified) and print its path."""
    with _store_errors():
        adapter_store = _open_store(store, storage_options)
        ref = adapter_store.resolve(spec)
        path = adapter_store.pull(ref.run_id, ref.version, out)
        typer.echo(str(path))


@adapters_app.command("tag")
def tag_adapter(
    run: str = typer.Argument(..., help="Run id."),
    version: str = typer.Argument(..., help="Version number, existing tag, or 'latest'."),
    name: str = typer.Argument(..., help="Tag name, e.g. best or release."),
    store: str = STORE_OPTION,
    storage_options: str | None = OPTIONS_OPTION,
) -> None:
    """Point tag NAME of RUN at VERSION (moves the tag if it exists); RUN@NAME then resolves to it."""
    with _store_errors():
        adapter_store = _open_store(store, storage_options)
        ref = adapter_store.resolve(f"{run}@{version}")
        adapter_store.tag(ref.run_id, ref.version, name)
        typer.echo(f"tagged {ref.name} as {run}@{name}")


@adapters_app.command("untag")
def untag_adapter(
    run: str = typer.Argument(..., help="Run id."),
    name: str = typer.Argument(..., help="Tag name."),
    store: str = STORE_OPTION,
    storage_options: str | None = OPTIONS_OPTION,
) -> None:
    """Remove tag NAME from RUN."""
    with _store_errors():
        version = _open_store(store, storage_options).untag(run, name)
        typer.echo(f"removed tag {run}@{name} (was version {version})")


@adapters_app.command("gc")
def gc_adapters(
    run: str = typer.Argument(..., help="Run id."),
    keep_last: int = typer.Option(..., "--keep-last", help="Keep the newest K versions (>= 1)."),
    keep_every: int | None = typer.Option(None, "--keep-every", help="Also keep versions that are multiples of M."),
    keep_tags: bool = typer.Option(True, "--keep-tags/--no-keep-tags", help="Also keep tagged versions."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Only show what would be deleted."),
    store: str = STORE_OPTION,
    storage_options: str | None = OPTIONS_OPTION,
) -> None:
    """Delete the versions of RUN that the retention policy does not keep (never the newest)."""
    with _store_errors():
        adapter_store = _open_store(store, storage_options)
        policy = RetentionPolicy(keep_last=keep_last, keep_every=keep_every, keep_tags=keep_tags)
        plan = adapter_store.retention_plan(run, policy)
        if not plan:
            raise StoreError(f"run {run!r} has no complete adapter versions in {adapter_store.uri}")
        tags = _tags_by_version(adapter_store.tags(run))
        table = Table("version", "tags", "action")
        for version, why in plan.items():
            table.add_row(str(version), tags.get(version, "-"), f"keep ({why})" if why else "delete")
        deleted = adapter_store.gc(run, policy, dry_run=dry_run)
        verb = "would delete" if dry_run else "deleted"
        _print(table, f"{'dry run: ' if dry_run else ''}{verb} {len(deleted)} of {len(plan)} versions: {deleted}")
