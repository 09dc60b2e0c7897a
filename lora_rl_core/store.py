"""AdapterStore: versioned LoRA adapters in an fsspec object store.

Layout (see DESIGN.md, "Object store layout")::

    <store>/<run_id>/run.json                                   config snapshot
    <store>/<run_id>/adapters/v000007/adapter_model.safetensors
                                     /adapter_config.json       (PEFT format)
                                     /manifest.json             written LAST
    <store>/<run_id>/adapters/LATEST                            {"version": 7}

Choices made here:

* A version exists iff its ``manifest.json`` exists; the files it lists are
  checked against their sha256 whenever their bytes are read (``pull``,
  ``load_tensors``). A folder without a manifest is a partial upload and is
  invisible. Listing does not download adapters.
* Versions are immutable: publishing over a manifest raises, except that an
  identical re-publish returns the existing ref (retried tasks are idempotent).
* Small JSON files (manifest, LATEST, run.json) are written to a temp name and
  moved into place, so readers never see half a manifest on a local disk.
* ``LATEST`` is a hint for outside readers and never moves backwards;
  ``latest()`` trusts the manifests, not the hint, since a crash between the
  manifest and LATEST leaves the hint stale.
* Safetensors only: the store is untrusted input, so pickle files are
  refused and manifest file names must be plain names (no paths).

Left out: locking between concurrent publishers of the same version (the
manifest checksums catch a mixed result on read) and garbage collection of
partial uploads.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import tempfile
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import fsspec
import torch
from pydantic import BaseModel, ValidationError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from lora_rl_core.errors import StoreError

MODEL_FILE = "adapter_model.safetensors"
CONFIG_FILE = "adapter_config.json"
MANIFEST_FILE = "manifest.json"
LATEST_FILE = "LATEST"
RUN_CONFIG_FILE = "run.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")

_RUN_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_VERSION_DIR_RE = re.compile(r"v(\d{6,})")
_FILE_NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")
_NAME_SPEC_RE = re.compile(r"(.+)-v(\d{6,})")


# ----------------------------------------------------------------- names


def adapter_name(run_id: str, version: int) -> str:
    """Name an adapter for engines and logs: ``f"{run_id}-v{version:06d}"``."""
    return f"{run_id}-v{version:06d}"


def validate_run_id(run_id: str) -> str:
    """Check that ``run_id`` is safe as one path segment and return it.

    Allowed: ``[A-Za-z0-9][A-Za-z0-9._-]{0,127}`` without ``..``.

    Raises:
        StoreError: naming the bad value.
    """
    ok = isinstance(run_id, str) and _RUN_ID_RE.fullmatch(run_id) and ".." not in run_id
    if not ok:
        raise StoreError(
            f"invalid run id {run_id!r}: use 1-128 characters from [A-Za-z0-9._-], "
            "starting with a letter or digit, without '..' or '/'"
        )
    return run_id


def _validate_version(version: int) -> int:
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise StoreError(f"invalid adapter version {version!r}: use an integer >= 0")
    return version


def parse_adapter_spec(spec: str) -> tuple[str, int | None]:
    """Parse an adapter spec into ``(run_id, version)``; version None = latest.

    Accepted: ``"RUN@7"``, ``"RUN@latest"``, ``"RUN"``, ``"RUN-v000007"`` (an
    adapter name; a bare spec ending in ``-vNNNNNN`` is always read this way).

    Raises:
        StoreError: on an empty spec, a bad version or a bad run id.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise StoreError(f"invalid adapter spec {spec!r}: use RUN@VERSION, RUN@latest or RUN")
    spec = spec.strip()
    if "@" in spec:
        run_id, _, version = spec.partition("@")
        if version == "latest":
            return validate_run_id(run_id), None
        if not version.isdigit():
            raise StoreError(f"invalid adapter spec {spec!r}: version must be an integer or 'latest'")
        return validate_run_id(run_id), int(version)
    match = _NAME_SPEC_RE.fullmatch(spec)
    if match:
        return validate_run_id(match[1]), int(match[2])
    return validate_run_id(spec), None


# ----------------------------------------------------------------- models


class FileEntry(BaseModel):
    """One file of an adapter version: its sha256 (hex) and size in bytes."""

    sha256: str
    size: int


class AdapterRef(BaseModel):
    """A small, JSON-serialisable pointer to one complete adapter version.

    This is what crosses task boundaries. ``uri`` is the version folder (for
    example ``file:///abs/runs/r1/adapters/v000003``); ``sha256`` is the hex
    digest of its ``adapter_model.safetensors``.
    """

    run_id: str
    version: int
    uri: str
    sha256: str

    @property
    def name(self) -> str:
        """The adapter name, ``adapter_name(run_id, version)``."""
        return adapter_name(self.run_id, self.version)


class AdapterManifest(BaseModel):
    """The ``manifest.json`` of a version; its presence makes the version exist.

    ``created_at`` is ISO-8601 UTC; ``files`` maps file name to checksum and
    size; ``lora`` holds rank, alpha and target_modules for display only.
    """

    run_id: str
    version: int
    step: int
    created_at: str
    base_model: str
    files: dict[str, FileEntry]
    metrics: dict[str, float] = {}
    lora: dict[str, Any] = {}


# ----------------------------------------------------------------- helpers


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _json_default(obj: Any) -> Any:
    if isinstance(obj, (set, frozenset)):
        return sorted(obj)
    raise TypeError(f"{type(obj).__name__} is not JSON serialisable")


def _json_bytes(obj: Any, what: str) -> bytes:
    """Deterministic JSON (sorted keys; sets become sorted lists)."""
    try:
        return json.dumps(obj, indent=2, sort_keys=True, default=_json_default).encode()
    except (TypeError, ValueError) as e:
        raise StoreError(f"cannot write {what} as JSON: {e}") from e


def _json_load(data: bytes, what: str) -> Any:
    try:
        return json.loads(data)
    except ValueError as e:
        raise StoreError(f"{what} is not valid JSON: {e}") from e


def _check_finite(tensors: dict[str, torch.Tensor]) -> None:
    for key, t in tensors.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise StoreError(f"adapter tensor {key!r} has NaN or inf values; refusing to publish")


def _check_file_name(name: str, where: str) -> None:
    if not _FILE_NAME_RE.fullmatch(name) or ".." in name:
        raise StoreError(f"{where}: unsafe file name {name!r} in manifest")
    if name.endswith(PICKLE_SUFFIXES):
        raise StoreError(f"{where}: pickle file {name!r} refused; adapters must be safetensors")


def _lora_summary(adapter_config: dict) -> dict[str, Any]:
    summary = {
        "rank": adapter_config.get("r"),
        "alpha": adapter_config.get("lora_alpha"),
        "target_modules": adapter_config.get("target_modules"),
    }
    return json.loads(_json_bytes(summary, "lora summary"))


def _peft_config(adapter_config: dict, base_model: str) -> dict:
    """The config as PEFT's save_pretrained writes it (inference mode, base set)."""
    cfg = dict(adapter_config)
    cfg["inference_mode"] = True
    if not cfg.get("base_model_name_or_path"):
        cfg["base_model_name_or_path"] = base_model
    return cfg


# ----------------------------------------------------------------- store


class AdapterStore:
    """Versioned LoRA adapters (plain PEFT folders) under one fsspec URI.

    Args:
        uri: store root, e.g. ``file://./runs`` (relative paths are resolved
            against the working directory), ``s3://bucket/runs``,
            ``memory://tests``.
        storage_options: passed to ``fsspec.core.url_to_fs``.
    """

    def __init__(self, uri: str = "file://./runs", storage_options: dict | None = None):
        try:
            self._fs, root = fsspec.core.url_to_fs(uri, **(storage_options or {}))
        except (ValueError, ImportError) as e:
            raise StoreError(f"cannot open adapter store {uri!r}: {e}") from e
        self._root = root.rstrip("/") or "/"

    @property
    def uri(self) -> str:
        """The store root as an absolute URI, e.g. ``file:///abs/runs``."""
        return self._fs.unstrip_protocol(self._root)

    def __repr__(self) -> str:
        return f"AdapterStore({self.uri!r})"

    # ------------------------------------------------------------- paths

    def _run_dir(self, run_id: str) -> str:
        return f"{self._root}/{validate_run_id(run_id)}"

    def _version_dir(self, run_id: str, version: int) -> str:
        return f"{self._run_dir(run_id)}/adapters/v{_validate_version(version):06d}"

    def _put(self, path: str, data: bytes) -> None:
        self._fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
        self._fs.pipe_file(path, data)

    def _put_atomic(self, path: str, data: bytes) -> None:
        tmp = f"{path}.tmp-{uuid.uuid4().hex}"
        self._put(tmp, data)
        self._fs.mv(tmp, path)

    def _get(self, path: str) -> bytes | None:
        try:
            return self._fs.cat_file(path)
        except FileNotFoundError:
            return None

    # ------------------------------------------------------------- publish

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
    ) -> AdapterRef:
        """Publish a LoRA state dict as an immutable version.

        Args:
            tensors: PEFT-keyed LoRA weights (as from
                ``peft.get_peft_model_state_dict``); any device, any dtype.
            adapter_config: the PEFT config dict (``LoraConfig.to_dict()``);
                sets are written as sorted lists.
            step: the training step these weights come from.
            base_model: HF id or path of the base model.
            metrics: scalar metrics to show next to the version.

        Returns:
            The ref of the new (or identical, already published) version.

        Raises:
            StoreError: non-finite tensors, bad run id or version, or the
                version already exists with different bytes.
        """
        tensors = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
        _check_finite(tensors)
        model_bytes = st_save(tensors, metadata={"format": "pt"})
        return self._publish_bytes(run_id, version, model_bytes, adapter_config, step, base_model, metrics)

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
        """Publish a PEFT ``save_pretrained`` folder as an immutable version.

        The folder must hold ``adapter_model.safetensors`` and
        ``adapter_config.json``; other files are ignored, pickle files refused.

        Raises:
            StoreError: missing files, pickle files, non-finite tensors, or the
                version already exists with different bytes.
        """
        folder = Path(folder)
        pickles = sorted(p.name for p in folder.glob("*") if p.name.endswith(PICKLE_SUFFIXES))
        if pickles:
            raise StoreError(f"{folder}: pickle files {pickles} refused; save with safe_serialization=True")
        model_path, config_path = folder / MODEL_FILE, folder / CONFIG_FILE
        for path in (model_path, config_path):
            if not path.is_file():
                raise StoreError(f"{path} not found; publish_folder needs a PEFT save_pretrained folder")
        model_bytes = model_path.read_bytes()
        _check_finite(self._load_safetensors(model_bytes, str(model_path)))
        config = _json_load(config_path.read_bytes(), str(config_path))
        return self._publish_bytes(run_id, version, model_bytes, config, step, base_model, metrics)

    def _publish_bytes(
        self,
        run_id: str,
        version: int,
        model_bytes: bytes,
        adapter_config: dict,
        step: int,
        base_model: str,
        metrics: dict[str, float] | None,
    ) -> AdapterRef:
        """Write the files, then manifest.json, then LATEST."""
        vdir = self._version_dir(run_id, version)
        config_bytes = _json_bytes(_peft_config(adapter_config, base_model), CONFIG_FILE)
        files = {MODEL_FILE: model_bytes, CONFIG_FILE: config_bytes}
        entries = {n: FileEntry(sha256=_sha256(b), size=len(b)) for n, b in files.items()}
        existing = self._read_manifest(run_id, version)
        if existing is not None:
            return self._existing_ref(existing, entries)
        for name, data in files.items():  # overwrites leftovers of a partial upload
            self._put(f"{vdir}/{name}", data)
        manifest = AdapterManifest(
            run_id=run_id,
            version=version,
            step=step,
            base_model=base_model,
            created_at=datetime.now(UTC).isoformat(timespec="seconds"),
            files=entries,
            metrics=metrics or {},
            lora=_lora_summary(adapter_config),
        )
        self._put_atomic(f"{vdir}/{MANIFEST_FILE}", manifest.model_dump_json(indent=2).encode())
        self._write_latest(run_id)
        return self._ref_from(manifest)

    def _existing_ref(self, manifest: AdapterManifest, entries: dict[str, FileEntry]) -> AdapterRef:
        if manifest.files != entries:
            raise StoreError(
                f"adapter {adapter_name(manifest.run_id, manifest.version)} already exists in "
                f"{self.uri} with different contents; versions are immutable, publish a new version"
            )
        return self._ref_from(manifest)

    def _write_latest(self, run_id: str) -> None:
        newest = max(self.versions(run_id))  # never move the hint backwards
        path = f"{self._run_dir(run_id)}/adapters/{LATEST_FILE}"
        self._put_atomic(path, _json_bytes({"version": newest}, LATEST_FILE))

    # ------------------------------------------------------------- read

    def runs(self) -> list[str]:
        """Run ids in the store (folders with a valid run-id name), sorted."""
        try:
            entries = self._fs.ls(self._root, detail=True)
        except FileNotFoundError:
            return []
        names = [e["name"].rstrip("/").rsplit("/", 1)[-1] for e in entries if e["type"] == "directory"]
        return sorted(n for n in names if _RUN_ID_RE.fullmatch(n) and ".." not in n)

    def versions(self, run_id: str) -> list[int]:
        """Complete versions of a run (manifest present), ascending; [] if none."""
        pattern = f"{self._run_dir(run_id)}/adapters/v*/{MANIFEST_FILE}"
        dirs = (p.rstrip("/").split("/")[-2] for p in self._fs.glob(pattern))
        return sorted(int(m[1]) for d in dirs if (m := _VERSION_DIR_RE.fullmatch(d)))

    def latest(self, run_id: str) -> AdapterRef | None:
        """The newest complete version of a run, or None if it has none.

        Reads the manifests rather than trusting ``LATEST``, which can lag.
        """
        versions = self.versions(run_id)
        return self.ref(run_id, versions[-1]) if versions else None

    def _read_manifest(self, run_id: str, version: int) -> AdapterManifest | None:
        path = f"{self._version_dir(run_id, version)}/{MANIFEST_FILE}"
        data = self._get(path)
        if data is None:
            return None
        try:
            manifest = AdapterManifest.model_validate_json(data)
        except ValidationError as e:
            raise StoreError(f"{self._fs.unstrip_protocol(path)} is malformed: {e.errors()[0]['msg']}") from e
        if (manifest.run_id, manifest.version) != (run_id, version):
            raise StoreError(
                f"{self._fs.unstrip_protocol(path)} describes another adapter "
                f"({adapter_name(manifest.run_id, manifest.version)})"
            )
        return manifest

    def manifest(self, run_id: str, version: int) -> AdapterManifest:
        """The manifest of one version.

        Raises:
            StoreError: the version is missing or incomplete (the message lists
                the run's available versions), or its manifest is malformed.
        """
        manifest = self._read_manifest(run_id, version)
        if manifest is None:
            available = self.versions(run_id)
            raise StoreError(
                f"adapter {run_id}@{version} not found in {self.uri}; available versions of "
                f"{run_id!r}: {available if available else 'none'}"
            )
        return manifest

    def ref(self, run_id: str, version: int) -> AdapterRef:
        """The ref of one complete version.

        Raises:
            StoreError: as ``manifest``.
        """
        return self._ref_from(self.manifest(run_id, version))

    def _ref_from(self, manifest: AdapterManifest) -> AdapterRef:
        entry = manifest.files.get(MODEL_FILE)
        vdir = self._version_dir(manifest.run_id, manifest.version)
        if entry is None:
            raise StoreError(f"{self._fs.unstrip_protocol(vdir)}/{MANIFEST_FILE} lists no {MODEL_FILE}")
        return AdapterRef(
            run_id=manifest.run_id, version=manifest.version, uri=self._fs.unstrip_protocol(vdir), sha256=entry.sha256
        )

    def resolve(self, spec: str) -> AdapterRef:
        """Resolve ``"RUN@7"``, ``"RUN@latest"``, ``"RUN"`` or ``"RUN-v000007"``.

        Raises:
            StoreError: bad spec, unknown version, or a run with no versions.
        """
        run_id, version = parse_adapter_spec(spec)
        if version is not None:
            return self.ref(run_id, version)
        ref = self.latest(run_id)
        if ref is None:
            raise StoreError(
                f"run {run_id!r} has no complete adapter versions in {self.uri}; "
                f"runs in the store: {self.runs() or 'none'}"
            )
        return ref

    # ------------------------------------------------------------- fetch

    def _verified_files(self, run_id: str, version: int) -> dict[str, bytes]:
        """Every file the manifest lists, checked against its sha256."""
        manifest = self.manifest(run_id, version)
        vuri = self._fs.unstrip_protocol(self._version_dir(run_id, version))
        out = {}
        for name, entry in manifest.files.items():
            _check_file_name(name, vuri)
            data = self._get(f"{self._version_dir(run_id, version)}/{name}")
            if data is None:
                raise StoreError(f"{vuri}/{name} is missing; the adapter is corrupt, publish a new version")
            got = _sha256(data)
            if got != entry.sha256:
                raise StoreError(
                    f"{vuri}/{name} fails its checksum: manifest sha256 {entry.sha256}, "
                    f"file sha256 {got}; the adapter is corrupt, publish a new version"
                )
            out[name] = data
        out[MANIFEST_FILE] = manifest.model_dump_json(indent=2).encode()
        return out

    def pull(self, run_id: str, version: int, dest: str | Path) -> Path:
        """Copy a version into local folder ``dest`` (a PEFT folder), verified.

        Files land in a temp folder next to ``dest`` that is renamed into place
        only after every checksum passes, so ``dest`` is never half-written. A
        copy of ``manifest.json`` is included. If ``dest`` already holds this
        exact version (same manifest), it is returned as is.

        Returns:
            ``dest`` as an absolute path.

        Raises:
            StoreError: missing version, checksum mismatch (naming the file and
                both hashes), or ``dest`` exists and is not empty.
        """
        dest = Path(dest).expanduser().resolve()
        files = self._verified_files(run_id, version)
        if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
            if self._same_pull(dest, files[MANIFEST_FILE]):
                return dest
            raise StoreError(
                f"cannot pull {adapter_name(run_id, version)} into {dest}: it exists and is not an empty folder"
            )
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
        try:
            for name, data in files.items():
                (tmp / name).write_bytes(data)
            if dest.exists():
                dest.rmdir()
            tmp.rename(dest)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return dest

    @staticmethod
    def _same_pull(dest: Path, manifest_bytes: bytes) -> bool:
        path = dest / MANIFEST_FILE
        return path.is_file() and path.read_bytes() == manifest_bytes

    def load_tensors(self, run_id: str, version: int) -> tuple[dict[str, torch.Tensor], dict]:
        """Load a version's weights and config into memory, sha256-verified.

        Returns:
            ``(state_dict, adapter_config)``: CPU tensors keyed as PEFT saves
            them, and the PEFT config dict.

        Raises:
            StoreError: missing version, checksum mismatch, malformed files.
        """
        files = self._verified_files(run_id, version)
        where = f"{self._fs.unstrip_protocol(self._version_dir(run_id, version))}"
        if MODEL_FILE not in files or CONFIG_FILE not in files:
            raise StoreError(f"{where}: manifest must list {MODEL_FILE} and {CONFIG_FILE}")
        tensors = self._load_safetensors(files[MODEL_FILE], f"{where}/{MODEL_FILE}")
        return tensors, _json_load(files[CONFIG_FILE], f"{where}/{CONFIG_FILE}")

    @staticmethod
    def _load_safetensors(data: bytes, where: str) -> dict[str, torch.Tensor]:
        try:
            return st_load(data)
        except Exception as e:  # safetensors raises its own SafetensorError
            raise StoreError(f"{where} is not a valid safetensors file: {e}") from e

    # ------------------------------------------------------------- run config

    def write_run_config(self, run_id: str, config: dict) -> None:
        """Write the run's config snapshot to ``<run_id>/run.json`` (replaces it).

        Raises:
            StoreError: bad run id or a config that is not JSON-serialisable.
        """
        path = f"{self._run_dir(run_id)}/{RUN_CONFIG_FILE}"
        self._put_atomic(path, _json_bytes(config, RUN_CONFIG_FILE))

    def read_run_config(self, run_id: str) -> dict | None:
        """The run's config snapshot, or None if it has none.

        Raises:
            StoreError: bad run id or malformed ``run.json``.
        """
        path = f"{self._run_dir(run_id)}/{RUN_CONFIG_FILE}"
        data = self._get(path)
        return None if data is None else _json_load(data, self._fs.unstrip_protocol(path))
