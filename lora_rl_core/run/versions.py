"""The policy's adapter versions: publish the trainer's LoRA as an immutable version, sync it to the engines.

Version `k` is the adapter after training step `k` (version 0: the fresh, no-op LoRA). Rollouts of step
`k + 1` name version `k` explicitly (`<run>-v<NNNNNN>`), so every completion records the version that
produced it. The hot-swap protocol itself (load under a new name, verify, switch, retire what no request
holds) is `lora_rl_core.subscriber.sync_version`; docs/HOTSWAP.md describes it.

Publishing is split in two (docs/DESIGN.md, "Publish and checkpoint in the background"): `publish` takes the
trainer's adapter now and checks it (finite, matching its config), then hands its serialisation (safetensors
bytes, sha256) and its store write to the run's `StoreWriter`, and returns the version's ref without a
checksum yet; `sync` gives the engines the in-memory tensors without waiting for either, unless the engines
read the version from the store (`engine.sync: store`, or an SGLang tensor transport that loads the published
folder): then it waits for the write first. An engine that reports the checksum of what it loaded (our
server) is checked against the version's serialised bytes (`PublishedVersion.checksum`: the writer's once it
has serialised them, else hashed there). `flush` waits for every write and raises a failed one.
"""

from __future__ import annotations

import functools
from concurrent.futures import Future
from typing import Any

from lora_rl_core.adapters import adapter_name
from lora_rl_core.errors import EngineError, LoraRLError, StoreError
from lora_rl_core.faults import maybe_fail
from lora_rl_core.records import SyncStats
from lora_rl_core.run.checkpoints import commit_checkpoints
from lora_rl_core.run.components import RunComponents
from lora_rl_core.run.state import PublishedVersion
from lora_rl_core.store import AdapterRef, PreparedVersion
from lora_rl_core.subscriber import SyncResult, sync_version


def policy_adapter(run: RunComponents) -> str:
    """The versioned adapter name rollouts must use.

    Raises:
        LoraRLError: no version has been synced yet.
    """
    if run.policy.version is None:
        raise LoraRLError("no adapter version has been synced to the engine yet (publish and sync version 0 first)")
    return adapter_name(run.run_id, run.policy.version)


def publish(run: RunComponents, step: int, metrics: dict[str, Any] | None = None) -> AdapterRef:
    """Publish the trainer's current LoRA weights as version `step`: taken and checked now, serialised and
    written to the store by the run's writer (in the background with `trainer.background_publish`; the version
    becomes visible once complete, its manifest last). Numeric `metrics` go into the manifest.

    On a resumed run, a version the store held when the run opened is returned as stored (versions are
    immutable); a retry of the same step finds the identical version.

    Returns:
        The version's ref: with `background_publish`, returned before the version is serialised, so its
        `sha256` is None (the manifest has it once written); without, complete.

    Raises:
        BackgroundWriteError: an earlier background write failed.
        StoreError: non-finite or malformed tensors; a version the trainer is past is missing from the store;
            without `background_publish`, the write failed.
    """
    run.writer.check()
    newest = run.restored.newest_version
    if newest is not None and step <= newest:
        return run.store.ref(run.run_id, step)
    if step < run.restored.step:
        raise StoreError(
            f"version {step} of run {run.run_id} is missing from the store, but the trainer was restored from the "
            f"checkpoint of step {run.restored.step}, past it: it cannot be published again"
        )
    tensors, config = run.trainer.adapter_state()
    run.store.check(tensors, config)  # before any engine gets them; serialising (~0.5 s at 7B) waits
    ref = run.store.unwritten_ref(run.run_id, step)
    scalars = {k: float(v) for k, v in (metrics or {}).items() if isinstance(v, int | float)}
    prepared: Future[AdapterRef] = Future()
    write = functools.partial(_prepare_and_write, run, step, tensors, config, scalars, prepared)
    stored = run.writer.submit(f"adapter version {ref.name}", write)
    stored.add_done_callback(lambda done: _settle(prepared, done))
    run.policy.pending = PublishedVersion(ref, tensors, config, prepared, stored)
    return ref if run.writer.background else stored.result()  # written inline: complete


def _prepare_and_write(
    run: RunComponents,
    step: int,
    tensors: dict[str, Any],
    config: dict[str, Any],
    metrics: dict[str, float],
    prepared: Future[AdapterRef],
) -> AdapterRef:
    """Serialise version `step` (`prepared` gets its complete ref), then write it: the writer's job."""
    version: PreparedVersion = run.store.prepare(
        run.run_id,
        step,
        tensors=tensors,
        adapter_config=config,
        step=step,
        base_model=run.cfg.model.name_or_path,
        metrics=metrics,
    )
    prepared.set_result(version.ref)
    # fault injection fires with the data files written and the manifest not yet: the worst moment
    return run.store.write(version, before_manifest=lambda: maybe_fail("publish", step, run.run_dir))


def _settle(prepared: Future[AdapterRef], stored: Future[AdapterRef]) -> None:
    """A write that failed (or never ran) before serialising fails `prepared` too, so nobody waits on it."""
    if not prepared.done() and stored.exception() is not None:
        prepared.set_exception(stored.exception())


def sync(run: RunComponents, ref: AdapterRef) -> SyncStats:
    """Make version `ref` the one rollouts use: every engine loads it under its versioned name (tensor path:
    the tensors just published, not waiting for their write to the store; store path: the engines read the
    sha256-verified version from the store, once its write is done), lists it, and retires versions beyond
    `max_staleness + 1` that no request holds.

    A version that fails verification or loading is skipped: the previous version stays active. A version
    older than the one serving (a replayed task) changes nothing.

    Raises:
        EngineError: the version failed and no earlier version is serving.
        BackgroundWriteError: the engines read the store and writing the version there failed.
    """
    if run.policy.version is not None and ref.version < run.policy.version:
        return SyncStats(adapter=policy_adapter(run), skipped_older=True)
    pending = run.policy.pending if run.policy.pending and run.policy.pending.ref.name == ref.name else None
    tensor_path = pending is not None and run.cfg.engine.sync == "tensor"
    if pending is not None and (not tensor_path or run.plan.engine.sync_reads_folder):
        ref = pending.stored.result()  # complete, sha256 included
    result = _sync_version(run, ref, pending, tensors=tensor_path)
    if not result.ok and pending is not None and tensor_path and not pending.stored.done():
        # an engine that refuses tensors falls back to the published folder (SGLang): once it is stored
        ref = pending.stored.result()
        result = _sync_version(run, ref, pending, tensors=True)
    run.policy.pending = None
    if not result.ok:
        if run.policy.version is None:
            raise EngineError(f"sync of {ref.name} failed and no earlier version is serving: {result.error}")
        return SyncStats(adapter=policy_adapter(run), skipped=ref.name, error=result.error, sync_seconds=result.seconds)
    run.policy.switch(ref.version)
    return SyncStats(adapter=ref.name, retired=result.retired, sync_seconds=result.seconds, sync_path=result.path)


def _sync_version(
    run: RunComponents, ref: AdapterRef, pending: PublishedVersion | None, *, tensors: bool
) -> SyncResult:
    """`sync_version` of `ref`: from `pending`'s tensors (`tensors`), or from the store. An engine that reports
    a checksum is checked against `pending`'s serialised bytes (waiting for them) where `ref` has none yet."""
    # Rollouts hold only the version current when they start; a version held now stays protected, and one
    # taken during this sync is the serving one, always inside the `keep` window (max_staleness + 1 >= 2 in
    # async mode), so the protocol never retires a version that queued rollouts still use.
    held = {adapter_name(run.run_id, v) for v in run.policy.held()}
    return sync_version(
        run.engine,
        ref,
        tensors=pending.tensors if pending and tensors else None,
        config=pending.config if pending and tensors else None,
        checksum=pending.checksum if pending else None,
        store=run.store,
        keep=run.cfg.algorithm.max_staleness + 1,
        protect=held,
    )


def flush(run: RunComponents) -> None:
    """Wait until every train record, checkpoint and version of the run is in the store: the trainer's ranks'
    checkpoint writes first (`commit_checkpoints`), then what the run's writer holds.

    Raises:
        BackgroundWriteError: one of them failed (naming it and the cause).
    """
    try:
        commit_checkpoints(run, wait=True)
    finally:
        run.writer.flush()
