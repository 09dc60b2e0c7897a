"""Build the embedded engine from settings: `build_embedded_engine` (configs and a store object, for
`lora-rl serve` and the harness) and `embedded_engine` (the `embedded` kind's builder in the registry)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lora_rl_core.engines.records import BuiltEngine, EngineInputs
from lora_rl_core.errors import ConfigError

if TYPE_CHECKING:
    from lora_rl_core.config import EngineConfig, ModelConfig
    from lora_rl_core.engines.embedded.engine import EmbeddedEngine
    from lora_rl_core.store import AdapterStore


def build_embedded_engine(
    engine_cfg: EngineConfig,
    model_cfg: ModelConfig,
    store: AdapterStore | None,
    *,
    tokenizer: Any = None,
) -> EmbeddedEngine:
    """An `EmbeddedEngine` on a fresh copy of `model_cfg`'s model with every limit of `engine_cfg`
    (`max_batch_size`, `max_loras_per_batch`, `max_loaded_loras`, `eviction_policy`, `max_lora_rank`,
    `timeout_s`), whatever `engine_cfg.type` says (`lora-rl serve` serves a remote engine's settings). On a CPU
    its decode steps' attention is `attention.decode_attention`.

    Args:
        store: the adapter store, for `store://` adapter names and paths.
        tokenizer: the model's tokenizer if the caller has it already.

    Raises:
        ModelError: the model cannot be loaded.
    """
    from lora_rl_core.config import ENGINE_DEFAULTS, EmbeddedEngineConfig
    from lora_rl_core.engines.embedded.attention import use_decode_attention
    from lora_rl_core.engines.embedded.engine import EmbeddedEngine
    from lora_rl_core.models import load_model

    # its device and dtype as the section says (the plan's); the run's tokenizer where it has one
    model, tokenizer = load_model(model_cfg, tokenizer=tokenizer)
    if model.device.type == "cpu":  # SDPA's CPU kernel is slow for one query position (attention.py)
        use_decode_attention(model)
    return EmbeddedEngine(
        model,
        tokenizer,
        max_batch_size=engine_cfg.max_batch_size
        if isinstance(engine_cfg, EmbeddedEngineConfig)
        else ENGINE_DEFAULTS.max_batch_size,
        max_loras_per_batch=engine_cfg.max_loras_per_batch,
        max_loaded_loras=engine_cfg.max_loaded_loras,
        eviction_policy=engine_cfg.eviction_policy,
        max_lora_rank=engine_cfg.max_lora_rank,
        store=store,
        default_timeout_s=engine_cfg.timeout_s,
    )


def embedded_engine(inputs: EngineInputs) -> BuiltEngine:
    """The `embedded` kind: one `EmbeddedEngine` in this process (`build_embedded_engine`).

    Raises:
        ConfigError: no `model` section was given; ModelError: the model cannot be loaded.
    """
    if inputs.model is None:
        raise ConfigError("engine.type embedded needs the model section (EngineInputs.model)")
    return BuiltEngine(
        build_embedded_engine(
            inputs.engine,
            inputs.model,
            inputs.store,
            tokenizer=inputs.tokenizer,
        )
    )
