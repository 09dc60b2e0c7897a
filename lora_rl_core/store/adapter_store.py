"""``AdapterStore``: the public face of the versioned adapter store; its parts live next to it.

See the package docstring (``lora_rl_core.store``) for the layout and the protocol. The store owns one
``StoreIO`` and one ``StoreLayout`` (root, paths, size caps) and shares them with its parts:

* ``VersionReader`` (``reader.py``): runs, versions, manifests, refs, ``resolve`` of specs;
* ``AdapterPublisher`` (``publish.py``): publish, the manifest last and exclusively, lost races, ``LATEST``;
* ``AdapterVerifier`` (``verify.py``): verify, pull and load, with checksums and adapter checks;
* ``AdapterTags`` (``tags.py``) and ``Retention`` (``retention.py``: ``retention_plan``, ``gc``).

Each public method delegates to one part.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import fsspec
from fsspec import AbstractFileSystem

from lora_rl_core.adapters.validation import AdapterRules
from lora_rl_core.errors import StoreError
from lora_rl_core.store.io import RetryPolicy, StoreIO
from lora_rl_core.store.layout import DEFAULT_MAX_FILE_BYTES, StoreLayout
from lora_rl_core.store.publish import AdapterPublisher, PreparedVersion
from lora_rl_core.store.reader import VersionReader
from lora_rl_core.store.records import AdapterManifest, AdapterRef, RetentionPolicy
from lora_rl_core.store.retention import Retention
from lora_rl_core.store.tags import AdapterTags
from lora_rl_core.store.verify import AdapterVerifier

if TYPE_CHECKING:
    import torch


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
        self._io = StoreIO(fs, retry or RetryPolicy())
        self._layout = StoreLayout(root.rstrip("/") or "/", max_file_bytes)
        self._reader = VersionReader(self._io, self._layout)
        # The commit is looked up on each publish, so AdapterStore._commit_manifest stays the seam tests patch.
        self._publisher = AdapterPublisher(
            self._io, self._layout, self._reader, commit=lambda manifest: self._commit_manifest(manifest)
        )
        self._verifier = AdapterVerifier(self._io, self._layout, self._reader)
        self._tags = AdapterTags(self._io, self._layout, self._reader)
        self._retention = Retention(self._io, self._layout, self._reader, self._tags)

    @property
    def uri(self) -> str:
        """The store root as an absolute URI, e.g. ``file:///abs/runs``."""
        return self._reader.uri

    @property
    def max_file_bytes(self) -> int:
        """Largest adapter file published or read, in bytes (``.json`` files: ``MAX_JSON_BYTES``)."""
        return self._layout.max_file_bytes

    @max_file_bytes.setter
    def max_file_bytes(self, value: int) -> None:
        self._layout.max_file_bytes = value

    def __repr__(self) -> str:
        return f"AdapterStore({self.uri!r})"

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
        return self._publisher.publish(
            run_id,
            version,
            tensors=tensors,
            adapter_config=adapter_config,
            step=step,
            base_model=base_model,
            metrics=metrics,
            before_manifest=before_manifest,
        )

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
        """The in-memory half of ``publish``: check the tensors and serialise the version, reading and writing
        nothing in the store. The result holds bytes only, so later changes to ``tensors`` do not reach it, and
        its ``ref`` (version folder URI, sha256) is the one the version has once ``write`` stores it.

        Args:
            as ``publish``.

        Raises:
            StoreError: non-finite tensors, a malformed config or tensors that do not match it, a file over
                ``max_file_bytes``, bad run id or version.
        """
        return self._publisher.prepare(
            run_id,
            version,
            tensors=tensors,
            adapter_config=adapter_config,
            step=step,
            base_model=base_model,
            metrics=metrics,
        )

    def check(self, tensors: dict[str, torch.Tensor], adapter_config: dict) -> None:
        """The checks ``prepare`` runs on the tensors (finite, well-formed, matching the config), without
        serialising them: a training run checks a version at once and serialises it in the background.

        Raises:
            StoreError: non-finite tensors, a malformed config or tensors that do not match it.
        """
        AdapterRules(allow_dora=True).check_tensors(tensors, adapter_config)

    def unwritten_ref(self, run_id: str, version: int) -> AdapterRef:
        """The ref a version will have, before it is serialised: its folder URI, ``sha256`` None (its write
        computes it; ``ref`` gives the complete one once the version exists).

        Raises:
            StoreError: bad run id or version.
        """
        return self._reader.unwritten_ref(run_id, version)

    def write(self, prepared: PreparedVersion, *, before_manifest: Callable[[], None] | None = None) -> AdapterRef:
        """The store half of ``publish``: write a prepared version (data files, then the manifest, exclusively),
        from any thread. ``publish(...)`` is ``write(prepare(...))``.

        Args:
            prepared: from ``prepare``.
            before_manifest: as ``publish``.

        Returns:
            ``prepared.ref`` (or the ref of an identical version already stored).

        Raises:
            StoreError: the version already exists with different bytes, another writer won the race for it,
                or the store failed (after retries). Nothing of a failed attempt stays visible.
        """
        return self._publisher.write(prepared, before_manifest)

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
        return self._publisher.publish_folder(
            run_id, version, folder, step=step, base_model=base_model, metrics=metrics
        )

    def _commit_manifest(self, manifest: AdapterManifest) -> bool:
        """The commit step of every publish (``AdapterPublisher.commit_manifest``); racing-writer tests patch it."""
        return self._publisher.commit_manifest(manifest)

    # ------------------------------------------------------------- read

    def runs(self) -> list[str]:
        """Run ids in the store (folders with a valid run-id name), sorted."""
        return self._reader.runs()

    def versions(self, run_id: str) -> list[int]:
        """Complete versions of a run (manifest present), ascending; [] if none.

        One recursive listing of ``<run>/adapters/``; no adapter bytes are read.
        """
        return self._reader.versions(run_id)

    def latest(self, run_id: str) -> AdapterRef | None:
        """The newest complete version of a run, or None if it has none.

        Reads the manifests rather than trusting ``LATEST``, which can lag.
        """
        return self._reader.latest(run_id)

    def manifest(self, run_id: str, version: int) -> AdapterManifest:
        """The manifest of one version.

        Raises:
            StoreError: the version is missing or incomplete (the message lists
                the run's available versions), or its manifest is malformed or unsafe.
        """
        return self._reader.manifest(run_id, version)

    def ref(self, run_id: str, version: int) -> AdapterRef:
        """The ref of one complete version.

        Raises:
            StoreError: as ``manifest``.
        """
        return self._reader.ref(run_id, version)

    def files_uri(self, run_id: str, version: int) -> str:
        """URI of the folder holding a version's PEFT files, for engines that read the store directly.

        Such a reader skips the checksums; prefer ``load_tensors`` or ``pull``.

        Raises:
            StoreError: as ``manifest``.
        """
        return self._reader.files_uri(run_id, version)

    def resolve(self, spec: str) -> AdapterRef:
        """Resolve ``"RUN@7"``, ``"RUN@best"`` (a tag), ``"RUN@latest"``, ``"RUN"`` or ``"RUN-v000007"``.

        Raises:
            StoreError: bad spec, unknown version or tag, or a run with no versions.
        """
        return self._reader.resolve(spec, self._tags.tag_version)

    # ------------------------------------------------------------- fetch

    def verify(self, run_id: str, version: int, *, rules: AdapterRules | None = None) -> AdapterManifest:
        """Download a version and check it end to end without keeping it.

        Checks sizes and sha256 of every file, the safetensors format, and the
        config and weights against ``rules`` (default: any LoRA, DoRA allowed).

        Returns:
            The version's manifest.

        Raises:
            StoreError: naming the object at fault (missing, truncated, checksum mismatch, malformed).
        """
        return self._verifier.verify(run_id, version, rules=rules)

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
        return self._verifier.pull(run_id, version, dest)

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
        return self._verifier.load_tensors(run_id, version, rules=rules)

    # ------------------------------------------------------------- tags

    def tag(self, run_id: str, version: int, name: str) -> None:
        """Point tag ``name`` of a run at a complete version (moves an existing tag).

        Tagged versions survive ``gc``; ``RUN@name`` resolves to the version.

        Raises:
            StoreError: bad tag name (``latest`` and all-digit names are reserved) or unknown version.
        """
        self._tags.tag(run_id, version, name)

    def untag(self, run_id: str, name: str) -> int:
        """Remove a tag; returns the version it pointed to.

        Raises:
            StoreError: bad tag name or the run has no such tag.
        """
        return self._tags.untag(run_id, name)

    def tag_version(self, run_id: str, name: str) -> int:
        """The version tag ``name`` of a run points to.

        Raises:
            StoreError: bad tag name, no such tag (the message lists the run's tags), malformed tag file.
        """
        return self._tags.tag_version(run_id, name)

    def tags(self, run_id: str) -> dict[str, int]:
        """Tag name -> version for one run, sorted by name; {} if it has none."""
        return self._tags.tags(run_id)

    # ------------------------------------------------------------- retention

    def retention_plan(self, run_id: str, policy: RetentionPolicy) -> dict[int, str | None]:
        """Version -> why ``policy`` keeps it, or None if ``gc`` would delete it (ascending)."""
        return self._retention.plan(run_id, policy)

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
        return self._retention.gc(run_id, policy, dry_run=dry_run)
