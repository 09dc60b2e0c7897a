"""A run's own files in the store, next to its adapter versions and checkpoints.

Layout under `<store>/<run_id>/` (docs/DESIGN.md, "Object store layout"):

    run.json                     config snapshot + runtime (written when the run opens)
    rollouts/step-NNNNNN.json    `RolloutBatch` of each step
    scored/step-NNNNNN.json      `ScoredBatch` of each step
    trained/step-NNNNNN.json     `TrainStats` of each step (a resumed run replays them for restored steps)
    faults/<phase>-NNNNNN        markers of injected faults that fired (`lora_rl_core.faults`)

Every access goes through `StoreIO`, like adapters and checkpoints: transient store errors are retried with
backoff, whole-object writes are atomic for readers, reads are size-capped, symlinks in a local store are
refused. Any machine that can reach the store can read a phase back, so a retried phase may run elsewhere.
"""

from __future__ import annotations

from typing import Any, TypeVar

import fsspec
from fsspec import AbstractFileSystem
from pydantic import BaseModel, ValidationError

from lora_rl_core.adapters import RUN_CONFIG_FILE, validate_run_id
from lora_rl_core.errors import LoraRLError, StoreError
from lora_rl_core.store.io import RetryPolicy, StoreIO
from lora_rl_core.store.layout import json_bytes, json_load

R = TypeVar("R", bound=BaseModel)

MAX_PHASE_BYTES = 2**30
"""Largest phase file read back, bytes (a step of 1024 completions of 4k tokens is about 40 MB)."""
MAX_CONFIG_BYTES = 2**20


class RunDir:
    """Reads and writes the files of run `run_id` under the store root `uri`.

    Args:
        uri: the store root (`store.uri` of the config), e.g. `file://./runs` or `s3://bucket/runs`.
        run_id: the run (checked with `validate_run_id`).
        storage_options: passed to fsspec.
        retry: backoff for transient store errors.
        fs: an fsspec filesystem to use instead of building one from `uri` (tests wrap one to inject faults);
            `uri` then only names the root.

    Raises:
        StoreError: bad run id, or the URI cannot be opened (unknown protocol, missing package).
    """

    def __init__(
        self,
        uri: str,
        run_id: str,
        storage_options: dict[str, Any] | None = None,
        retry: RetryPolicy | None = None,
        fs: AbstractFileSystem | None = None,
    ) -> None:
        self.run_id = validate_run_id(run_id)
        if fs is None:
            try:
                fs, root = fsspec.core.url_to_fs(uri, **{"use_listings_cache": False, **(storage_options or {})})
            except (ValueError, ImportError, TypeError) as e:
                raise StoreError(f"cannot open store {uri!r} for run {run_id}: {e}") from e
        else:
            root = fs._strip_protocol(uri)
        self._io = StoreIO(fs, retry or RetryPolicy())
        self._root = f"{root.rstrip('/')}/{self.run_id}"

    @property
    def uri(self) -> str:
        """The run's folder as a URI, e.g. `file:///abs/runs/my-run`."""
        return self._io.uri(self._root)

    def _phase_path(self, phase: str, step: int) -> str:
        return f"{self._root}/{phase}/step-{step:06d}.json"

    # ------------------------------------------------------------------ phases
    def write_phase(self, phase: str, step: int, record: BaseModel) -> None:
        """Write a phase's record to `<run>/<phase>/step-NNNNNN.json` (replacing a previous attempt's).

        Raises:
            StoreError: the write failed after retries.
        """
        self._io.put(self._phase_path(phase, step), record.model_dump_json().encode())

    def read_phase(self, phase: str, step: int, record_type: type[R]) -> R:
        """Read back a phase's record.

        Raises:
            LoraRLError: the file does not exist (run that phase first), or it does not hold a `record_type`
                (the message names the file and the field).
            StoreError: the store failed after retries.
        """
        path = self._phase_path(phase, step)
        data = self._io.get(path, MAX_PHASE_BYTES)
        if data is None:
            raise LoraRLError(f"{phase} output of step {step} not found at {self._io.uri(path)}: run that phase first")
        try:
            return record_type.model_validate_json(data)
        except ValidationError as e:
            first = e.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            raise LoraRLError(
                f"{self._io.uri(path)} is not a valid {record_type.__name__} ({where}: {first['msg']}); "
                f"delete it and re-run the {phase} phase of step {step}"
            ) from None

    # ------------------------------------------------------------------ config snapshot
    def write_config(self, config: dict[str, Any]) -> None:
        """Write the run's config snapshot `<run>/run.json` (replaces it).

        Raises:
            StoreError: `config` is not JSON-serialisable, or the store failed.
        """
        self._io.put(f"{self._root}/{RUN_CONFIG_FILE}", json_bytes(config, f"{RUN_CONFIG_FILE} of run {self.run_id}"))

    def read_config(self) -> dict[str, Any] | None:
        """The run's config snapshot, or None if it has none.

        Raises:
            StoreError: `run.json` is not a JSON object, or the store failed.
        """
        path = f"{self._root}/{RUN_CONFIG_FILE}"
        data = self._io.get(path, MAX_CONFIG_BYTES)
        if data is None:
            return None
        config = json_load(data, self._io.uri(path))
        if not isinstance(config, dict):
            raise StoreError(f"{self._io.uri(path)} must hold a JSON object, got {type(config).__name__}")
        return config

    # ------------------------------------------------------------------ markers
    def mark(self, name: str, data: bytes = b"") -> bool:
        """Create the marker object `<run>/<name>` unless it exists; True if this call created it.

        Atomic across processes and machines (`StoreIO.create`), so exactly one caller wins.
        """
        return self._io.create(f"{self._root}/{name}", data)
