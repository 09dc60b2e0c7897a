"""Fixtures shared by unit tests."""

from __future__ import annotations

import uuid

import fsspec
import pytest

from tests.support.embedded_engine import engine, make_engine  # noqa: F401 - the embedded engine's fixtures


@pytest.fixture
def memory_root():
    """A fresh memory:// store root, removed afterwards."""
    root = f"memory://unit-{uuid.uuid4().hex}"
    yield root
    fs, path = fsspec.core.url_to_fs(root)
    if fs.exists(path):
        fs.rm(path, recursive=True)
