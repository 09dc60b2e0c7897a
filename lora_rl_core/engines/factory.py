"""Build the inference engine a config describes: the one place an engine is made from settings.

`build_engine` gives the embedded engine (its own copy of the base model, every limit of
`EngineConfig` applied) for `engine.type: embedded`, else the HTTP client(s) of the engines at
`engine.urls` (`server`: our `lora-rl serve`; `sglang`: a real SGLang server; several URLs: a
`MultiEngine`). The training run, `lora-rl eval` and `lora-rl serve` all build through here, so an
engine setting in the config means the same everywhere.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from lora_rl_core.engines.base import InferenceEngine

if TYPE_CHECKING:
    from lora_rl_core.config import EngineConfig, ModelConfig
    from lora_rl_core.engines.embedded import EmbeddedEngine
    from lora_rl_core.store import AdapterStore


def build_engine(
    engine_cfg: EngineConfig, model_cfg: ModelConfig, store: AdapterStore | None, *, tokenizer: Any = None
) -> InferenceEngine:
    """The engine of `engine_cfg`: embedded (`build_embedded_engine`), embedded replicas as Ray actors
    (`engine.ray_replicas`, `ray_replicas.start_ray_replicas`), or remote (`build_remote_engine`).

    Args:
        engine_cfg: the `engine` section.
        model_cfg: the `model` section (read only for the embedded engine).
        store: the adapter store, for `store://` adapter names and paths (embedded engine only).
        tokenizer: the model's tokenizer if the caller has it already (embedded engine only).

    Raises:
        ModelError: the embedded engine's model cannot be loaded.
        EngineError: a malformed engine URL.
    """
    if engine_cfg.type == "embedded" and engine_cfg.ray_replicas:
        from lora_rl_core.engines.ray_replicas import start_ray_replicas

        on_gpu = model_cfg.device.startswith("cuda")
        return start_ray_replicas(
            engine_cfg,
            model_cfg,
            replicas=engine_cfg.ray_replicas,
            store_uri=store.uri if store else None,
            num_gpus=engine_cfg.ray_gpus_per_replica if on_gpu else 0.0,
        )
    if engine_cfg.type == "embedded":
        return build_embedded_engine(engine_cfg, model_cfg, store, tokenizer=tokenizer)
    return build_remote_engine(engine_cfg)


def build_embedded_engine(
    engine_cfg: EngineConfig, model_cfg: ModelConfig, store: AdapterStore | None, *, tokenizer: Any = None
) -> EmbeddedEngine:
    """An `EmbeddedEngine` on a fresh copy of `model_cfg`'s model with every limit of `engine_cfg`
    (`max_batch_size`, `max_loras_per_batch`, `max_loaded_loras`, `eviction_policy`, `max_lora_rank`,
    `timeout_s`), whatever `engine_cfg.type` says (`lora-rl serve` serves a remote engine's settings).

    Raises:
        ModelError: the model cannot be loaded.
    """
    from lora_rl_core.engines.embedded import EmbeddedEngine
    from lora_rl_core.models import load_model

    model, loaded_tokenizer = load_model(model_cfg)
    return EmbeddedEngine(
        model,
        tokenizer if tokenizer is not None else loaded_tokenizer,
        max_batch_size=engine_cfg.max_batch_size,
        max_loras_per_batch=engine_cfg.max_loras_per_batch,
        max_loaded_loras=engine_cfg.max_loaded_loras,
        eviction_policy=engine_cfg.eviction_policy,
        max_lora_rank=engine_cfg.max_lora_rank,
        store=store,
        default_timeout_s=engine_cfg.timeout_s,
    )


def build_remote_engine(engine_cfg: EngineConfig) -> InferenceEngine:
    """The HTTP client(s) for `engine_cfg.urls` (`server` or `sglang`; a `MultiEngine` for several URLs),
    with the Bearer key read from the environment variable `engine_cfg.api_key_env`, the generation
    deadline `engine_cfg.timeout_s` and `engine_cfg.tensor_transport`; for SGLang also `sglang_retire`,
    `tensor_layout` and `tensor_dtype`.

    Raises:
        EngineError: `engine.type` is `embedded`, no URLs, or a malformed URL.
    """
    from lora_rl_core.engines.multi import connect_engines

    sglang_only = (
        {
            "retire": engine_cfg.sglang_retire,
            "tensor_layout": engine_cfg.tensor_layout,
            "tensor_dtype": engine_cfg.tensor_dtype,
        }
        if engine_cfg.type == "sglang"
        else {}
    )
    return connect_engines(
        engine_cfg.type,
        engine_cfg.urls,
        api_key=os.environ.get(engine_cfg.api_key_env),
        timeout_s=engine_cfg.timeout_s,
        tensor_transport=engine_cfg.tensor_transport,
        **sglang_only,
    )
