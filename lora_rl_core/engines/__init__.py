"""Inference engines behind one protocol (`InferenceEngine`)."""

from lora_rl_core.engines.base import (
    Completion,
    GenerationRequest,
    InferenceEngine,
    SamplingParams,
    adapter_run,
    adapter_version,
    check_adapter_name,
)
from lora_rl_core.engines.embedded import EmbeddedEngine

__all__ = [
    "Completion",
    "EmbeddedEngine",
    "GenerationRequest",
    "InferenceEngine",
    "SamplingParams",
    "adapter_run",
    "adapter_version",
    "check_adapter_name",
]
