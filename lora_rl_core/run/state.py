"""What a run holds between phases: the policy version rollouts use (`PolicyState`), the last published version
in memory (`PublishedVersion`), what the run resumed from (`Restored`) and the checkpoints its trainer's ranks
are writing (`PendingCheckpoint`)."""

from __future__ import annotations

import hashlib
import threading
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from lora_rl_core.adapters import safetensors_bytes
from lora_rl_core.errors import LoraRLError
from lora_rl_core.store import AdapterRef


@dataclass(frozen=True)
class PublishedVersion:
    """The last published version as the trainer made it, for the tensor sync path, and its write to the store.

    Attributes:
        ref: the ref `versions.publish` returned (`sha256` None while the version is not serialised yet).
        tensors / config: its PEFT-keyed CPU tensors (a copy: later train steps do not change them) and its
            PEFT config.
        prepared: the complete ref (sha256 included) once the background write has serialised the version.
        stored: the complete ref once the version is in the store (`StoreWriter.submit`). Both raise
            `BackgroundWriteError` from `result()` if the write failed.
    """

    ref: AdapterRef
    tensors: dict[str, torch.Tensor]
    config: dict[str, Any]
    prepared: Future[AdapterRef]
    stored: Future[AdapterRef]

    def checksum(self) -> str | None:
        """The sha256 of the version's safetensors bytes: the background write's once it has serialised them,
        else computed here (serialising is deterministic) rather than waiting behind the step's checkpoint.

        Raises:
            BackgroundWriteError: the version's write failed.
        """
        if self.prepared.done():  # a write that failed before serialising failed `prepared` too
            return self.prepared.result().sha256
        if self.stored.done():
            return self.stored.result().sha256
        return hashlib.sha256(safetensors_bytes(self.tensors)).hexdigest()


@dataclass
class PendingCheckpoint:
    """A checkpoint the trainer's ranks are writing (`lora_rl_core.run.checkpoints.start_checkpoint`).

    Attributes:
        state: the run's own part (its step, rollout mode and RNG states), taken when the step trained.
        files: the manifest entries of the files the ranks reported written so far.
        ranks: the ranks that reported.
    """

    state: dict[str, Any]
    files: dict[str, dict[str, Any]] = field(default_factory=dict)
    ranks: set[int] = field(default_factory=set)


@dataclass(frozen=True)
class Restored:
    """What `lora_rl_core.run.resume.restore` found when the run opened (0 and None for a fresh run).

    Attributes:
        step: the checkpoint step the trainer was restored from. Its update and every earlier one are in the
            trainer: the train phase of such a step replays the stats it recorded instead of training again.
        newest_version: the newest adapter version then in the store. Publishing a version up to it returns
            the stored one (versions are immutable; a resumed run re-derives the same weights).
    """

    step: int = 0
    newest_version: int | None = None


@dataclass
class PolicyState:
    """Which adapter version the engines serve for rollouts, which versions rollouts still hold, and the
    tensors of the last publish. Thread-safe: in `rollout.mode: async` rollouts run beside the step's sync.

    Attributes:
        version: the policy version rollouts use; None until version 0 is synced.
        pending: the last version published from the trainer, for the tensor sync path (`engine.sync:
            tensor`) and for a sync that must wait for its write to the store; dropped once synced.
    """

    version: int | None = None
    pending: PublishedVersion | None = None
    _holds: Counter[int] = field(default_factory=Counter)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @contextmanager
    def hold(self) -> Iterator[int]:
        """The current version, held until the block ends: `held()` reports it, and the sync protocol does
        not retire a held version (docs/HOTSWAP.md, "Asynchronous rollouts").

        Raises:
            LoraRLError: no version has been synced yet.
        """
        with self._lock:
            if self.version is None:
                raise LoraRLError("no adapter version has been synced to the engine yet (publish and sync version 0)")
            version = self.version
            self._holds[version] += 1
        try:
            yield version
        finally:
            with self._lock:
                self._holds[version] -= 1
                if not self._holds[version]:
                    del self._holds[version]

    def held(self) -> set[int]:
        """Versions that rollouts hold now."""
        with self._lock:
            return set(self._holds)

    def switch(self, version: int) -> None:
        """Make `version` the one later rollouts use (rollouts holding an older one keep it)."""
        with self._lock:
            self.version = version
