"""The engine server's Prometheus metrics: `engine.metrics()` read at scrape time, names prefixed `lora_rl_`.

`EngineCollector` turns the `EmbeddedEngine` metrics shape into metric families on every scrape (no state
kept here); `server_registry` gives each app its own `CollectorRegistry` with the collector and the adapter
load latency histogram that the adapter routes (`serve.adapters`) observe. `HTTPEngine.metrics` (our server's dialect)
(`remote.wire.parse_metrics`) reads these names back.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from lora_rl_core.adapters import adapter_run, adapter_version
from lora_rl_core.engines.base import ServingEngine

LOAD_LATENCY_BUCKETS_S = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)

_ADAPTER_METRICS = {  # engine.metrics()["adapters"][name] key -> (counter?, metric name, help)
    "requests": (True, "lora_rl_adapter_requests", "Completions served, per adapter."),
    "tokens": (True, "lora_rl_adapter_tokens", "Completion tokens generated, per adapter."),
    "loads": (True, "lora_rl_adapter_loads", "Loads (including reloads after eviction), per adapter."),
    "evictions": (True, "lora_rl_adapter_evictions", "Evictions from the adapter pool, per adapter."),
    "load_seconds_total": (True, "lora_rl_adapter_load_seconds", "Seconds spent loading, per adapter."),
    "in_flight": (False, "lora_rl_adapter_in_flight", "Requests running or queued, per adapter."),
    "resident": (False, "lora_rl_adapter_resident", "1 when the adapter's weights are resident."),
    "pinned": (False, "lora_rl_adapter_pinned", "1 when the adapter is pinned (never evicted)."),
    "version": (False, "lora_rl_adapter_version", "The adapter's version number."),
}


class EngineCollector:
    """Prometheus collector reading `engine.metrics()` (the `EmbeddedEngine` shape) at scrape time.

    Per adapter (label `adapter`; the base model is `__base__`): requests, tokens, loads, evictions, load
    seconds, in-flight, resident, pinned, version. Per run: the newest loaded version. Engine-wide: queue
    depth, running requests, paused, batches, unloads, aborted requests by reason.
    """

    def __init__(self, engine: ServingEngine) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        """Yield the metric families (read fresh from the engine on every scrape)."""
        metrics = self.engine.metrics()
        adapters = dict(metrics.get("adapters") or {})
        if isinstance(metrics.get("base"), dict):
            adapters["__base__"] = metrics["base"]
        for key, (counter, name, doc) in _ADAPTER_METRICS.items():
            family = (CounterMetricFamily if counter else GaugeMetricFamily)(name, doc, labels=["adapter"])
            for adapter, info in adapters.items():
                if isinstance(info.get(key), int | float | bool):
                    family.add_metric([adapter], float(info[key]))
            yield family
        yield _active_versions(self.engine.list_adapters())
        yield from _engine_families(metrics)


def _engine_families(metrics: dict[str, Any]) -> Iterator[Metric]:
    for key in ("queue_depth", "running", "paused", "resident"):
        if isinstance(metrics.get(key), int | float | bool):
            yield GaugeMetricFamily(f"lora_rl_engine_{key}", f"Engine {key}.", value=float(metrics[key]))
    for key in ("batches", "unloads"):
        if isinstance(metrics.get(key), int | float):
            yield CounterMetricFamily(f"lora_rl_engine_{key}", f"Engine {key}.", value=float(metrics[key]))
    aborted = CounterMetricFamily("lora_rl_engine_aborted", "Requests aborted, by reason.", labels=["reason"])
    for reason, count in sorted((metrics.get("aborted") or {}).items()):
        aborted.add_metric([reason], float(count))
    yield aborted


def _active_versions(adapters: dict[str, Any]) -> GaugeMetricFamily:
    """Newest loaded version per run (versioned adapter names only)."""
    family = GaugeMetricFamily("lora_rl_active_version", "Newest loaded adapter version, per run.", labels=["run"])
    newest: dict[str, int] = {}
    for name in adapters:
        run, version = adapter_run(name), adapter_version(name)
        if run is not None and version is not None:
            newest[run] = max(version, newest.get(run, version))
    for run, version in sorted(newest.items()):
        family.add_metric([run], float(version))
    return family


def server_registry(engine: ServingEngine) -> tuple[CollectorRegistry, Histogram]:
    """A fresh registry with an `EngineCollector` over `engine`, and the histogram of adapter load wall
    times over HTTP in seconds (`lora_rl_adapter_load_latency_seconds`, label `source`: path or tensors)."""
    registry = CollectorRegistry()
    registry.register(EngineCollector(engine))
    load_seconds = Histogram(
        "lora_rl_adapter_load_latency_seconds",
        "Wall time of adapter loads over HTTP, by source (path or tensors).",
        ["source"],
        registry=registry,
        buckets=LOAD_LATENCY_BUCKETS_S,
    )
    return registry, load_seconds
