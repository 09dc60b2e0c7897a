"""Inference engines behind one protocol (`InferenceEngine`), with SGLang's LoRA semantics.

`base`: the protocol and records; `embedded`: the in-process engine (request lifecycle); `requests`: its
queue, admission and abort; `peft_model`: its model and adapter injection; `pool`: its adapter registry and
resident pool; `scheduler`: its batch formation. Adapter names, files and checks: `lora_rl_core.adapters`.
"""

from lora_rl_core.engines.base import (
    ABORT_REASONS,
    PAUSE_MODES,
    Completion,
    GenerationRequest,
    InferenceEngine,
    SamplingParams,
    unknown_adapter_message,
)
from lora_rl_core.engines.embedded import EmbeddedEngine
from lora_rl_core.engines.http import (
    EngineUnavailable,
    MultiEngine,
    ServerEngine,
    SGLangEngine,
    connect_engines,
)
from lora_rl_core.engines.launch import sglang_launch_command, sglang_launch_command_from_config
from lora_rl_core.engines.pool import EVICTION_POLICIES, AdapterPool
from lora_rl_core.engines.scheduler import BatchLimits, form_batch

__all__ = [
    "ABORT_REASONS",
    "EVICTION_POLICIES",
    "PAUSE_MODES",
    "AdapterPool",
    "BatchLimits",
    "Completion",
    "EmbeddedEngine",
    "EngineUnavailable",
    "MultiEngine",
    "SGLangEngine",
    "ServerEngine",
    "connect_engines",
    "sglang_launch_command",
    "sglang_launch_command_from_config",
    "GenerationRequest",
    "InferenceEngine",
    "SamplingParams",
    "form_batch",
    "unknown_adapter_message",
]
