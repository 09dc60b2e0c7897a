"""The engine kinds: `engine.type` -> how to build that engine; the one place an engine is made from settings.

`build_engine(inputs)` gives a `BuiltEngine`: the engine and what was started for it (an SGLang server,
Ray actors), stopped when it closes. The training run (`lora_rl_core.run.components.build_run`),
`lora-rl eval`, the subscriber (`lora_rl_core.subscriber.open_subscriber`) and Ray replicas (each actor builds
its engine with the kind's builder) all build through here, so an engine setting means the same everywhere.

Adding an engine kind (e.g. vLLM) is a value of `EngineConfig.type`, its module (a builder
`EngineInputs -> BuiltEngine`) and one entry in `ENGINE_KINDS`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

from lora_rl_core.config import EngineConfig, ray_replicas
from lora_rl_core.engines.embedded.build import embedded_engine
from lora_rl_core.engines.launch.ray_replicas import start_ray_replicas
from lora_rl_core.engines.launch.sglang import sglang_engine, sglang_replicas
from lora_rl_core.engines.records import BuiltEngine, EngineInputs
from lora_rl_core.engines.remote.connect import connect
from lora_rl_core.engines.remote.dialect import SERVER
from lora_rl_core.engines.remote.transport import sglang_tensor_load_reads_folder
from lora_rl_core.errors import ConfigError

Builder = Callable[[EngineInputs], BuiltEngine]


@dataclass(frozen=True)
class EngineKind:
    """How one value of `engine.type` is built.

    Attributes:
        build: the engine in this process (or the clients of remote ones).
        replicate: `engine.ray_replicas` replicas as Ray actors; None = the kind has no replicas
            (`EngineConfig` refuses `ray_replicas` for it).
        tensor_load_reads_folder: whether loading a version given as tensors, with the plan's resolved
            `engine.tensor_transport`, makes the engine read the version's published folder (then a sync
            waits for the version's write to the store); default never.
    """

    build: Builder
    replicate: Builder | None = None
    tensor_load_reads_folder: Callable[[EngineConfig, str], bool] = lambda cfg, transport: False


ENGINE_KINDS: dict[str, EngineKind] = {
    "embedded": EngineKind(build=embedded_engine, replicate=functools.partial(start_ray_replicas, embedded_engine)),
    "server": EngineKind(build=functools.partial(connect, SERVER)),
    "sglang": EngineKind(
        build=sglang_engine, replicate=sglang_replicas, tensor_load_reads_folder=sglang_tensor_load_reads_folder
    ),
}
"""Every engine kind, by `EngineConfig.type`."""


def sync_reads_folder(cfg: EngineConfig, transport: str) -> bool:
    """Whether syncing a version to `cfg`'s engines reads its published folder from the store (`sync: store`,
    or a tensor load the kind routes through the folder with the run's resolved `transport`), so the sync
    must wait for the version's write. Decided once, by the run's plan (`lora_rl_core.plan`)."""
    return cfg.sync == "store" or ENGINE_KINDS[cfg.type].tensor_load_reads_folder(cfg, transport)


def build_engine(inputs: EngineInputs) -> BuiltEngine:
    """The engine `inputs.engine` describes, with what it owns.

    Raises:
        ConfigError: a kind without replicas asked for `engine.ray_replicas`, or a missing section.
        ModelError: the embedded engine's model cannot be loaded.
        EngineError: a malformed engine URL, or a launched server that did not start.
    """
    kind = ENGINE_KINDS[inputs.engine.type]
    if not ray_replicas(inputs.engine):
        return kind.build(inputs)
    if kind.replicate is None:
        raise ConfigError(f"engine.ray_replicas: engine.type {inputs.engine.type} has no Ray replicas")
    return kind.replicate(inputs)


def build_serving_engine(inputs: EngineInputs) -> BuiltEngine:
    """The engine `lora-rl serve` serves: with `engine.type: sglang`, our SGLang client of the server at
    `engine.urls` (or of one launched here), so that `lora-rl serve` is SGLang's front door; otherwise the
    embedded engine with every limit of the `engine` section, whatever `engine.type` says (`server`: a
    training config pointing its rollouts at `engine.urls` serves that engine with the same limits).

    Raises:
        ConfigError: `engine.ray_replicas` with SGLang (the front door serves one server).
        ModelError / EngineError: as `build_engine`.
    """
    if inputs.engine.type == "sglang":
        if inputs.engine.ray_replicas:
            raise ConfigError("lora-rl serve in front of SGLang serves one server: set engine.ray_replicas: 0")
        return build_engine(inputs)
    return ENGINE_KINDS["embedded"].build(inputs)
