"""`adapter-subscriber`: keep inference engines on a run's newest adapter versions, as a Prefect flow.

Thin: `lora_rl_core.subscriber.open_subscriber` builds the store and the HTTP engine clients, and its
`AdapterSubscriber` runs (load each new version under its versioned name, verify it, mark it active,
retire versions beyond the keep window; never unload while paused) until `max_seconds` pass or the
flow run is cancelled. Each sync is logged to the run.
"""

from __future__ import annotations

import threading
from typing import Any

from prefect import flow, get_run_logger

from lora_rl_core.subscriber import ENGINE_KIND, KEEP_VERSIONS, POLL_INTERVAL_S, SyncResult, open_subscriber


@flow(name="adapter-subscriber")
def adapter_subscriber(
    store_uri: str,
    run_id: str,
    engine_urls: list[str],
    api_key: str | None = None,
    keep: int = KEEP_VERSIONS,
    poll_interval_s: float = POLL_INTERVAL_S,
    max_seconds: float | None = None,
    engine_kind: str = ENGINE_KIND,
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

    with open_subscriber(
        store_uri,
        run_id,
        engine_urls,
        engine_kind=engine_kind,
        api_key=api_key,
        keep=keep,
        poll_interval_s=poll_interval_s,
        on_sync=on_sync,
    ) as sub:
        logger.info(f"following {run_id} in {store_uri} for {len(engine_urls)} engine(s), keep {keep}")
        results = sub.run(threading.Event(), max_seconds=max_seconds)
    return {
        "active": sub.active.name if sub.active else None,
        "synced": [r.name for r in results if r.ok],
        "skipped": {str(v): reason for v, reason in sub.skipped.items()},
    }
