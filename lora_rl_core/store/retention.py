"""``Retention``: apply a ``RetentionPolicy`` to a run's versions (``AdapterStore.retention_plan`` and ``gc``).

The decision is the pure ``plan_retention`` (``store/records.py``); this module acts on it. A version
disappears atomically: its manifest goes first (it stops existing), then its files. Leftover data
folders of failed or losing publish attempts are removed inside complete versions only.
Left out: leftovers of versions that never completed (a publish may still be in flight there) and
locking against readers of the versions deleted (the newest and tagged versions are never deleted).
"""

from __future__ import annotations

from lora_rl_core.adapters.names import MANIFEST_FILE, VERSION_DIR_RE
from lora_rl_core.store.io import StoreIO
from lora_rl_core.store.layout import StoreLayout
from lora_rl_core.store.reader import VersionReader
from lora_rl_core.store.records import RetentionPolicy, plan_retention
from lora_rl_core.store.tags import AdapterTags


class Retention:
    """Plans and runs garbage collection of one store's versions.

    Args:
        io: the store's I/O; layout: its paths; reader: lists versions and reads manifests;
        tags: the tags that protect versions (and go with them under ``keep_tags=False``).
    """

    def __init__(self, io: StoreIO, layout: StoreLayout, reader: VersionReader, tags: AdapterTags):
        self._io = io
        self._layout = layout
        self._reader = reader
        self._tags = tags

    def plan(self, run_id: str, policy: RetentionPolicy) -> dict[int, str | None]:
        """Version -> why ``policy`` keeps it, or None if ``gc`` would delete it (ascending).

        Raises:
            StoreError: bad run id, a malformed tag file, or the store failed (after retries).
        """
        return plan_retention(self._reader.versions(run_id), self._tags.tags(run_id), policy)

    def gc(self, run_id: str, policy: RetentionPolicy, *, dry_run: bool = True) -> list[int]:
        """Delete the versions ``policy`` does not keep; ``AdapterStore.gc`` documents it.

        Returns:
            The versions deleted (or, with ``dry_run``, that would be), ascending.

        Raises:
            StoreError: bad run id, a malformed tag file, or the store failed (after retries).
        """
        tags = self._tags.tags(run_id)
        plan = plan_retention(self._reader.versions(run_id), tags, policy)
        doomed = [v for v, why in plan.items() if why is None]
        if dry_run:
            return doomed
        for version in doomed:
            vdir = self._layout.version_dir(run_id, version)
            self._io.rm(f"{vdir}/{MANIFEST_FILE}")
            self._io.rm_tree(vdir)
        for name, version in tags.items():
            if version in doomed:
                self._io.rm(self._layout.tag_path(run_id, name))
        self._remove_leftovers(run_id, [v for v, why in plan.items() if why is not None])
        return doomed

    def _remove_leftovers(self, run_id: str, versions: list[int]) -> None:
        """Delete data folders that the manifest of their (complete) version does not reference."""
        by_version: dict[int, set[str]] = {}
        for parts in self._reader.adapter_files(run_id):
            match = VERSION_DIR_RE.fullmatch(parts[0]) if len(parts) == 3 else None
            if match:
                by_version.setdefault(int(match[1]), set()).add(parts[1])
        for version in versions:
            dirs = by_version.get(version, set())
            keep = self._reader.manifest(run_id, version).data_dir if dirs else ""
            for data_dir in sorted(dirs - {keep}):
                self._io.rm_tree(f"{self._layout.version_dir(run_id, version)}/{data_dir}")
