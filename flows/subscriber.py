"""`adapter-subscriber`: keep inference engines on a run's newest adapter versions, as a Prefect flow.

Thin: builds the store and the HTTP engine clients, then runs
`lora_rl_core.subscriber.AdapterSubscriber` (load each new version under its versioned name,
verify it, mark it active, retire versions beyond the keep window; never unload while paused)
until `max_seconds` pass or the flow run is cancelled. Each sync is logged to the run.
"""

from __future__ import annotations

import threading
from typing import Any

from prefect import flow, get_run_logger

from lora_rl_core.engines.http import connect_engines
from lora_rl_core.store import AdapterStore
from lora_rl_core.subscriber import AdapterSubscriber, SyncResult


@flow(name="adapter-subscriber")
def adapter_subscriber(
    store_uri: str,
    run_id: str,
    engine_urls: list[str],
    api_key: str | None = None,
    keep: int = 2,
    poll_interval_s: float = 5,
    max_seconds: float | None = None,
    engine_kind: str = "server",
) -> dict[str, Any]:
    """Follow `run_id` in the store at `store_uri` and sync every new version to the engines.

    Args:
        engine_urls: engine servers (`lora-rl serve`) or SGLang servers (`engine_kind="sglang"`).
        api_key: Bearer key of the engines' control endpoints.
        keep: versions kept loaded per engine (`max_staleness + 1`).
        poll_interval_s: seconds between store polls.
        max_seconds: stop after this long (None = until cancelled).

    Returns:
        {"active": active adapter name or None, "synced": [names], "skipped": {version: reason}}.
    """
    logger = get_run_logger()

    def on_sync(result: SyncResult) -> None:
        (logger.info if result.ok else logger.warning)(result.summary())

    engines = connect_engines(engine_kind, engine_urls, api_key=api_key)
    subscriber = AdapterSubscriber(
        AdapterStore(store_uri), run_id, engines, keep=keep, poll_interval_s=poll_interval_s, on_sync=on_sync
    )
    logger.info(f"following {run_id} in {store_uri} for {len(engine_urls)} engine(s), keep {keep}")
    try:
        results = subscriber.run(threading.Event(), max_seconds=max_seconds)
    finally:
        engines.close()
    return {
        "active": subscriber.active.name if subscriber.active else None,
        "synced": [r.name for r in results if r.ok],
        "skipped": {str(v): reason for v, reason in subscriber.skipped.items()},
    }
