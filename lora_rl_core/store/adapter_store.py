"""``AdapterStore``: publish, list, tag, verify, pull and garbage-collect adapter versions.

See the package docstring (``lora_rl_core.store``) for the layout and the protocol.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import tempfile
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import fsspec
import torch
from fsspec import AbstractFileSystem
from pydantic import ValidationError

from lora_rl_core.adapters.io import load_safetensors, refuse_pickles, safetensors_bytes, safetensors_shapes
from lora_rl_core.adapters.names import (
    CONFIG_FILE,
    DATA_DIR_RE,
    LATEST_FILE,
    MANIFEST_FILE,
    MODEL_FILE,
    RUN_ID_RE,
    TAG_RE,
    VERSION_DIR_RE,
    adapter_name,
    check_file_name,
    parse_adapter_spec,
    validate_run_id,
    validate_tag,
    validate_version,
)
from lora_rl_core.adapters.validation import AdapterRules
from lora_rl_core.errors import StoreError
from lora_rl_core.store.io import RetryPolicy, StoreIO
from lora_rl_core.store.models import AdapterManifest, AdapterRef, FileEntry, RetentionPolicy, plan_retention

log = logging.getLogger(__name__)

DEFAULT_MAX_FILE_BYTES = 2 * 2**30
MAX_JSON_BYTES = 2**20  # manifest, adapter config, tags, LATEST


# ----------------------------------------------------------------- helpers


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


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


def _lora_summary(adapter_config: dict) -> dict[str, Any]:
    summary = {
        "rank": adapter_config.get("r"),
        "alpha": adapter_config.get("lora_alpha"),
        "target_modules": adapter_config.get("target_modules"),
    }
    return json.loads(_json_bytes(summary, "lora summary"))


def _peft_config(adapter_config: dict, base_model: str) -> dict:
    """The config as PEFT's save_pretrained writes it (inference mode, base set, peft_type LORA)."""
    cfg = dict(adapter_config)
    cfg["inference_mode"] = True
    cfg.setdefault("peft_type", "LORA")
    if not cfg.get("base_model_name_or_path"):
        cfg["base_model_name_or_path"] = base_model
    return cfg


def _human(n_bytes: int) -> str:
    if n_bytes < 2**20:
        return f"{n_bytes} bytes"
    return f"{n_bytes / 2**30:.2f} GiB" if n_bytes >= 2**30 else f"{n_bytes / 2**20:.1f} MiB"


# ----------------------------------------------------------------- store


class AdapterStore:
    """Versioned LoRA adapters (plain PEFT folders) under one fsspec URI.

    Args:
        uri: store root, e.g. ``file://./runs`` (relative paths are resolved
            against the working directory), ``s3://bucket/runs``, ``memory://tests``.
        storage_options: passed to fsspec (for S3: ``key``, ``secret``,
            ``client_kwargs={"endpoint_url": ...}``; without them s3fs reads the
            standard AWS variables such as ``AWS_ACCESS_KEY_ID`` and ``AWS_ENDPOINT_URL``).
            Listing caches are off unless ``use_listings_cache`` is given, so
            polling readers see new versions.
        max_file_bytes: largest adapter file published or read, in bytes (default 2 GiB).
        retry: backoff for transient store errors (default: 5 tries from 0.2 s).
        fs: an fsspec filesystem to use instead of building one from ``uri``
            (tests wrap one to inject faults); ``uri`` then only names the root.

    Raises:
        StoreError: the URI's protocol is unknown or its package (s3fs, ...) is missing.
    """

    def __init__(
        self,
        uri: str = "file://./runs",
        storage_options: dict | None = None,
        *,
        max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
        retry: RetryPolicy | None = None,
        fs: AbstractFileSystem | None = None,
    ):
        if fs is None:
            options = {"use_listings_cache": False, **(storage_options or {})}
            try:
                fs, root = fsspec.core.url_to_fs(uri, **options)
            except (ValueError, ImportError, TypeError) as e:
                raise StoreError(f"cannot open adapter store {uri!r}: {e}") from e
        else:
            root = fs._strip_protocol(uri)
        self._root = root.rstrip("/") or "/"
        self._io = StoreIO(fs, retry or RetryPolicy())
        self.max_file_bytes = max_file_bytes

    @property
    def uri(self) -> str:
        """The store root as an absolute URI, e.g. ``file:///abs/runs``."""
        return self._io.uri(self._root)

    def __repr__(self) -> str:
        return f"AdapterStore({self.uri!r})"

    # ------------------------------------------------------------- paths

    def _run_dir(self, run_id: str) -> str:
        return f"{self._root}/{validate_run_id(run_id)}"

    def _version_dir(self, run_id: str, version: int) -> str:
        return f"{self._run_dir(run_id)}/adapters/v{validate_version(version):06d}"

    def _files_dir(self, manifest: AdapterManifest) -> str:
        vdir = self._version_dir(manifest.run_id, manifest.version)
        return f"{vdir}/{manifest.data_dir}" if manifest.data_dir else vdir

    def _tag_path(self, run_id: str, name: str) -> str:
        return f"{self._run_dir(run_id)}/tags/{validate_tag(name)}.json"

    def _limit(self, name: str) -> int:
        return MAX_JSON_BYTES if name.endswith(".json") else self.max_file_bytes

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
        before_manifest: Callable[[], None] | None = None,
    ) -> AdapterRef:
        """Publish a LoRA state dict as an immutable version.

        Args:
            run_id: the run (one path segment).
            version: the version number (>= 0), usually the training step.
            tensors: PEFT-keyed LoRA weights (as from
                ``peft.get_peft_model_state_dict``); any device, any dtype.
            adapter_config: the PEFT config dict (``LoraConfig.to_dict()``);
                sets are written as sorted lists.
            step: the training step these weights come from.
            base_model: HF id or path of the base model.
            metrics: scalar metrics to show next to the version.
            before_manifest: called after the data files are written and before the
                manifest is created (fault-injection tests kill the writer there).

        Returns:
            The ref of the new (or identical, already published) version.

        Raises:
            StoreError: non-finite tensors, a malformed config or tensors that do
                not match it, a file over ``max_file_bytes``, bad run id or version,
                the version already exists with different bytes, another writer
                won the race for it, or the store failed (after retries). Nothing
                of a failed attempt stays visible.
        """
        AdapterRules(allow_dora=True).check_tensors(tensors, adapter_config)
        model_bytes = safetensors_bytes(tensors)
        return self._publish_bytes(
            run_id, version, model_bytes, adapter_config, step, base_model, metrics, before_manifest
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
        """Publish a PEFT ``save_pretrained`` folder as an immutable version.

        The folder must hold ``adapter_model.safetensors`` and
        ``adapter_config.json`` as plain files; other files are ignored, pickle
        files and symbolic links refused.

        Raises:
            StoreError: missing files, symlinks, pickle files, files over
                ``max_file_bytes``, a malformed config or weights, or as ``publish``.
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
            self._check_size(path.name, path.stat().st_size, str(path))
        model_bytes = model_path.read_bytes()
        tensors = load_safetensors(model_bytes, str(model_path))
        config = _json_load(config_path.read_bytes(), str(config_path))
        AdapterRules(allow_dora=True).check_tensors(tensors, config, str(folder))
        return self._publish_bytes(run_id, version, model_bytes, config, step, base_model, metrics)

    def _check_size(self, name: str, size: int, where: str) -> None:
        if size > self._limit(name):
            raise StoreError(
                f"{where} is {_human(size)}, over the store's limit of {_human(self._limit(name))} "
                f"({'JSON files' if name.endswith('.json') else 'max_file_bytes'})"
            )

    def _publish_bytes(
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
        """Write the files into a fresh data folder, then create manifest.json exclusively, then LATEST."""
        config_bytes = _json_bytes(_peft_config(adapter_config, base_model), CONFIG_FILE)
        files = {MODEL_FILE: model_bytes, CONFIG_FILE: config_bytes}
        for name, data in files.items():
            self._check_size(name, len(data), name)
        entries = {n: FileEntry(sha256=_sha256(b), size=len(b)) for n, b in files.items()}
        existing = self._read_manifest(run_id, version)
        if existing is not None:
            return self._existing_ref(existing, entries)
        manifest = AdapterManifest(
            run_id=run_id,
            version=version,
            step=step,
            base_model=base_model,
            created_at=_now(),
            files=entries,
            metrics=metrics or {},
            lora=_lora_summary(adapter_config),
            data_dir=f"{entries[MODEL_FILE].sha256[:12]}-{uuid.uuid4().hex[:12]}",
        )
        try:
            for name, data in files.items():
                self._io.put(f"{self._files_dir(manifest)}/{name}", data)
            if before_manifest is not None:
                before_manifest()
            won = self._commit_manifest(manifest)
        except Exception:
            self._discard_attempt(manifest)
            raise
        if not won:
            self._discard_attempt(manifest)
            return self._lost_race(manifest)
        self._write_latest(run_id)
        return self._ref_from(manifest)

    def _commit_manifest(self, manifest: AdapterManifest) -> bool:
        """Create manifest.json if absent; True if this writer's manifest is the one in the store."""
        path = f"{self._version_dir(manifest.run_id, manifest.version)}/{MANIFEST_FILE}"
        data = manifest.model_dump_json(indent=2).encode()
        self._io.create(path, data)
        # Read back: a retried create whose first try landed, and backends without an atomic create.
        return self._io.get(path, MAX_JSON_BYTES) == data

    def _lost_race(self, ours: AdapterManifest) -> AdapterRef:
        winner = self.manifest(ours.run_id, ours.version)
        if winner.files == ours.files:
            return self._ref_from(winner)  # an identical publish won: same weights, same version
        name = adapter_name(ours.run_id, ours.version)
        raise StoreError(
            f"lost the race to publish {name} in {self.uri}: another writer published it at the same time with "
            f"different weights (sha256 {winner.files[MODEL_FILE].sha256[:12]} vs ours "
            f"{ours.files[MODEL_FILE].sha256[:12]}); this attempt's files were removed. Versions are immutable: "
            "publish under a new version"
        )

    def _discard_attempt(self, manifest: AdapterManifest) -> None:
        """Best effort: delete an attempt's data folder unless the stored manifest points at it."""
        try:
            stored = self._read_manifest(manifest.run_id, manifest.version)
            if stored is None or stored.data_dir != manifest.data_dir:
                self._io.rm_tree(self._files_dir(manifest))
        except Exception as e:  # the store may be down: gc removes leftovers later
            log.warning("could not remove the files of a failed publish in %s: %s", self._files_dir(manifest), e)

    def _existing_ref(self, manifest: AdapterManifest, entries: dict[str, FileEntry]) -> AdapterRef:
        if manifest.files != entries:
            raise StoreError(
                f"adapter {adapter_name(manifest.run_id, manifest.version)} already exists in "
                f"{self.uri} with different contents; versions are immutable, publish a new version"
            )
        return self._ref_from(manifest)

    def _write_latest(self, run_id: str) -> None:
        """Best effort: LATEST is a hint for outside readers; it never moves backwards."""
        path = f"{self._run_dir(run_id)}/adapters/{LATEST_FILE}"
        try:
            self._io.put(path, _json_bytes({"version": max(self.versions(run_id))}, LATEST_FILE))
        except StoreError as e:
            log.warning("could not update %s (readers do not need it): %s", path, e)

    # ------------------------------------------------------------- read

    def runs(self) -> list[str]:
        """Run ids in the store (folders with a valid run-id name), sorted."""
        names = self._io.ls_dirs(self._root)
        return sorted(n for n in names if RUN_ID_RE.fullmatch(n) and ".." not in n)

    def versions(self, run_id: str) -> list[int]:
        """Complete versions of a run (manifest present), ascending; [] if none.

        One recursive listing of ``<run>/adapters/``; no adapter bytes are read.
        """
        found = {
            int(m[1])
            for parts in self._adapter_files(run_id)
            if len(parts) == 2 and parts[1] == MANIFEST_FILE
            if (m := VERSION_DIR_RE.fullmatch(parts[0]))
        }
        return sorted(found)

    def _adapter_files(self, run_id: str) -> list[list[str]]:
        """Every file under ``<run>/adapters/``, as path segments relative to it (one listing)."""
        adapters = f"{self._run_dir(run_id)}/adapters/"
        paths = self._io.find(adapters.rstrip("/"))
        return [p[len(adapters) :].split("/") for p in paths if p.startswith(adapters)]

    def latest(self, run_id: str) -> AdapterRef | None:
        """The newest complete version of a run, or None if it has none.

        Reads the manifests rather than trusting ``LATEST``, which can lag.
        """
        versions = self.versions(run_id)
        return self.ref(run_id, versions[-1]) if versions else None

    def _read_manifest(self, run_id: str, version: int) -> AdapterManifest | None:
        path = f"{self._version_dir(run_id, version)}/{MANIFEST_FILE}"
        data = self._io.get(path, MAX_JSON_BYTES)
        if data is None:
            return None
        where = self._io.uri(path)
        try:
            manifest = AdapterManifest.model_validate_json(data)
        except ValidationError as e:
            raise StoreError(f"{where} is malformed: {e.errors()[0]['msg']}") from e
        if (manifest.run_id, manifest.version) != (run_id, version):
            raise StoreError(f"{where} describes another adapter ({adapter_name(manifest.run_id, manifest.version)})")
        if manifest.data_dir and (not DATA_DIR_RE.fullmatch(manifest.data_dir)):
            raise StoreError(f"{where}: unsafe data_dir {manifest.data_dir!r} in manifest")
        for name in manifest.files:
            check_file_name(name, where)
        return manifest

    def manifest(self, run_id: str, version: int) -> AdapterManifest:
        """The manifest of one version.

        Raises:
            StoreError: the version is missing or incomplete (the message lists
                the run's available versions), or its manifest is malformed or unsafe.
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
            raise StoreError(f"{self._io.uri(vdir)}/{MANIFEST_FILE} lists no {MODEL_FILE}")
        return AdapterRef(run_id=manifest.run_id, version=manifest.version, uri=self._io.uri(vdir), sha256=entry.sha256)

    def files_uri(self, run_id: str, version: int) -> str:
        """URI of the folder holding a version's PEFT files, for engines that read the store directly.

        Such a reader skips the checksums; prefer ``load_tensors`` or ``pull``.

        Raises:
            StoreError: as ``manifest``.
        """
        return self._io.uri(self._files_dir(self.manifest(run_id, version)))

    def resolve(self, spec: str) -> AdapterRef:
        """Resolve ``"RUN@7"``, ``"RUN@best"`` (a tag), ``"RUN@latest"``, ``"RUN"`` or ``"RUN-v000007"``.

        Raises:
            StoreError: bad spec, unknown version or tag, or a run with no versions.
        """
        run_id, selector = parse_adapter_spec(spec)
        if isinstance(selector, int):
            return self.ref(run_id, selector)
        if isinstance(selector, str):
            version = self.tag_version(run_id, selector)
            if self._read_manifest(run_id, version) is None:
                raise StoreError(
                    f"tag {selector!r} of run {run_id!r} points to version {version}, which is not in {self.uri} "
                    f"(deleted?); available versions: {self.versions(run_id) or 'none'}"
                )
            return self.ref(run_id, version)
        ref = self.latest(run_id)
        if ref is None:
            raise StoreError(
                f"run {run_id!r} has no complete adapter versions in {self.uri}; "
                f"runs in the store: {self.runs() or 'none'}"
            )
        return ref

    # ------------------------------------------------------------- fetch

    def _verified_files(self, run_id: str, version: int) -> tuple[AdapterManifest, dict[str, bytes]]:
        """The manifest and every file it lists, each checked against its size and sha256."""
        manifest = self.manifest(run_id, version)
        files_dir = self._files_dir(manifest)
        out = {}
        for name, entry in manifest.files.items():
            uri = self._io.uri(f"{files_dir}/{name}")
            self._check_size(name, entry.size, uri)
            data = self._io.get(f"{files_dir}/{name}", self._limit(name))
            if data is None:
                raise StoreError(f"{uri} is missing; adapter {run_id}@{version} is corrupt, publish a new version")
            if len(data) != entry.size:
                raise StoreError(
                    f"{uri} is {len(data)} bytes but its manifest says {entry.size} (truncated or replaced); "
                    f"adapter {run_id}@{version} is corrupt, publish a new version"
                )
            got = _sha256(data)
            if got != entry.sha256:
                raise StoreError(
                    f"{uri} fails its checksum: manifest sha256 {entry.sha256}, file sha256 {got}; "
                    f"adapter {run_id}@{version} is corrupt, publish a new version"
                )
            out[name] = data
        return manifest, out

    def _checked_adapter(
        self, run_id: str, version: int, rules: AdapterRules | None = None
    ) -> tuple[AdapterManifest, dict[str, bytes], dict]:
        """Verified files plus checks of the weights' format and the config (untrusted input)."""
        manifest, files = self._verified_files(run_id, version)
        where = self._io.uri(self._files_dir(manifest))
        if MODEL_FILE not in files or CONFIG_FILE not in files:
            raise StoreError(f"{where}: manifest must list {MODEL_FILE} and {CONFIG_FILE}")
        config = _json_load(files[CONFIG_FILE], f"{where}/{CONFIG_FILE}")
        shapes = {}
        for name in files:
            if name.endswith(".safetensors"):
                shapes.update(safetensors_shapes(files[name], f"{where}/{name}"))
        (rules or AdapterRules(allow_dora=True)).check(config, shapes, where)
        return manifest, files, config

    def verify(self, run_id: str, version: int, *, rules: AdapterRules | None = None) -> AdapterManifest:
        """Download a version and check it end to end without keeping it.

        Checks sizes and sha256 of every file, the safetensors format, and the
        config and weights against ``rules`` (default: any LoRA, DoRA allowed).

        Returns:
            The version's manifest.

        Raises:
            StoreError: naming the object at fault (missing, truncated, checksum mismatch, malformed).
        """
        return self._checked_adapter(run_id, version, rules)[0]

    def pull(self, run_id: str, version: int, dest: str | Path) -> Path:
        """Copy a version into local folder ``dest`` (a PEFT folder), verified.

        ``dest`` gets ``adapter_model.safetensors``, ``adapter_config.json``
        (what ``PeftModel.from_pretrained`` and SGLang ``--lora-paths`` load)
        and a copy of ``manifest.json``. Files land in a temp folder next to
        ``dest`` that is renamed into place only after every check passes, so
        ``dest`` is never half-written. If ``dest`` already holds this exact
        version (same manifest), it is returned as is.

        Returns:
            ``dest`` as an absolute path.

        Raises:
            StoreError: missing version, checksum or size mismatch (naming the
                file), malformed weights or config, ``dest`` is a symbolic link,
                or ``dest`` exists and is not an empty folder.
        """
        dest = Path(dest).expanduser().absolute()
        if dest.is_symlink():
            raise StoreError(f"cannot pull into {dest}: it is a symbolic link; give a real folder")
        manifest, files, _ = self._checked_adapter(run_id, version)
        files[MANIFEST_FILE] = manifest.model_dump_json(indent=2).encode()
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
        return path.is_file() and not path.is_symlink() and path.read_bytes() == manifest_bytes

    def load_tensors(
        self, run_id: str, version: int, *, rules: AdapterRules | None = None
    ) -> tuple[dict[str, torch.Tensor], dict]:
        """Load a version's weights and config into memory, verified; call this before an engine loads it.

        Args:
            run_id, version: the version.
            rules: what the engine accepts (``AdapterRules.for_model(model, max_rank=..., allow_dora=...)``);
                None accepts any well-formed LoRA adapter.

        Returns:
            ``(state_dict, adapter_config)``: CPU tensors keyed as PEFT saves
            them, and the PEFT config dict.

        Raises:
            StoreError: missing version; a missing, truncated or corrupted file
                (the message names its URI); malformed weights or config; an
                adapter that breaks ``rules``.
        """
        manifest, files, config = self._checked_adapter(run_id, version, rules)
        where = self._io.uri(f"{self._files_dir(manifest)}/{MODEL_FILE}")
        return load_safetensors(files[MODEL_FILE], where), config

    # ------------------------------------------------------------- tags

    def tag(self, run_id: str, version: int, name: str) -> None:
        """Point tag ``name`` of a run at a complete version (moves an existing tag).

        Tagged versions survive ``gc``; ``RUN@name`` resolves to the version.

        Raises:
            StoreError: bad tag name (``latest`` and all-digit names are reserved) or unknown version.
        """
        path = self._tag_path(run_id, name)
        self.manifest(run_id, version)
        self._io.put(path, _json_bytes({"version": version, "tagged_at": _now()}, f"tag {name}"))

    def untag(self, run_id: str, name: str) -> int:
        """Remove a tag; returns the version it pointed to.

        Raises:
            StoreError: bad tag name or the run has no such tag.
        """
        version = self.tag_version(run_id, name)
        self._io.rm(self._tag_path(run_id, name))
        return version

    def tag_version(self, run_id: str, name: str) -> int:
        """The version tag ``name`` of a run points to.

        Raises:
            StoreError: bad tag name, no such tag (the message lists the run's tags), malformed tag file.
        """
        path = self._tag_path(run_id, name)
        data = self._io.get(path, MAX_JSON_BYTES)
        if data is None:
            tags = self.tags(run_id)
            raise StoreError(f"run {run_id!r} has no tag {name!r} in {self.uri}; its tags: {tags or 'none'}")
        record = _json_load(data, self._io.uri(path))
        version = record.get("version") if isinstance(record, dict) else None
        if isinstance(version, bool) or not isinstance(version, int):
            raise StoreError(f"{self._io.uri(path)} is malformed: 'version' must be an integer")
        return validate_version(version)

    def tags(self, run_id: str) -> dict[str, int]:
        """Tag name -> version for one run, sorted by name; {} if it has none."""
        out = {}
        for path in self._io.find(f"{self._run_dir(run_id)}/tags"):
            name = path.rsplit("/", 1)[-1].removesuffix(".json")
            if path.endswith(".json") and TAG_RE.fullmatch(name) and not name.isdigit() and name != "latest":
                out[name] = self.tag_version(run_id, name)
        return dict(sorted(out.items()))

    # ------------------------------------------------------------- retention

    def retention_plan(self, run_id: str, policy: RetentionPolicy) -> dict[int, str | None]:
        """Version -> why ``policy`` keeps it, or None if ``gc`` would delete it (ascending)."""
        return plan_retention(self.versions(run_id), self.tags(run_id), policy)

    def gc(self, run_id: str, policy: RetentionPolicy, *, dry_run: bool = True) -> list[int]:
        """Delete the versions ``policy`` does not keep (never the newest; tagged ones unless keep_tags=False).

        A version disappears atomically: its manifest goes first, then its
        files. Without ``dry_run`` it also removes leftover data folders of
        failed or losing publish attempts inside complete versions, and (with
        ``keep_tags=False``) the tags of deleted versions.

        Returns:
            The versions deleted (or, with ``dry_run``, that would be), ascending.

        Raises:
            StoreError: bad run id, or the store failed (after retries).
        """
        tags = self.tags(run_id)
        plan = plan_retention(self.versions(run_id), tags, policy)
        doomed = [v for v, why in plan.items() if why is None]
        if dry_run:
            return doomed
        for version in doomed:
            vdir = self._version_dir(run_id, version)
            self._io.rm(f"{vdir}/{MANIFEST_FILE}")
            self._io.rm_tree(vdir)
        for name, version in tags.items():
            if version in doomed:
                self._io.rm(self._tag_path(run_id, name))
        self._remove_leftovers(run_id, [v for v, why in plan.items() if why is not None])
        return doomed

    def _remove_leftovers(self, run_id: str, versions: list[int]) -> None:
        """Delete data folders that the manifest of their (complete) version does not reference."""
        by_version: dict[int, set[str]] = {}
        for parts in self._adapter_files(run_id):
            match = VERSION_DIR_RE.fullmatch(parts[0]) if len(parts) == 3 else None
            if match:
                by_version.setdefault(int(match[1]), set()).add(parts[1])
        for version in versions:
            dirs = by_version.get(version, set())
            keep = self.manifest(run_id, version).data_dir if dirs else ""
            for data_dir in sorted(dirs - {keep}):
                self._io.rm_tree(f"{self._version_dir(run_id, version)}/{data_dir}")
