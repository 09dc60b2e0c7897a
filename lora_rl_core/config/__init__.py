"""Typed run configuration: one pydantic model per component, loaded from YAML.

Modules: `base` (`Section`, the allowed values of choice fields), `engine` (the `engine` section),
`sections` (the other sections and `RunConfig`), `load` (YAML and overrides into a `RunConfig`).

`RunConfig` has the sections model, lora, algorithm, rollout, engine, store,
trainer, data, reward and run. Every field has a default, so YAML files stay
sparse. Unknown keys and bad values fail before any work starts, with the
dotted field path and the reason (`ConfigError`).

Overrides use dotted paths (`lora.rank=32`, `rollout.temperature=0.7`); the
value is parsed as YAML, so `lora.target_modules=[q_proj,v_proj]` gives a list.
"""

from lora_rl_core.config.base import (
    EVICTION_POLICIES,
    IPC_LAYOUTS,
    OFF_POLICY_CORRECTIONS,
    REMOTE_ENGINE_KINDS,
    SGLANG_DEFAULT_PORT,
    SGLANG_RETIRE_POLICIES,
    TENSOR_DTYPES,
    TENSOR_TRANSPORTS,
    EngineKind,
    EvictionPolicy,
    IpcLayout,
    OffPolicyCorrection,
    RemoteEngineKind,
    RolloutMode,
    Section,
    SGLangAbort,
    SGLangRetire,
    TensorDtype,
    TensorTransport,
)
from lora_rl_core.config.engine import (
    ENGINE_DEFAULTS,
    EngineConfig,
    SGLangLaunchConfig,
)
from lora_rl_core.config.load import (
    apply_override,
    config_from_dict,
    load_config,
)
from lora_rl_core.config.sections import (
    AlgorithmConfig,
    DataConfig,
    EvalConfig,
    LoRAConfig,
    ModelConfig,
    RewardConfig,
    RewardFunctionConfig,
    RolloutConfig,
    RunConfig,
    RunSection,
    StoreConfig,
    TrainerConfig,
)

__all__ = [
    "AlgorithmConfig",
    "DataConfig",
    "EvalConfig",
    "ENGINE_DEFAULTS",
    "EVICTION_POLICIES",
    "EngineConfig",
    "EngineKind",
    "EvictionPolicy",
    "IPC_LAYOUTS",
    "IpcLayout",
    "LoRAConfig",
    "ModelConfig",
    "OFF_POLICY_CORRECTIONS",
    "OffPolicyCorrection",
    "REMOTE_ENGINE_KINDS",
    "RemoteEngineKind",
    "RewardConfig",
    "RewardFunctionConfig",
    "RolloutConfig",
    "RolloutMode",
    "RunConfig",
    "RunSection",
    "SGLANG_DEFAULT_PORT",
    "SGLANG_RETIRE_POLICIES",
    "SGLangLaunchConfig",
    "SGLangAbort",
    "SGLangRetire",
    "Section",
    "StoreConfig",
    "TENSOR_DTYPES",
    "TENSOR_TRANSPORTS",
    "TensorDtype",
    "TensorTransport",
    "TrainerConfig",
    "apply_override",
    "config_from_dict",
    "load_config",
]
