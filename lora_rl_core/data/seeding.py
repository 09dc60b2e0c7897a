"""Stable integer seeds derived from several parts.

Python's ``hash()`` of a str is salted per process, so it cannot seed
anything that must be reproducible across runs. ``stable_seed`` hashes the
``repr`` of its parts with SHA-256 instead.
"""

from __future__ import annotations

import hashlib


def stable_seed(*parts: object) -> int:
    """Mix ``parts`` (ints and strs) into one 64-bit seed, equal across processes.

    Args:
        *parts: values whose ``repr`` is stable, e.g. ``(seed, "test", index)``.

    Returns:
        A non-negative int below ``2**64`` for ``random.Random``.
    """
    digest = hashlib.sha256(repr(parts).encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big")
