"""Records of the adapter store (manifest, ref) and the retention policy.

``plan_retention`` is a pure function: given a run's versions and tags it says
which versions a policy keeps and why; ``AdapterStore.gc`` acts on it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from lora_rl_core.adapters.names import adapter_name
from lora_rl_core.errors import StoreError


class FileEntry(BaseModel):
    """One file of an adapter version: its sha256 (hex) and size in bytes."""

    sha256: str
    size: int


class AdapterRef(BaseModel):
    """A small, JSON-serialisable pointer to one complete adapter version.

    This is what crosses task boundaries. ``uri`` is the version folder (for
    example ``file:///abs/runs/r1/adapters/v000003``); ``sha256`` is the hex
    digest of its ``adapter_model.safetensors``, or None in the ref a training
    run's publish returns before the version is serialised (its write, in the
    background, computes it; the manifest has it once the version exists).
    """

    run_id: str
    version: int
    uri: str
    sha256: str | None = None

    @property
    def name(self) -> str:
        """The adapter name, ``adapter_name(run_id, version)``."""
        return adapter_name(self.run_id, self.version)


class AdapterManifest(BaseModel):
    """The ``manifest.json`` of a version; its presence makes the version exist.

    ``created_at`` is ISO-8601 UTC; ``files`` maps file name to checksum and
    size; ``lora`` holds rank, alpha and target_modules for display only.
    ``data_dir`` is the sub-folder of the version folder that holds the files
    (one per publish attempt; ``""`` for versions written before it existed,
    whose files lie in the version folder itself).
    """

    run_id: str
    version: int
    step: int
    created_at: str
    base_model: str
    files: dict[str, FileEntry]
    metrics: dict[str, float] = {}
    lora: dict[str, Any] = {}
    data_dir: str = ""


@dataclass(frozen=True)
class RetentionPolicy:
    """Which versions of a run ``AdapterStore.gc`` keeps.

    Args:
        keep_last: keep the newest ``keep_last`` versions (>= 1, so the newest
            version is always kept).
        keep_every: also keep every version whose number is a multiple of this
            (``10`` keeps v10, v20, ...); None keeps none this way.
        keep_tags: also keep every tagged version (``best``, ``release``, ...).
            With False, tags do not protect, and the tags of deleted versions go too.

    Raises:
        StoreError: keep_last < 1 or keep_every < 1.
    """

    keep_last: int = 5
    keep_every: int | None = None
    keep_tags: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.keep_last, bool) or not isinstance(self.keep_last, int) or self.keep_last < 1:
            raise StoreError(
                f"keep_last must be an integer >= 1 (the newest version is always kept), got {self.keep_last!r}"
            )
        if self.keep_every is not None and (not isinstance(self.keep_every, int) or self.keep_every < 1):
            raise StoreError(f"keep_every must be an integer >= 1 or unset, got {self.keep_every!r}")


def plan_retention(versions: list[int], tags: dict[str, int], policy: RetentionPolicy) -> dict[int, str | None]:
    """Decide, for each version, whether ``policy`` keeps it.

    Args:
        versions: the run's complete versions.
        tags: tag name -> version.
        policy: the retention policy.

    Returns:
        version -> why it is kept (e.g. ``"last 3, tag best"``), or None when it is to be deleted;
        in ascending version order.
    """
    ordered = sorted(versions)
    last = set(ordered[-policy.keep_last :])
    tagged: dict[int, list[str]] = {}
    for name, version in sorted(tags.items()):
        tagged.setdefault(version, []).append(name)
    plan: dict[int, str | None] = {}
    for version in ordered:
        reasons = []
        if version in last:
            reasons.append(f"last {policy.keep_last}")
        if policy.keep_every and version % policy.keep_every == 0:
            reasons.append(f"every {policy.keep_every}")
        if policy.keep_tags and version in tagged:
            reasons.append("tag " + ",".join(tagged[version]))
        plan[version] = ", ".join(reasons) or None
    return plan
