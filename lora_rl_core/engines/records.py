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
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from lora_rl_core.config import EngineConfig, LoRAConfig, ModelConfig, TensorTransport
    from lora_rl_core.engines.base import ServingEngine
    from lora_rl_core.store import AdapterStore


@dataclass(frozen=True)
class LaunchBudget:
    """What the run knows that the launcher resolves `auto` settings with.

    Attributes:
        rollout_batch: sequences decoded at once (prompts x group size x rollouts in flight); None = unknown.
        mem_fraction: `--mem-fraction-static` from the run's memory plan; None = SGLang's own.
        memory_saver: free the KV cache during training (`--enable-memory-saver`).
    """

    rollout_batch: int | None = None
    mem_fraction: float | None = None
    memory_saver: bool = False


@dataclass(frozen=True)
class ResolvedLaunch:
    """`engine.launch` with no `auto` left. A backend of None means SGLang's own choice (the flag is omitted).

    Attributes:
        cuda_graph_max_bs: largest decode batch captured as a CUDA graph; None = CUDA graphs off.
        mem_fraction_static: `--mem-fraction-static`; None = SGLang's own.
        memory_saver: `--enable-memory-saver`.
        gpus: one server per entry, its `CUDA_VISIBLE_DEVICES` (physical ids, `tp_size` of them, e.g. `2,3`;
            over `engine.launch.env`'s), on ports `engine.launch.port + i` (the run's `placement`; SGLang 0.5.17
            refuses dynamic LoRA loads with `--dp-size` > 1, so data parallelism is one server per GPU group);
            () = one server, on the GPU `engine.launch.env` (or this process) gives it.
        tp_size: `--tp-size`: GPUs per server (tensor parallel).
        reasons: for each resolved `auto`, why it became its value.
    """

    attention_backend: str | None
    sampling_backend: str | None
    lora_backend: str | None
    grammar_backend: str
    cuda_graph_max_bs: int | None
    mem_fraction_static: float | None
    memory_saver: bool
    extra_args: tuple[str, ...] = ()
    gpus: tuple[str, ...] = ()
    tp_size: int = 1
    reasons: dict[str, str] = field(default_factory=dict)

    @property
    def servers(self) -> int:
        """SGLang servers launched: one per GPU of `gpus`, else one."""
        return max(1, len(self.gpus))


@dataclass(frozen=True)
class EngineInputs:
    """What an engine builder may read.

    Attributes:
        engine: the `engine` section (kind, URLs, limits, launch, Ray replicas).
        model: the `model` section, with `device` and `dtype` as the run's plan resolved them; read by the engines
            that load the model (embedded) or launch a server. `auto` is left only where another host decides
            (Ray replicas: each resolves it on its host before step 1 and reports the answer).
        lora: the `lora` section; read by a launched SGLang (`--max-lora-rank`, `--lora-target-modules`).
        store: the adapter store (built once by the run's inputs), for `store://` adapter names and paths of an
            embedded engine.
        tokenizer: the model's tokenizer if the caller has it already (embedded engine only; not sent to
            Ray actors).
        log_dir: where launched servers write their logs (`sglang.log`, `sglang-<i>.log`).
        api_key: the engines' Bearer key; None = the environment variable `engine.api_key_env`.
        launch: the SGLang server to launch here, its `auto` flags resolved by the run's plan; None = resolved
            by the launcher against SGLang's defaults (a server without a plan: a Ray replica's).
        launch_budget: what a Ray replica's launcher resolves its `auto` settings with on its host (rollout
            batch, the memory plan's fraction and saver); None = SGLang's own defaults.
        tensor_transport: `engine.tensor_transport` as the run's plan resolved it; None = the section's.
    """

    engine: EngineConfig
    model: ModelConfig | None = None
    lora: LoRAConfig | None = None
    store: AdapterStore | None = None
    tokenizer: PreTrainedTokenizerBase | None = None
    log_dir: Path | None = None
    api_key: str | None = None
    launch: ResolvedLaunch | None = None
    launch_budget: LaunchBudget | None = None
    tensor_transport: TensorTransport | None = None


class LaunchedServer(Protocol):
    """A server launched for an engine (`engines.launch.process.SGLangServer`), as its owner sees it."""

    url: str
    memory_saver: bool
    """Started with SGLang's memory saver: its KV cache can be released and taken back."""

    def release_memory(self) -> float:
        """Free the KV cache (memory saver); returns the seconds it took. Raises `EngineError` if refused."""
        ...

    def resume_memory(self) -> float:
        """Take the KV cache back; returns the seconds it took. Raises `EngineError` if refused."""
        ...

    def stop(self) -> None:
        """Stop the server and its process group."""
        ...


@dataclass
class BuiltEngine:
    """An engine and what was started for it (servers, Ray actors), stopped after the engine closes.

    Attributes:
        engine: the `ServingEngine` callers use.
        owned: stop callbacks of what the builder started, run in reverse order after `engine.close()`,
            each even if an earlier one raised.
        servers: the SGLang servers launched here for it (their URLs, pids and logs).
        actors: the Ray actor handles started for it, in replica order.
        resolved: what each Ray replica resolved on its own host when it started, before step 1, in replica
            order: its node, and the model's device and dtype (embedded replicas) or its SGLang server's flags
            with their reasons (SGLang replicas); what the run's plan cannot know on this host.
    """

    engine: ServingEngine
    owned: list[Callable[[], None]] = field(default_factory=list)
    servers: list[LaunchedServer] = field(default_factory=list)
    actors: list[Any] = field(default_factory=list)
    resolved: list[dict[str, Any]] = field(default_factory=list)
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
