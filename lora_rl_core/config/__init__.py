"""Typed run configuration: one pydantic model per component, loaded from YAML.

Modules: `base` (`Section`, the allowed values of choice fields, `keyed_by_type`), `engine` (the `engine`
section), `algorithm` (the `algorithm` section), `trainer` (the `trainer` section), `placement` (the GPUs
of the trainer and a launched SGLang), `sections` (the other sections and `RunConfig`), `load` (YAML and
overrides into a `RunConfig`).

Where a choice brings its own options, the section is keyed by `type` (`engine`,
`algorithm.off_policy_correction`, `trainer.backend`, `placement`): each kind has only its own fields, an option of
another kind is an error naming the kind, and a bare kind (`trainer.backend=ray`) takes its defaults.

`RunConfig` has the sections model, lora, algorithm, rollout, engine, store,
trainer, data, reward and run. Every field has a default, so YAML files stay
sparse. Unknown keys and bad values fail before any work starts, with the
dotted field path and the reason (`ConfigError`).

Overrides use dotted paths (`lora.rank=32`, `rollout.temperature=0.7`); the
value is parsed as YAML, so `lora.target_modules=[q_proj,v_proj]` gives a list.
"""

from lora_rl_core.config.algorithm import (
    AlgorithmConfig,
    AutoCorrection,
    GeometricMaskCorrection,
    M2POCorrection,
    MaskCorrection,
    NoCorrection,
    OffPolicyCorrectionConfig,
    ResolvedCorrection,
    TruncateCorrection,
)
from lora_rl_core.config.base import (
    EVICTION_POLICIES,
    IPC_LAYOUTS,
    REMOTE_ENGINE_KINDS,
    SET_IN_CONFIG,
    SGLANG_DEFAULT_PORT,
    SGLANG_RETIRE_POLICIES,
    TENSOR_DTYPES,
    TENSOR_TRANSPORTS,
    EngineKind,
    EvictionPolicy,
    IpcLayout,
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
    SGLANG_DEFAULTS,
    EmbeddedEngineConfig,
    EngineConfig,
    EngineLimits,
    RayReplicas,
    RemoteEngine,
    ServerEngineConfig,
    SGLangEngineConfig,
    SGLangLaunchConfig,
    ray_replicas,
    sglang_section,
)
from lora_rl_core.config.load import (
    apply_override,
    config_from_dict,
    load_config,
)
from lora_rl_core.config.placement import (
    AutoPlacement,
    ColocatedPlacement,
    ManualPlacement,
    PlacedGPUs,
    PlacementConfig,
    SplitPlacement,
)
from lora_rl_core.config.sections import (
    CRITIC_LR_FACTOR,
    CriticConfig,
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
)
from lora_rl_core.config.trainer import (
    InProcessBackend,
    LocalBackend,
    RankedBackend,
    RayBackend,
    TrainerBackendConfig,
    TrainerConfig,
)

__all__ = [
    "AlgorithmConfig",
    "AutoPlacement",
    "ColocatedPlacement",
    "ManualPlacement",
    "PlacedGPUs",
    "PlacementConfig",
    "SplitPlacement",
    "AutoCorrection",
    "CRITIC_LR_FACTOR",
    "CriticConfig",
    "EmbeddedEngineConfig",
    "EngineLimits",
    "GeometricMaskCorrection",
    "M2POCorrection",
    "InProcessBackend",
    "LocalBackend",
    "MaskCorrection",
    "NoCorrection",
    "OffPolicyCorrectionConfig",
    "RankedBackend",
    "RayBackend",
    "RayReplicas",
    "RemoteEngine",
    "ResolvedCorrection",
    "SGLANG_DEFAULTS",
    "SGLangEngineConfig",
    "ServerEngineConfig",
    "TrainerBackendConfig",
    "TruncateCorrection",
    "ray_replicas",
    "sglang_section",
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
    "REMOTE_ENGINE_KINDS",
    "RemoteEngineKind",
    "RewardConfig",
    "RewardFunctionConfig",
    "RolloutConfig",
    "RolloutMode",
    "RunConfig",
    "RunSection",
    "SET_IN_CONFIG",
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
