"""``VersionReader``: what the store holds (runs, complete versions, manifests, refs, specs), without adapter bytes.

A version exists iff its ``manifest.json`` exists; ``LATEST`` is never trusted (``latest`` lists versions).
A manifest read back is untrusted input: it must describe the version it sits in, and its data folder
and file names must be safe before they become paths. Checksums of the data files are
``AdapterVerifier``'s job (``store/verify.py``).
"""

from __future__ import annotations

from collections.abc import Callable

from pydantic import ValidationError

from lora_rl_core.adapters.names import (
    DATA_DIR_RE,
    MANIFEST_FILE,
    MODEL_FILE,
    RUN_ID_RE,
    VERSION_DIR_RE,
    adapter_name,
    check_file_name,
    parse_adapter_spec,
    validate_run_id,
)
from lora_rl_core.errors import StoreError
from lora_rl_core.store.io import StoreIO
from lora_rl_core.store.layout import MAX_JSON_BYTES, StoreLayout
from lora_rl_core.store.records import AdapterManifest, AdapterRef


class VersionReader:
    """Lists runs and versions and reads manifests under one store root.

    Args:
        io: the store's I/O (retries, size caps, symlink refusal).
        layout: the store's paths.

    Every method raises ``StoreError`` for a bad run id or version, or when the store fails (after retries).
    """

    def __init__(self, io: StoreIO, layout: StoreLayout):
        self._io = io
        self._layout = layout

    @property
    def uri(self) -> str:
        """The store root as an absolute URI, e.g. ``file:///abs/runs``."""
        return self._io.uri(self._layout.root)

    def runs(self) -> list[str]:
        """Run ids in the store (folders with a valid run-id name), sorted."""
        names = self._io.ls_dirs(self._layout.root)
        return sorted(n for n in names if RUN_ID_RE.fullmatch(n) and ".." not in n)

    def versions(self, run_id: str) -> list[int]:
        """Complete versions of a run (manifest present), ascending; [] if none (one listing, no adapter bytes)."""
        found = {
            int(m[1])
            for parts in self.adapter_files(run_id)
            if len(parts) == 2 and parts[1] == MANIFEST_FILE
            if (m := VERSION_DIR_RE.fullmatch(parts[0]))
        }
        return sorted(found)

    def adapter_files(self, run_id: str) -> list[list[str]]:
        """Every file under ``<run>/adapters/``, as path segments relative to it (one recursive listing)."""
        adapters = f"{self._layout.adapters_dir(run_id)}/"
        paths = self._io.find(adapters.rstrip("/"))
        return [p[len(adapters) :].split("/") for p in paths if p.startswith(adapters)]

    def latest(self, run_id: str) -> AdapterRef | None:
        """The newest complete version of a run, or None if it has none (reads manifests, not ``LATEST``)."""
        versions = self.versions(run_id)
        return self.ref(run_id, versions[-1]) if versions else None

    def read_manifest(self, run_id: str, version: int) -> AdapterManifest | None:
        """The manifest of one version, or None if the version does not exist (yet).

        Raises:
            StoreError: the manifest is malformed, describes another adapter, or names an unsafe
                data folder or file.
        """
        path = self._layout.manifest_path(run_id, version)
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
            StoreError: the version is missing or incomplete (the message lists the run's
                available versions), or as ``read_manifest``.
        """
        manifest = self.read_manifest(run_id, version)
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
            StoreError: as ``manifest`` and ``ref_from``.
        """
        return self.ref_from(self.manifest(run_id, version))

    def unwritten_ref(self, run_id: str, version: int) -> AdapterRef:
        """``AdapterStore.unwritten_ref``: the version folder's URI, no checksum yet."""
        vdir = self._layout.version_dir(validate_run_id(run_id), version)
        return AdapterRef(run_id=run_id, version=version, uri=self._io.uri(vdir))

    def ref_from(self, manifest: AdapterManifest) -> AdapterRef:
        """The ref of the version ``manifest`` describes (its URI is the version folder).

        Raises:
            StoreError: the manifest lists no ``adapter_model.safetensors``.
        """
        entry = manifest.files.get(MODEL_FILE)
        vdir = self._layout.version_dir(manifest.run_id, manifest.version)
        if entry is None:
            raise StoreError(f"{self._io.uri(vdir)}/{MANIFEST_FILE} lists no {MODEL_FILE}")
        return AdapterRef(run_id=manifest.run_id, version=manifest.version, uri=self._io.uri(vdir), sha256=entry.sha256)

    def resolve(self, spec: str, tag_version: Callable[[str, str], int]) -> AdapterRef:
        """Resolve ``"RUN@7"``, ``"RUN@best"`` (a tag), ``"RUN@latest"``, ``"RUN"`` or ``"RUN-v000007"``.

        Args:
            spec: the adapter spec (``parse_adapter_spec``).
            tag_version: ``(run_id, tag) -> version`` (``AdapterTags.tag_version``), raising for an unknown tag.

        Raises:
            StoreError: bad spec, unknown version or tag, a tag whose version is gone, or a run with no versions.
        """
        run_id, selector = parse_adapter_spec(spec)
        if isinstance(selector, int):
            return self.ref(run_id, selector)
        if isinstance(selector, str):
            version = tag_version(run_id, selector)
            if self.read_manifest(run_id, version) is None:
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

    def files_uri(self, run_id: str, version: int) -> str:
        """URI of the folder holding a version's PEFT files (unverified reads; prefer ``AdapterVerifier``).

        Raises:
            StoreError: as ``manifest``.
        """
        return self._io.uri(self._layout.files_dir(self.manifest(run_id, version)))
