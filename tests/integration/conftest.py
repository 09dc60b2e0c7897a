"""Integration fixtures: a Prefect test server for the whole session; an embedded engine on the tiny model."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True, scope="session")
def prefect_harness():
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness():
        yield


@pytest.fixture
def backend(tiny_model_dir) -> Iterator:
    """An `EmbeddedEngine` on the tiny model (float32, batches of 8): what the SGLang look-alike serves."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lora_rl_core.engines import EmbeddedEngine

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with EmbeddedEngine(model, AutoTokenizer.from_pretrained(tiny_model_dir), max_batch_size=8) as engine:
        yield engine
