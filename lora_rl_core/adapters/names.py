"""Names of adapters, runs, versions, tags and adapter files: the one place for these rules.

Everything here is a pure function over strings. Run ids, tag names and file names become path
segments in the store, so each is checked against a narrow pattern (no ``/``, no ``..``, no leading
dot) before it touches a path. An adapter version is named ``<run_id>-v<version>``, the version
zero-padded to at least 6 digits (``run-v000007``, ``run-v1000000``); ``parse_adapter_name`` is the
one parser of that form, used by the store, the engines, the server and the subscriber.

Errors: ``StoreError`` for store names (run ids, versions, tags, specs, manifest file names);
``ValueError`` from ``check_adapter_name`` (engines re-raise it as ``EngineError``).
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
MAX_VERSION = 10**12 - 1

STORE_URI_PREFIX = "store://"
"""`GenerationRequest.adapter` or a load path of the form `store://RUN@VERSION`, `store://RUN@latest` or
`store://RUN-v000007` names a version in an engine's AdapterStore; it is loaded on first use."""

RUN_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
VERSION_DIR_RE = re.compile(r"v(\d{6,12})")
TAG_RE = re.compile(TAG_PATTERN)
DATA_DIR_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")
_FILE_NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")
_ADAPTER_NAME_RE = re.compile(r"(?P<run>.+)-v(?P<version>\d{6,12})")
_ENGINE_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}")
_VERSION_URI_RE = re.compile(r"(?P<root>.+)/(?P<run>[^/]+)/adapters/v(?P<version>\d{6,12})")


# ----------------------------------------------------------------- adapter names


def adapter_name(run_id: str, version: int) -> str:
    """Name an adapter version for engines and logs: ``f"{run_id}-v{version:06d}"``."""
    return f"{run_id}-v{version:06d}"


def parse_adapter_name(name: str | None) -> tuple[str, int] | None:
    """Split a versioned adapter name ``<run_id>-v<version>`` into ``(run_id, version)``.

    The inverse of ``adapter_name``: the run id must be a valid run id (``validate_run_id``) and the
    version 6 to 12 digits, written as ``adapter_name`` writes it (``run-v1000000`` is version
    1000000; ``run-v0000007`` is not a name ``adapter_name`` makes, so it is not versioned).

    Returns:
        ``(run_id, version)``, or None for None, the base model and names that are not versioned.
    """
    match = _ADAPTER_NAME_RE.fullmatch(name or "")
    if match is None or not _is_run_id(match["run"]):
        return None
    run_id, version = match["run"], int(match["version"])
    return (run_id, version) if adapter_name(run_id, version) == name else None


def adapter_version(name: str | None) -> int | None:
    """The version of a versioned adapter name (``parse_adapter_name``); None for other names."""
    parsed = parse_adapter_name(name)
    return parsed[1] if parsed else None


def adapter_run(name: str | None) -> str | None:
    """The run id of a versioned adapter name (``parse_adapter_name``); None for other names."""
    parsed = parse_adapter_name(name)
    return parsed[0] if parsed else None


def check_adapter_name(name: str) -> str:
    """Return ``name`` if it is safe as an engine adapter name (no ``/``, ``..``, spaces); else raise ValueError.

    Versioned names (``<run>-v<NNNNNN>``) are the usual ones, but any 1-200 characters from
    ``[A-Za-z0-9._-]`` starting with a letter or digit are accepted.
    """
    if not isinstance(name, str) or not _ENGINE_NAME_RE.fullmatch(name) or ".." in name:
        raise ValueError(
            f"bad adapter name {name!r}: use letters, digits, '.', '_' and '-' (no '/', no '..'), e.g. run-v000003"
        )
    return name


def parse_version_uri(uri: str) -> tuple[str, str, int] | None:
    """Split a store version folder URI ``<store>/<run_id>/adapters/v<NNNNNN>`` (``AdapterRef.uri``).

    Returns:
        ``(store_root, run_id, version)``, or None when ``uri`` does not have that form.
    """
    match = _VERSION_URI_RE.fullmatch(uri.rstrip("/"))
    if match is None or not _is_run_id(match["run"]):
        return None
    return match["root"], match["run"], int(match["version"])


# ----------------------------------------------------------------- store names


def _is_run_id(run_id: object) -> bool:
    return isinstance(run_id, str) and RUN_ID_RE.fullmatch(run_id) is not None and ".." not in run_id


def validate_run_id(run_id: str) -> str:
    """Check that ``run_id`` is safe as one path segment and return it.

    Allowed: ``[A-Za-z0-9][A-Za-z0-9._-]{0,127}`` without ``..``.

    Raises:
        StoreError: naming the bad value.
    """
    if not _is_run_id(run_id):
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
    ``"RUN-v000007"`` (an adapter name, ``parse_adapter_name``; a bare spec that
    parses as one is always read this way).

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
    parsed = parse_adapter_name(spec)
    if parsed is not None:
        return parsed
    return validate_run_id(spec), None
