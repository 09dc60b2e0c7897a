"""Integration fixtures: a Prefect test server for the whole session."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True, scope="session")
def prefect_harness():
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness():
        yield
