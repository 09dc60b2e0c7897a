"""Inference engines behind one protocol (`InferenceEngine`), with SGLang's LoRA semantics.

`base`: the protocol and records; `embedded`: the in-process engine; `pool`: its adapter registry and
resident pool; `scheduler`: its batch formation.
"""

from lora_rl_core.engines.base import (
    ABORT_REASONS,
    PAUSE_MODES,
    STORE_URI_PREFIX,
    Completion,
    GenerationRequest,
    InferenceEngine,
    SamplingParams,
    adapter_run,
    adapter_version,
    check_adapter_name,
    unknown_adapter_message,
)
from lora_rl_core.engines.embedded import EmbeddedEngine
from lora_rl_core.engines.http import (
    EngineUnavailable,
    MultiEngine,
    ServerEngine,
    SGLangEngine,
    connect_engines,
    peft_folder,
)
from lora_rl_core.engines.launch import sglang_launch_command, sglang_launch_command_from_config
from lora_rl_core.engines.pool import EVICTION_POLICIES, AdapterPool
from lora_rl_core.engines.scheduler import BatchLimits, form_batch

__all__ = [
    "ABORT_REASONS",
    "EVICTION_POLICIES",
    "PAUSE_MODES",
    "STORE_URI_PREFIX",
    "AdapterPool",
    "BatchLimits",
    "Completion",
    "EmbeddedEngine",
    "EngineUnavailable",
    "MultiEngine",
    "SGLangEngine",
    "ServerEngine",
    "connect_engines",
    "peft_folder",
    "sglang_launch_command",
    "sglang_launch_command_from_config",
    "GenerationRequest",
    "InferenceEngine",
    "SamplingParams",
    "adapter_run",
    "adapter_version",
    "check_adapter_name",
    "form_batch",
    "unknown_adapter_message",
]
