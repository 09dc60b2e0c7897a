"""Inference engines behind one protocol (`InferenceEngine`), with SGLang's LoRA semantics.

`base`: the protocol and records; `embedded`: the in-process engine (request lifecycle); `requests`: its
queue, admission and abort; `peft_model`: its model and adapter injection; `pool`: its adapter registry and
resident pool; `scheduler`: its batch formation. `http`: the HTTP clients (`SGLangEngine`, `ServerEngine`),
with `http_wire` (the wire format) and `http_tracking` (their requests in flight); `multi`: several engines
behind one (`MultiEngine`, `connect_engines`); `server`: our SGLang-compatible server (`lora-rl serve`), with
`server_api` (request bodies, answers), `server_adapters` (load/unload routes) and `server_metrics`
(Prometheus); `factory`: `build_engine`. Adapter names, files and checks: `lora_rl_core.adapters`.
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
from lora_rl_core.engines.http import EngineUnavailable, ServerEngine, SGLangEngine
from lora_rl_core.engines.launch import sglang_launch_command, sglang_launch_command_from_config
from lora_rl_core.engines.multi import MultiEngine, connect_engines
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
