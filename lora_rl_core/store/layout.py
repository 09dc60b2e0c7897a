"""Paths, size caps and file encodings of the adapter store layout (docs/DESIGN.md, "Object store layout").

Every part of the store (reader, publisher, verifier, tags, retention) builds its paths with ``StoreLayout``,
so each path is spelled once and every run id, version and tag is validated before it becomes a path.

Choices: JSON is written deterministically (sorted keys, sets as sorted lists), so identical publishes
write identical bytes; ``.json`` files are capped at ``MAX_JSON_BYTES`` whatever ``max_file_bytes`` says.
Left out: any I/O (that is ``StoreIO``).
"""

from __future__ import annotations

import hashlib
import json
from datetime import UTC, datetime
from typing import Any

from lora_rl_core.adapters.names import LATEST_FILE, MANIFEST_FILE, validate_run_id, validate_tag, validate_version
from lora_rl_core.errors import StoreError
from lora_rl_core.store.records import AdapterManifest

DEFAULT_MAX_FILE_BYTES = 2 * 2**30
MAX_JSON_BYTES = 2**20  # manifest, adapter config, tags, LATEST


def sha256_hex(data: bytes) -> str:
    """The sha256 of ``data`` as 64 hex digits."""
    return hashlib.sha256(data).hexdigest()


def utc_now() -> str:
    """The current time as ISO-8601 UTC to the second, e.g. ``2026-01-31T12:00:00+00:00``."""
    return datetime.now(UTC).isoformat(timespec="seconds")


def _json_default(obj: Any) -> Any:
    if isinstance(obj, (set, frozenset)):
        return sorted(obj)
    raise TypeError(f"{type(obj).__name__} is not JSON serialisable")


def json_bytes(obj: Any, what: str) -> bytes:
    """Deterministic JSON (sorted keys, indent 2; sets become sorted lists) as UTF-8 bytes.

    Raises:
        StoreError: ``obj`` holds something JSON cannot represent (the message names ``what``).
    """
    try:
        return json.dumps(obj, indent=2, sort_keys=True, default=_json_default).encode()
    except (TypeError, ValueError) as e:
        raise StoreError(f"cannot write {what} as JSON: {e}") from e


def json_load(data: bytes, what: str) -> Any:
    """Parse JSON read from the store.

    Raises:
        StoreError: ``data`` is not valid JSON (the message names ``what``, usually a URI).
    """
    try:
        return json.loads(data)
    except ValueError as e:
        raise StoreError(f"{what} is not valid JSON: {e}") from e


def human_size(n_bytes: int) -> str:
    """A size for messages: bytes below 1 MiB, else MiB or GiB."""
    if n_bytes < 2**20:
        return f"{n_bytes} bytes"
    return f"{n_bytes / 2**30:.2f} GiB" if n_bytes >= 2**30 else f"{n_bytes / 2**20:.1f} MiB"


class StoreLayout:
    """Where things live under one store root, and how large each file may be.

    Args:
        root: the store root as a filesystem path without protocol (``/abs/runs``, ``bucket/runs``).
        max_file_bytes: largest adapter file published or read, in bytes; ``.json`` files are
            capped at ``MAX_JSON_BYTES`` instead.

    Path methods raise ``StoreError`` for a bad run id, version or tag name (they are checked
    before they become paths).
    """

    def __init__(self, root: str, max_file_bytes: int = DEFAULT_MAX_FILE_BYTES):
        self.root = root
        self.max_file_bytes = max_file_bytes

    def run_dir(self, run_id: str) -> str:
        """``<root>/<run_id>``."""
        return f"{self.root}/{validate_run_id(run_id)}"

    def adapters_dir(self, run_id: str) -> str:
        """``<root>/<run_id>/adapters``: every version folder and ``LATEST``."""
        return f"{self.run_dir(run_id)}/adapters"

    def version_dir(self, run_id: str, version: int) -> str:
        """``<root>/<run_id>/adapters/v000007``."""
        return f"{self.adapters_dir(run_id)}/v{validate_version(version):06d}"

    def manifest_path(self, run_id: str, version: int) -> str:
        """``<version_dir>/manifest.json``, whose presence makes the version exist."""
        return f"{self.version_dir(run_id, version)}/{MANIFEST_FILE}"

    def files_dir(self, manifest: AdapterManifest) -> str:
        """The folder holding a version's data files: its ``data_dir``, or the version folder for old versions."""
        vdir = self.version_dir(manifest.run_id, manifest.version)
        return f"{vdir}/{manifest.data_dir}" if manifest.data_dir else vdir

    def latest_path(self, run_id: str) -> str:
        """``<root>/<run_id>/adapters/LATEST``, a hint for outside readers."""
        return f"{self.adapters_dir(run_id)}/{LATEST_FILE}"

    def tags_dir(self, run_id: str) -> str:
        """``<root>/<run_id>/tags``."""
        return f"{self.run_dir(run_id)}/tags"

    def tag_path(self, run_id: str, name: str) -> str:
        """``<root>/<run_id>/tags/<name>.json``."""
        return f"{self.tags_dir(run_id)}/{validate_tag(name)}.json"

    def limit(self, name: str) -> int:
        """The size cap in bytes of a file named ``name``."""
        return MAX_JSON_BYTES if name.endswith(".json") else self.max_file_bytes

    def check_size(self, name: str, size: int, where: str) -> None:
        """Refuse a file over its cap.

        Args:
            name: the file name (picks the cap); size: its size in bytes; where: its path or URI for the message.

        Raises:
            StoreError: ``size`` is over the cap.
        """
        if size > self.limit(name):
            raise StoreError(
                f"{where} is {human_size(size)}, over the store's limit of {human_size(self.limit(name))} "
                f"({'JSON files' if name.endswith('.json') else 'max_file_bytes'})"
            )
