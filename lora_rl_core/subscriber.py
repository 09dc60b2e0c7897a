"""Keep inference engines on a run's newest adapter versions (the hot-swap protocol, docs/HOTSWAP.md).

`sync_version` is the one piece of code that moves a published version into engines; the
training flow's `sync` and the long-running `AdapterSubscriber` both call it:

1. load the version under its versioned name `<run>-vNNNNNN` on every engine: from tensors
   (the tensor path: in-process, or same-host HTTP as safetensors bytes) or from the store
   (the store path: the engine reads `ref.uri`; the version is sha256-verified in the store first);
2. check every engine lists it, and that the sha256 an engine reports (our engine server does)
   equals the store's checksum;
3. mark it active (the caller switches rollouts to it only after this succeeds);
4. retire the run's versions beyond the `keep` newest that no request uses, except the active
   one, and never on an engine that reports generation paused: SGLang's unload waits for
   reference counts that paused or aborted requests may never release (sglang#36894, miles#2780).

With `bounded=True` (the subscriber) step 4 comes first and drains: before the new version loads, the run's
versions beyond the `keep - 1` newest are retired even while requests use them (the engine refuses new
requests for a retired name and unloads it once its requests have ended), so an engine never holds more
than `keep` versions of the run, however long the run and whatever its clients do.

A version that fails (corrupt in the store, refused by an engine, wrong checksum) is skipped
with its reason and unloaded where it got loaded; the previous active version keeps serving.
A version that fails because an engine cannot be reached is retried at the next poll.

Left out: coordinating several subscribers of one run (run one per engine pool) and
persisting the active version (a restarted subscriber re-adopts the newest `keep` versions).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

from lora_rl_core.adapters import adapter_name, adapter_run, adapter_version, validate_run_id
from lora_rl_core.config import REMOTE_ENGINE_KINDS, RemoteEngineKind
from lora_rl_core.errors import ConfigError, EngineError, EngineUnavailable, LoraRLError, StoreError
from lora_rl_core.store import AdapterRef, AdapterStore

if TYPE_CHECKING:  # the engines package loads transformers and peft: keep `lora-rl` start-up light
    from lora_rl_core.engines.base import RolloutEngine

log = logging.getLogger(__name__)


@dataclass
class SyncResult:
    """What one sync of one adapter version did.

    Attributes:
        name, version: the adapter (`<run>-vNNNNNN`).
        ok: loaded and verified on every engine; it is now the active version.
        path: `tensor` or `store`.
        engines: how many engines were synced.
        retired: adapter names unloaded because they left the keep window.
        error: why it is not ok; None when ok.
        retryable: the failure was an unreachable engine, so the version is tried again later.
        seconds: wall time of the sync.
    """

    name: str
    version: int
    ok: bool
    path: str
    engines: int
    retired: list[str] = field(default_factory=list)
    error: str | None = None
    retryable: bool = False
    seconds: float = 0.0

    def summary(self) -> str:
        """One log line, e.g. `synced r-v000003 to 2 engines via store in 0.41 s; retired [...]`."""
        if self.ok:
            return (
                f"synced {self.name} to {self.engines} engine(s) via {self.path} in {self.seconds:.2f} s; "
                f"retired {self.retired or 'none'}"
            )
        again = "will retry" if self.retryable else "skipped; the previous version stays active"
        return f"{self.name} not synced ({again}): {self.error}"


KEEP_VERSIONS = 2
"""Default versions of a run kept loaded per engine (`max_staleness + 1` for the default max_staleness 1)."""
POLL_INTERVAL_S = 5.0
"""Default seconds between store polls."""
ENGINE_KIND: RemoteEngineKind = "server"
"""Default `engine.type` of the engines followed: `server` (`lora-rl serve`) or `sglang` (a real SGLang server)."""


def engine_list(engines: RolloutEngine | Sequence[RolloutEngine]) -> list[RolloutEngine]:
    """One engine, a sequence of engines, or a `MultiEngine` as a flat list of single engines (`members()`)."""
    items = list(engines) if isinstance(engines, Sequence) else [engines]
    return [member for engine in items for member in engine.members()]


def sync_version(
    engines: RolloutEngine | Sequence[RolloutEngine],
    ref: AdapterRef,
    *,
    tensors: dict | None = None,
    config: dict | None = None,
    checksum: Callable[[], str | None] | None = None,
    store: AdapterStore | None = None,
    keep: int,
    protect: Collection[str] = (),
    bounded: bool = False,
) -> SyncResult:
    """Load `ref` on every engine, verify it, and retire stale versions of its run.

    Args:
        engines: one engine, a list, or a `MultiEngine`.
        ref: the published version.
        tensors, config: the tensor path (PEFT state dict + config); None = the store path.
        checksum: where `ref.sha256` is None (a version still being serialised), gives the sha256 an engine's
            reported checksum must equal; called only for an engine that reports one.
        store: on the store path, the version is sha256-verified here before engines read it.
        keep: versions of the run kept loaded (`max_staleness + 1`), >= 1.
        protect: adapter names never retired by this sync (e.g. versions that queued rollouts hold), besides
            `ref` itself and what engines report in flight.
        bounded: retire first, down to `keep - 1` versions, draining the ones in use (`retire_stale(...,
            drain=True)`), so at most `keep` versions of the run are ever loaded; needs `keep >= 2` (the
            serving version stays loaded while the next one loads).

    Returns:
        A `SyncResult`; `ok` is False (with `error`) instead of raising for adapter problems.
    """
    if keep < 1 + bounded:
        raise LoraRLError(f"keep must be >= {1 + bounded}{' to bound residency' if bounded else ''}, got {keep}")
    start = time.perf_counter()
    engines = engine_list(engines)
    result = SyncResult(ref.name, ref.version, False, "tensor" if tensors is not None else "store", len(engines))
    try:
        if tensors is None and store is not None:
            store.verify(ref.run_id, ref.version)  # sizes, sha256, format: StoreError names the bad object
        if bounded:
            result.retired = retire_stale(engines, ref.run_id, keep=keep - 1, protect=protect, drain=True)
            _check_room(engines, ref, keep)
        for engine in engines:
            _load_verified(engine, ref, tensors, config, checksum)
    except LoraRLError as exc:
        result.error = " ".join(str(exc).split())
        result.retryable = _unreachable(exc)
        if not result.retryable:
            _discard(engines, ref.name)
    else:
        result.ok = True
        if not bounded:
            result.retired = retire_stale(engines, ref.run_id, keep=keep, protect={ref.name, *protect})
    result.seconds = time.perf_counter() - start
    return result


def _check_room(engines: list[RolloutEngine], ref: AdapterRef, keep: int) -> None:
    """Before a bounded load: every engine holds at most `keep - 1` versions of the run.

    Raises:
        EngineUnavailable: one holds more (a version still draining, pinned or protected); retried later.
    """
    for engine in engines:
        held = [n for n in engine.list_adapters() if adapter_run(n) == ref.run_id and n != ref.name]
        if len(held) >= keep:
            raise EngineUnavailable(
                f"{engine!r} still holds {len(held)} versions of {ref.run_id} ({', '.join(sorted(held))}); "
                f"{ref.name} waits until at most {keep - 1} are left (keep={keep})"
            )


def _load_verified(
    engine: RolloutEngine,
    ref: AdapterRef,
    tensors: dict | None,
    config: dict | None,
    checksum: Callable[[], str | None] | None,
) -> None:
    """Load `ref.name` unless listed already, then check the listing (and the sha256 where reported)."""
    if ref.name not in engine.list_adapters():
        if tensors is not None:  # the published folder is the fallback of an engine that cannot take tensors
            engine.load_adapter(ref.name, tensors=tensors, config=config, path=ref.uri)
        else:
            engine.load_adapter(ref.name, path=ref.uri)
    info = engine.list_adapters().get(ref.name)
    if info is None:
        raise EngineError(f"{engine!r} does not list {ref.name} after loading it")
    reported = info.get("sha256")
    expected = ref.sha256 or (checksum() if reported and checksum else None)
    if reported and expected and reported != expected:
        raise EngineError(
            f"{engine!r} holds {ref.name} with sha256 {reported}, but the version's adapter_model.safetensors has "
            f"{expected}: the engine loaded other weights"
        )


def _unreachable(exc: Exception) -> bool:
    return isinstance(exc, EngineUnavailable)


def _discard(engines: list[RolloutEngine], name: str) -> None:
    """Unload a failed version wherever it got loaded (never while paused); failures are logged."""
    for engine in engines:
        try:
            if name in engine.list_adapters() and not is_paused(engine):
                engine.unload_adapter(name)
        except LoraRLError as exc:
            log.warning("could not unload failed version %s from %r: %s", name, engine, exc)


def is_paused(engine: RolloutEngine) -> bool:
    """`engine.is_paused()`, True when it cannot say (then nothing is unloaded there). Not `health()`: on
    SGLang that runs a 1-token generation, a second per sync and engine (docs/HOTSWAP.md)."""
    try:
        return bool(engine.is_paused())
    except LoraRLError:
        return True


def retire_stale(
    engines: RolloutEngine | Sequence[RolloutEngine],
    run_id: str,
    *,
    keep: int,
    protect: Collection[str] = (),
    drain: bool = False,
) -> list[str]:
    """Unload `run_id`'s versions older than its `keep` newest on each engine, except `protect`ed,
    pinned and in-flight ones; engines that report paused are skipped entirely.

    With `drain`, in-flight versions are unloaded too: the engine's unload refuses new requests for the name
    at once and waits (up to its deadline) until the requests using it have ended (`unload_adapter`); one
    that does not drain in time is logged and stays loaded (and refused) for a later retire.

    Returns:
        The adapter names unloaded (each once).
    """
    retired: list[str] = []
    for engine in engine_list(engines):
        if is_paused(engine):
            log.info("generation is paused on %r: retiring nothing there", engine)
            continue
        for name in _retire_on(engine, run_id, keep, protect, drain):
            if name not in retired:
                retired.append(name)
    return retired


def _retire_on(engine: RolloutEngine, run_id: str, keep: int, protect: Collection[str], drain: bool) -> list[str]:
    listed = engine.list_adapters()
    mine = sorted((n for n in listed if adapter_run(n) == run_id), key=lambda n: adapter_version(n) or 0)
    stale = [n for n in mine[: max(0, len(mine) - keep)] if n not in protect]
    done = []
    for name in stale:
        if (listed[name].get("in_flight") and not drain) or listed[name].get("pinned"):
            continue  # still referenced (or pinned on purpose): a later poll retires it
        try:
            engine.unload_adapter(name)
            done.append(name)
        except LoraRLError as exc:
            log.warning("could not retire %s on %r: %s", name, engine, exc)
    return done


class AdapterSubscriber:
    """Watch a run in the store and keep engines on its newest versions.

    Args:
        store: the adapter store.
        run_id: the run to follow.
        engines: one engine, a list, or a `MultiEngine`.
        keep: versions kept loaded, at most, at any time (>= 2): before a new version loads, the oldest
            beyond `keep - 1` is retired and drained (`sync_version(..., bounded=True)`).
        poll_interval_s: seconds between polls in `run`.
        on_sync: called with each `SyncResult` (logging, UI).

    Attributes:
        active: the ref of the version engines serve as current, or None before the first sync.
        skipped: version -> reason, for versions that will not be tried again.
    """

    def __init__(
        self,
        store: AdapterStore,
        run_id: str,
        engines: RolloutEngine | Sequence[RolloutEngine],
        *,
        keep: int = KEEP_VERSIONS,
        poll_interval_s: float = POLL_INTERVAL_S,
        on_sync: Callable[[SyncResult], None] | None = None,
    ) -> None:
        if keep < 2:
            raise LoraRLError(f"keep must be >= 2 (the serving version stays loaded while the next loads), got {keep}")
        self.store = store
        self.run_id = validate_run_id(run_id)
        self.engines = engine_list(engines)
        self.keep = keep
        self.poll_interval_s = poll_interval_s
        self.on_sync = on_sync
        self.active: AdapterRef | None = None
        self.skipped: dict[int, str] = {}

    def poll_once(self) -> list[SyncResult]:
        """Sync the versions newer than the active one (at most the newest `keep`: older ones would be
        retired at once), in order; with nothing new, retire what has become unreferenced.

        Raises:
            StoreError: the store cannot be listed.
        """
        results = [self._sync(version) for version in self._pending()]
        if self.active is not None and not any(r.ok for r in results):
            retire_stale(self.engines, self.run_id, keep=self.keep, protect={self.active.name})
        return results

    def _pending(self) -> list[int]:
        floor = self.active.version if self.active is not None else -1
        todo = [v for v in self.store.versions(self.run_id) if v > floor and v not in self.skipped]
        return todo[-self.keep :]

    def _sync(self, version: int) -> SyncResult:
        try:
            ref = self.store.ref(self.run_id, version)
        except StoreError as exc:
            name = adapter_name(self.run_id, version)
            result = SyncResult(name, version, False, "store", len(self.engines), error=str(exc))
        else:
            result = sync_version(self.engines, ref, store=self.store, keep=self.keep, bounded=True)
            if result.ok:
                self.active = ref
        if not result.ok and not result.retryable:
            self.skipped[version] = result.error or "failed"
        (log.info if result.ok else log.warning)("%s", result.summary())
        if self.on_sync is not None:
            self.on_sync(result)
        return result

    def run(self, stop: threading.Event, max_seconds: float | None = None) -> list[SyncResult]:
        """Poll every `poll_interval_s` until `stop` is set or `max_seconds` pass.

        A failed poll (store or engine unreachable) is logged and retried at the next one.

        Returns:
            Every `SyncResult` of the run, in order.
        """
        deadline = None if max_seconds is None else time.monotonic() + max_seconds
        results: list[SyncResult] = []
        while not stop.is_set():
            try:
                results += self.poll_once()
            except Exception:  # a long-running watcher survives one bad poll; the next one retries
                log.exception(
                    "polling %s in %s failed; retrying in %g s", self.run_id, self.store, self.poll_interval_s
                )
            wait = self.poll_interval_s
            if deadline is not None:
                wait = min(wait, deadline - time.monotonic())
                if wait <= 0:
                    break
            stop.wait(wait)
        return results


@contextmanager
def open_subscriber(
    store_uri: str,
    run_id: str,
    engine_urls: Sequence[str],
    *,
    engine_kind: str = ENGINE_KIND,
    api_key: str | None = None,
    keep: int = KEEP_VERSIONS,
    poll_interval_s: float = POLL_INTERVAL_S,
    on_sync: Callable[[SyncResult], None] | None = None,
) -> Iterator[AdapterSubscriber]:
    """An `AdapterSubscriber` of `run_id` in the store at `store_uri` for the HTTP engines at `engine_urls`
    (`lora-rl subscribe` and the `adapter-subscriber` flow), built by the engine registry as `engine.type`
    `engine_kind` with those URLs; their connections close on exit.

    Args:
        engine_kind: `server` (`lora-rl serve`) or `sglang` (a real SGLang server), as `engine.type`.
        api_key: Bearer key of the engines' control endpoints.
        keep, poll_interval_s, on_sync: as `AdapterSubscriber`.

    Raises:
        ConfigError: an engine kind that is not a remote one.
        EngineError: no URLs or a malformed URL.
        StoreError: a bad store URI; LoraRLError: a bad run id or keep.
    """
    from lora_rl_core.config import ServerEngineConfig, SGLangEngineConfig
    from lora_rl_core.engines.records import EngineInputs
    from lora_rl_core.engines.registry import build_engine  # lazy: keeps httpx out of in-process use

    if engine_kind not in REMOTE_ENGINE_KINDS:
        raise ConfigError(f"engine kind must be one of {list(REMOTE_ENGINE_KINDS)}, got {engine_kind!r}")
    kind = cast(RemoteEngineKind, engine_kind)
    section = ServerEngineConfig if kind == "server" else SGLangEngineConfig
    engine_cfg = section.model_construct(urls=tuple(engine_urls))  # no urls: connect says so
    built = build_engine(EngineInputs(engine_cfg, api_key=api_key))
    try:
        store = AdapterStore(store_uri)
        yield AdapterSubscriber(
            store, run_id, built.engine, keep=keep, poll_interval_s=poll_interval_s, on_sync=on_sync
        )
    finally:
        built.close()
