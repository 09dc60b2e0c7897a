"""Names in the adapter store: file names, run ids, versions, tags and adapter specs.

Everything here is a pure function over strings. Run ids, tag names and file
names become path segments in the store, so each is checked against a narrow
pattern (no ``/``, no ``..``, no leading dot) before it touches a path.
"""

from __future__ import annotations

import re

from lora_rl_core.errors import StoreError

MODEL_FILE = "adapter_model.safetensors"
CONFIG_FILE = "adapter_config.json"
MANIFEST_FILE = "manifest.json"
LATEST_FILE = "LATEST"
RUN_CONFIG_FILE = "run.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")
ALLOWED_SUFFIXES = (".safetensors", ".json")
RESERVED_TAGS = frozenset({"latest"})
TAG_PATTERN = "[A-Za-z0-9][A-Za-z0-9._-]{0,63}"

RUN_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
VERSION_DIR_RE = re.compile(r"v(\d{6,12})")
TAG_RE = re.compile(TAG_PATTERN)
DATA_DIR_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")
_FILE_NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")
_NAME_SPEC_RE = re.compile(r"(.+)-v(\d{6,})")
MAX_VERSION = 10**12 - 1


def adapter_name(run_id: str, version: int) -> str:
    """Name an adapter for engines and logs: ``f"{run_id}-v{version:06d}"``."""
    return f"{run_id}-v{version:06d}"


def validate_run_id(run_id: str) -> str:
    """Check that ``run_id`` is safe as one path segment and return it.

    Allowed: ``[A-Za-z0-9][A-Za-z0-9._-]{0,127}`` without ``..``.

    Raises:
        StoreError: naming the bad value.
    """
    ok = isinstance(run_id, str) and RUN_ID_RE.fullmatch(run_id) and ".." not in run_id
    if not ok:
        raise StoreError(
            f"invalid run id {run_id!r}: use 1-128 characters from [A-Za-z0-9._-], "
            "starting with a letter or digit, without '..' or '/'"
        )
    return run_id


def validate_version(version: int) -> int:
    """Check that ``version`` is an integer in ``[0, 10**12)`` and return it.

    Raises:
        StoreError: naming the bad value.
    """
    if isinstance(version, bool) or not isinstance(version, int) or not 0 <= version <= MAX_VERSION:
        raise StoreError(f"invalid adapter version {version!r}: use an integer from 0 to {MAX_VERSION}")
    return version


def validate_tag(name: str) -> str:
    """Check a tag name (``best``, ``release``, user tags) and return it.

    Allowed: ``[A-Za-z0-9][A-Za-z0-9._-]{0,63}`` without ``..``, not all digits
    (``RUN@7`` means version 7) and not ``latest`` (always the newest version).

    Raises:
        StoreError: naming the bad value and the rule it breaks.
    """
    if not isinstance(name, str) or not TAG_RE.fullmatch(name) or ".." in name:
        raise StoreError(
            f"invalid tag name {name!r}: use 1-64 characters from [A-Za-z0-9._-], "
            "starting with a letter or digit, without '..' or '/'"
        )
    if name.isdigit():
        raise StoreError(f"invalid tag name {name!r}: it is all digits and would read as a version number")
    if name in RESERVED_TAGS:
        raise StoreError(f"invalid tag name {name!r}: it is reserved ({name!r} always means the newest version)")
    return name


def check_file_name(name: str, where: str) -> None:
    """Check a file name listed in a manifest: one plain segment, safetensors or JSON.

    Raises:
        StoreError: a path, a pickle file or another kind of file; ``where`` prefixes the message.
    """
    if not isinstance(name, str) or not _FILE_NAME_RE.fullmatch(name) or ".." in name:
        raise StoreError(f"{where}: unsafe file name {name!r} in manifest")
    if name.endswith(PICKLE_SUFFIXES):
        raise StoreError(f"{where}: pickle file {name!r} refused; adapters must be safetensors")
    if not name.endswith(ALLOWED_SUFFIXES) or name == MANIFEST_FILE:
        raise StoreError(f"{where}: file {name!r} refused; a version holds only .safetensors weights and .json files")


def parse_adapter_spec(spec: str) -> tuple[str, int | str | None]:
    """Parse an adapter spec into ``(run_id, selector)``.

    Accepted: ``"RUN@7"`` (version 7), ``"RUN@latest"`` and ``"RUN"`` (selector
    None: the newest version), ``"RUN@best"`` (selector ``"best"``: a tag name),
    ``"RUN-v000007"`` (an adapter name; a bare spec ending in ``-vNNNNNN`` is
    always read this way).

    Returns:
        ``(run_id, selector)`` where selector is an int version, a tag name or None.

    Raises:
        StoreError: on an empty spec, a bad version or tag, or a bad run id.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise StoreError(f"invalid adapter spec {spec!r}: use RUN@VERSION, RUN@TAG, RUN@latest or RUN")
    spec = spec.strip()
    if "@" in spec:
        run_id, _, selector = spec.partition("@")
        run_id = validate_run_id(run_id)
        if selector == "latest":
            return run_id, None
        if selector.isdigit():
            return run_id, validate_version(int(selector))
        if not TAG_RE.fullmatch(selector) or ".." in selector:
            raise StoreError(
                f"invalid adapter spec {spec!r}: after '@' use a version number, 'latest' or a tag name "
                f"matching {TAG_PATTERN}"
            )
        return run_id, selector
    match = _NAME_SPEC_RE.fullmatch(spec)
    if match:
        return validate_run_id(match[1]), validate_version(int(match[2]))
    return validate_run_id(spec), None
