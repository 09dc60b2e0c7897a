"""What an engine builder reads (`EngineInputs`) and what it returns (`BuiltEngine`: the engine and what it owns).

Every engine kind of `engine.type` is one `EngineKind` in the registry (`lora_rl_core.engines.registry`); its
builders take `EngineInputs` and return a `BuiltEngine`. The inputs are configs and plain values only, so
they also travel to Ray actors that build an engine there (`lora_rl_core.engines.launch.ray_replicas`).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lora_rl_core.config import EngineConfig, LoRAConfig, ModelConfig, StoreConfig
    from lora_rl_core.engines.base import InferenceEngine


@dataclass(frozen=True)
class EngineInputs:
    """What an engine builder may read.

    Attributes:
        engine: the `engine` section (kind, URLs, limits, launch, Ray replicas).
        model: the `model` section; read by the engines that load the model (embedded) or launch a server.
        lora: the `lora` section; read by a launched SGLang (`--max-lora-rank`, `--lora-target-modules`).
        store: the `store` section, for `store://` adapter names and paths of an embedded engine.
        tokenizer: the model's tokenizer if the caller has it already (embedded engine only; not sent to
            Ray actors).
        log_dir: where launched servers write their logs (`sglang.log`, `sglang-<i>.log`).
        api_key: the engines' Bearer key; None = the environment variable `engine.api_key_env`.
        launch_plan: what a launched SGLang resolves its `auto` settings with (`launch.process.LaunchPlan`:
            rollout batch, the memory plan's fraction and saver); None = SGLang's own defaults.
    """

    engine: EngineConfig
    model: ModelConfig | None = None
    lora: LoRAConfig | None = None
    store: StoreConfig | None = None
    tokenizer: Any = None
    log_dir: Path | None = None
    api_key: str | None = None
    launch_plan: Any = None


@dataclass
class BuiltEngine:
    """An engine and what was started for it (servers, Ray actors), stopped after the engine closes.

    Attributes:
        engine: the `InferenceEngine` callers use.
        owned: stop callbacks of what the builder started, run in reverse order after `engine.close()`,
            each even if an earlier one raised.
        servers: the SGLang servers launched here for it (their URLs, pids and logs).
        actors: the Ray actor handles started for it, in replica order.
    """

    engine: InferenceEngine
    owned: list[Callable[[], None]] = field(default_factory=list)
    servers: list[Any] = field(default_factory=list)
    actors: list[Any] = field(default_factory=list)
    _closed: bool = field(default=False, repr=False)

    def close(self) -> None:
        """Close the engine, then stop what it owns; idempotent (what it owns is stopped once)."""
        if self._closed:
            return
        self._closed = True
        with ExitStack() as stack:  # callbacks run last-in first-out: the engine closes first
            for stop in self.owned:
                stack.callback(stop)
            stack.callback(self.engine.close)

    def __enter__(self) -> BuiltEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
