"""The policy's adapter versions: publish the trainer's LoRA as an immutable version, sync it to the engines.

Version `k` is the adapter after training step `k` (version 0: the fresh, no-op LoRA). Rollouts of step
`k + 1` name version `k` explicitly (`<run>-v<NNNNNN>`), so every completion records the version that
produced it. The hot-swap protocol itself (load under a new name, verify, switch, retire what no request
holds) is `lora_rl_core.subscriber.sync_version`; docs/HOTSWAP.md describes it.
"""

from __future__ import annotations

from typing import Any

from lora_rl_core.adapters import adapter_name
from lora_rl_core.errors import EngineError, LoraRLError
from lora_rl_core.faults import maybe_fail
from lora_rl_core.records import SyncStats
from lora_rl_core.run.components import RunComponents
from lora_rl_core.store import AdapterRef
from lora_rl_core.subscriber import sync_version


def policy_adapter(run: RunComponents) -> str:
    """The versioned adapter name rollouts must use.

    Raises:
        LoraRLError: no version has been synced yet.
    """
    if run.policy.version is None:
        raise LoraRLError("no adapter version has been synced to the engine yet (publish and sync version 0 first)")
    return adapter_name(run.run_id, run.policy.version)


def publish(run: RunComponents, step: int, metrics: dict[str, Any] | None = None) -> AdapterRef:
    """Write the trainer's current LoRA weights to the store as version `step` (immutable; a retry of the
    same step finds the identical version and returns it). Numeric `metrics` go into the manifest."""
    tensors, config = run.trainer.adapter_state()
    ref = run.store.publish(
        run.run_id,
        step,
        tensors=tensors,
        adapter_config=config,
        step=step,
        base_model=run.cfg.model.name_or_path,
        metrics={k: float(v) for k, v in (metrics or {}).items() if isinstance(v, int | float)},
        # fault injection fires with the data files written and the manifest not yet: the worst moment
        before_manifest=lambda: maybe_fail("publish_adapter", step, run.run_dir),
    )
    run.policy.pending = (tensors, config)
    return ref


def sync(run: RunComponents, ref: AdapterRef) -> SyncStats:
    """Make version `ref` the one rollouts use: every engine loads it under its versioned name (tensor path:
    the tensors just published; store path: the engines read the sha256-verified version from the store),
    lists it, and retires versions beyond `max_staleness + 1` that no request holds.

    A version that fails verification or loading is skipped: the previous version stays active. A version
    older than the one serving (a replayed task) changes nothing.

    Raises:
        EngineError: the version failed and no earlier version is serving.
    """
    if run.policy.version is not None and ref.version < run.policy.version:
        return SyncStats(adapter=policy_adapter(run), skipped_older=True)
    pending = run.policy.pending if run.cfg.engine.sync == "tensor" else None
    # Rollouts hold only the version current when they start; a version held now stays protected, and one
    # taken during this sync is the serving one, always inside the `keep` window (max_staleness + 1 >= 2 in
    # async mode), so the protocol never retires a version that queued rollouts still use.
    held = {adapter_name(run.run_id, v) for v in run.policy.held()}
    result = sync_version(
        run.engine,
        ref,
        tensors=pending[0] if pending else None,
        config=pending[1] if pending else None,
        store=run.store,
        keep=run.cfg.algorithm.max_staleness + 1,
        protect=held,
    )
    run.policy.pending = None
    if not result.ok:
        if run.policy.version is None:
            raise EngineError(f"sync of {ref.name} failed and no earlier version is serving: {result.error}")
        return SyncStats(adapter=policy_adapter(run), skipped=ref.name, error=result.error, sync_seconds=result.seconds)
    run.policy.switch(ref.version)
    return SyncStats(adapter=ref.name, retired=result.retired, sync_seconds=result.seconds, sync_path=result.path)
