"""``AdapterPublisher``: the publish protocol (package docstring, ``lora_rl_core.store``).

1. An existing manifest with identical files returns its ref (idempotent); other files raise.
2. The data files go into a folder unique to the attempt (``<sha256[:12]>-<random 12 hex>``).
3. ``manifest.json`` is created exclusively and read back: the one writer whose manifest landed
   wins; a loser with the same weights gets the winner's ref, one with other weights an error.
4. ``LATEST`` is updated, best effort.

A failed or losing attempt deletes its data folder (best effort; ``gc`` removes what is left), so
nothing of it is ever visible. ``prepare`` does the in-memory half (checks, safetensors bytes,
checksums: the ref is known) and ``write`` the store half (steps 1-4), so a trainer can hand the
write to a background thread (``lora_rl_core.run.writer``). Left out: any check that versions grow
(any unused number publishes).
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lora_rl_core.adapters.io import load_safetensors, refuse_pickles, safetensors_bytes
from lora_rl_core.adapters.names import (
    CONFIG_FILE,
    LATEST_FILE,
    MODEL_FILE,
    adapter_name,
    validate_run_id,
    validate_version,
)
from lora_rl_core.adapters.validation import AdapterRules
from lora_rl_core.errors import StoreError
from lora_rl_core.store.io import StoreIO
from lora_rl_core.store.layout import MAX_JSON_BYTES, StoreLayout, json_bytes, json_load, sha256_hex, utc_now
from lora_rl_core.store.reader import VersionReader
from lora_rl_core.store.records import AdapterManifest, AdapterRef, FileEntry

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


def _lora_summary(adapter_config: dict) -> dict[str, Any]:
    summary = {
        "rank": adapter_config.get("r"),
        "alpha": adapter_config.get("lora_alpha"),
        "target_modules": adapter_config.get("target_modules"),
    }
    return json_load(json_bytes(summary, "lora summary"), "lora summary")


def _peft_config(adapter_config: dict, base_model: str) -> dict:
    """The config as PEFT's save_pretrained writes it (inference mode, base set, peft_type LORA)."""
    cfg = dict(adapter_config)
    cfg["inference_mode"] = True
    cfg.setdefault("peft_type", "LORA")
    if not cfg.get("base_model_name_or_path"):
        cfg["base_model_name_or_path"] = base_model
    return cfg


@dataclass(frozen=True)
class PreparedVersion:
    """An adapter version checked and serialised in memory, not yet in the store (``AdapterStore.prepare``).

    Attributes:
        manifest: the manifest it will have (the data folder of this attempt included).
        files: file name -> bytes (``adapter_model.safetensors``, ``adapter_config.json``).
        ref: the ref it has once written (``AdapterStore.write`` returns the same, or that of an identical
            version already stored).
    """

    manifest: AdapterManifest
    files: dict[str, bytes]
    ref: AdapterRef


class AdapterPublisher:
    """Writes adapter versions: data files first, the manifest last and exclusively, then ``LATEST``.

    Args:
        io: the store's I/O; layout: its paths and size caps; reader: reads manifests back.
        commit: creates a version's manifest and says whether this writer's is the one stored;
            default ``commit_manifest``. ``AdapterStore`` routes it through its own
            ``_commit_manifest`` so tests can line up racing writers there.
    """

    def __init__(
        self,
        io: StoreIO,
        layout: StoreLayout,
        reader: VersionReader,
        *,
        commit: Callable[[AdapterManifest], bool] | None = None,
    ):
        self._io = io
        self._layout = layout
        self._reader = reader
        self._commit = commit or self.commit_manifest

    def publish(
        self,
        run_id: str,
        version: int,
        *,
        tensors: dict[str, torch.Tensor],
        adapter_config: dict,
        step: int,
        base_model: str,
        metrics: dict[str, float] | None = None,
        before_manifest: Callable[[], None] | None = None,
    ) -> AdapterRef:
        """Publish a PEFT-keyed LoRA state dict with its PEFT config dict; ``AdapterStore.publish`` documents it.

        Raises:
            StoreError: tensors that are non-finite or do not match the config, or as ``publish_bytes``.
        """
        prepared = self.prepare(
            run_id,
            version,
            tensors=tensors,
            adapter_config=adapter_config,
            step=step,
            base_model=base_model,
            metrics=metrics,
        )
        return self.write(prepared, before_manifest)

    def prepare(
        self,
        run_id: str,
        version: int,
        *,
        tensors: dict[str, torch.Tensor],
        adapter_config: dict,
        step: int,
        base_model: str,
        metrics: dict[str, float] | None = None,
    ) -> PreparedVersion:
        """Check a PEFT-keyed LoRA state dict and serialise it with its config, without touching the store;
        ``AdapterStore.prepare`` documents it.

        Raises:
            StoreError: tensors that are non-finite or do not match the config, a file over its size cap,
                bad run id or version.
        """
        AdapterRules(allow_dora=True).check_tensors(tensors, adapter_config)
        return self._prepare_bytes(
            run_id, version, safetensors_bytes(tensors), adapter_config, step, base_model, metrics
        )

    def publish_folder(
        self,
        run_id: str,
        version: int,
        folder: str | Path,
        *,
        step: int,
        base_model: str,
        metrics: dict[str, float] | None = None,
    ) -> AdapterRef:
        """Publish a PEFT ``save_pretrained`` folder (plain files only); ``AdapterStore.publish_folder`` documents it.

        Raises:
            StoreError: missing files, symlinks, pickle files, files over the size cap, a malformed
                config or weights, or as ``publish_bytes``.
        """
        folder = Path(folder)
        model_path, config_path = folder / MODEL_FILE, folder / CONFIG_FILE
        for path in (folder, model_path, config_path):
            if path.is_symlink():
                raise StoreError(f"{path} is a symbolic link; publish_folder takes plain files only")
        refuse_pickles((p.name for p in folder.glob("*")), str(folder))
        for path in (model_path, config_path):
            if not path.is_file():
                raise StoreError(f"{path} not found; publish_folder needs a PEFT save_pretrained folder")
            self._layout.check_size(path.name, path.stat().st_size, str(path))
        model_bytes = model_path.read_bytes()
        tensors = load_safetensors(model_bytes, str(model_path))
        config = json_load(config_path.read_bytes(), str(config_path))
        AdapterRules(allow_dora=True).check_tensors(tensors, config, str(folder))
        return self.publish_bytes(run_id, version, model_bytes, config, step, base_model, metrics)

    def publish_bytes(
        self,
        run_id: str,
        version: int,
        model_bytes: bytes,
        adapter_config: dict,
        step: int,
        base_model: str,
        metrics: dict[str, float] | None,
        before_manifest: Callable[[], None] | None = None,
    ) -> AdapterRef:
        """Write checked safetensors bytes and their config into a fresh data folder, then commit the manifest.

        Args:
            model_bytes: the ``adapter_model.safetensors`` file; the rest as ``AdapterStore.publish``.

        Raises:
            StoreError: a file over its size cap, bad run id or version, the version exists with other
                files, another writer won the race with other weights, or the store failed (after retries).
        """
        prepared = self._prepare_bytes(run_id, version, model_bytes, adapter_config, step, base_model, metrics)
        return self.write(prepared, before_manifest)

    def _prepare_bytes(
        self,
        run_id: str,
        version: int,
        model_bytes: bytes,
        adapter_config: dict,
        step: int,
        base_model: str,
        metrics: dict[str, float] | None,
    ) -> PreparedVersion:
        config_bytes = json_bytes(_peft_config(adapter_config, base_model), CONFIG_FILE)
        files = {MODEL_FILE: model_bytes, CONFIG_FILE: config_bytes}
        for name, data in files.items():
            self._layout.check_size(name, len(data), name)
        entries = {n: FileEntry(sha256=sha256_hex(b), size=len(b)) for n, b in files.items()}
        manifest = AdapterManifest(
            run_id=validate_run_id(run_id),
            version=validate_version(version),
            step=step,
            base_model=base_model,
            created_at=utc_now(),
            files=entries,
            metrics=metrics or {},
            lora=_lora_summary(adapter_config),
            data_dir=f"{entries[MODEL_FILE].sha256[:12]}-{uuid.uuid4().hex[:12]}",
        )
        return PreparedVersion(manifest, files, self._reader.ref_from(manifest))

    def write(self, prepared: PreparedVersion, before_manifest: Callable[[], None] | None = None) -> AdapterRef:
        """Store a prepared version (steps 1-4 of the module docstring); ``AdapterStore.write`` documents it.

        Raises:
            StoreError: the version exists with other files, another writer won the race with other weights,
                or the store failed (after retries).
        """
        manifest, files = prepared.manifest, prepared.files
        existing = self._reader.read_manifest(manifest.run_id, manifest.version)
        if existing is not None:
            return self._existing_ref(existing, manifest.files)
        try:
            for name, data in files.items():
                self._io.put(f"{self._layout.files_dir(manifest)}/{name}", data)
            if before_manifest is not None:
                before_manifest()
            won = self._commit(manifest)
        except Exception:
            self._discard_attempt(manifest)
            raise
        if not won:
            self._discard_attempt(manifest)
            return self._lost_race(manifest)
        self._write_latest(manifest.run_id)
        return prepared.ref

    def commit_manifest(self, manifest: AdapterManifest) -> bool:
        """Create manifest.json if absent; True if this writer's manifest is the one in the store.

        Raises:
            StoreError: the store failed (after retries).
        """
        path = self._layout.manifest_path(manifest.run_id, manifest.version)
        data = manifest.model_dump_json(indent=2).encode()
        self._io.create(path, data)
        # Read back: a retried create whose first try landed, and backends without an atomic create.
        return self._io.get(path, MAX_JSON_BYTES) == data

    def _lost_race(self, ours: AdapterManifest) -> AdapterRef:
        winner = self._reader.manifest(ours.run_id, ours.version)
        if winner.files == ours.files:
            return self._reader.ref_from(winner)  # an identical publish won: same weights, same version
        name = adapter_name(ours.run_id, ours.version)
        raise StoreError(
            f"lost the race to publish {name} in {self._reader.uri}: another writer published it at the same time "
            f"with different weights (sha256 {winner.files[MODEL_FILE].sha256[:12]} vs ours "
            f"{ours.files[MODEL_FILE].sha256[:12]}); this attempt's files were removed. Versions are immutable: "
            "publish under a new version"
        )

    def _discard_attempt(self, manifest: AdapterManifest) -> None:
        """Best effort: delete an attempt's data folder unless the stored manifest points at it."""
        files_dir = self._layout.files_dir(manifest)
        try:
            stored = self._reader.read_manifest(manifest.run_id, manifest.version)
            if stored is None or stored.data_dir != manifest.data_dir:
                self._io.rm_tree(files_dir)
        except Exception as e:  # the store may be down: gc removes leftovers later
            log.warning("could not remove the files of a failed publish in %s: %s", files_dir, e)

    def _existing_ref(self, manifest: AdapterManifest, entries: dict[str, FileEntry]) -> AdapterRef:
        if manifest.files != entries:
            raise StoreError(
                f"adapter {adapter_name(manifest.run_id, manifest.version)} already exists in "
                f"{self._reader.uri} with different contents; versions are immutable, publish a new version"
            )
        return self._reader.ref_from(manifest)

    def _write_latest(self, run_id: str) -> None:
        """Best effort: LATEST is a hint for outside readers; it never moves backwards."""
        path = self._layout.latest_path(run_id)
        try:
            self._io.put(path, json_bytes({"version": max(self._reader.versions(run_id))}, LATEST_FILE))
        except StoreError as e:
            log.warning("could not update %s (readers do not need it): %s", path, e)
