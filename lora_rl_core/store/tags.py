"""``AdapterTags``: named pointers to versions of a run (``<store>/<run>/tags/<name>.json``).

A tag file holds ``{"version": 7, "tagged_at": ISO-8601 UTC}``; moving a tag rewrites it. A tag may
outlive its version (``gc`` with ``keep_tags=False`` removes the tags of the versions it deletes;
``AdapterStore.resolve`` reports a dangling one). ``latest`` and all-digit names are reserved,
because ``RUN@latest`` and ``RUN@7`` mean something else.
"""

from __future__ import annotations

from lora_rl_core.adapters.names import TAG_RE, validate_version
from lora_rl_core.errors import StoreError
from lora_rl_core.store.io import StoreIO
from lora_rl_core.store.layout import MAX_JSON_BYTES, StoreLayout, json_bytes, json_load, utc_now
from lora_rl_core.store.reader import VersionReader


class AdapterTags:
    """Sets, moves, removes and reads the tags of a run; ``AdapterStore.tag`` and friends document them.

    Args:
        io: the store's I/O; layout: its paths; reader: checks that a tagged version exists.

    Every method raises ``StoreError`` for a bad run id or tag name, or when the store fails (after retries).
    """

    def __init__(self, io: StoreIO, layout: StoreLayout, reader: VersionReader):
        self._io = io
        self._layout = layout
        self._reader = reader

    def tag(self, run_id: str, version: int, name: str) -> None:
        """Point tag ``name`` of a run at a complete version (moves an existing tag).

        Raises:
            StoreError: bad tag name or unknown version.
        """
        path = self._layout.tag_path(run_id, name)
        self._reader.manifest(run_id, version)
        self._io.put(path, json_bytes({"version": version, "tagged_at": utc_now()}, f"tag {name}"))

    def untag(self, run_id: str, name: str) -> int:
        """Remove a tag; returns the version it pointed to.

        Raises:
            StoreError: as ``tag_version``.
        """
        version = self.tag_version(run_id, name)
        self._io.rm(self._layout.tag_path(run_id, name))
        return version

    def tag_version(self, run_id: str, name: str) -> int:
        """The version tag ``name`` of a run points to.

        Raises:
            StoreError: bad tag name, no such tag (the message lists the run's tags), malformed tag file.
        """
        path = self._layout.tag_path(run_id, name)
        data = self._io.get(path, MAX_JSON_BYTES)
        if data is None:
            tags = self.tags(run_id)
            raise StoreError(f"run {run_id!r} has no tag {name!r} in {self._reader.uri}; its tags: {tags or 'none'}")
        record = json_load(data, self._io.uri(path))
        version = record.get("version") if isinstance(record, dict) else None
        if isinstance(version, bool) or not isinstance(version, int):
            raise StoreError(f"{self._io.uri(path)} is malformed: 'version' must be an integer")
        return validate_version(version)

    def tags(self, run_id: str) -> dict[str, int]:
        """Tag name -> version for one run, sorted by name; {} if it has none.

        Raises:
            StoreError: a malformed tag file (as ``tag_version``).
        """
        out = {}
        for path in self._io.find(self._layout.tags_dir(run_id)):
            name = path.rsplit("/", 1)[-1].removesuffix(".json")
            if path.endswith(".json") and TAG_RE.fullmatch(name) and not name.isdigit() and name != "latest":
                out[name] = self.tag_version(run_id, name)
        return dict(sorted(out.items()))
