"""The inference-engine protocol and the request/completion records it speaks.

Every request names its adapter explicitly (`adapter=None` means the base
model, on purpose): a request that forgets its adapter silently samples from
the base model, a known failure in peers. Every completion records the
adapter name and version that produced it.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

PAUSE_MODES = ("abort", "retract", "in_place")
"""SGLang's `/pause_generation` modes (`sglang/srt/managers/io_struct.py`, `PauseGenerationReqInput`)."""

ABORT_REASONS = ("aborted", "paused", "timeout", "adapter_unloaded", "engine_closed")
"""Why a request ended with `finish_reason="abort"`: `abort()` was called; `pause(mode="abort")`;
its deadline passed; its adapter was unloaded before the request was admitted; the engine closed."""

def unknown_adapter_message(name: str, loaded: list[str]) -> str:
    """The error for a request naming an adapter that is not registered: SGLang's wording
    (`sglang/srt/lora/lora_registry.py`, `LoRARegistry.acquire`; HTTP 400 on `/generate`)."""
    return (
        f"LoRA adapter {name!r} has never been loaded or was unloaded. "
        f"The following requested LoRA adapters are not loaded: {name}. Loaded adapters: {sorted(loaded)}."
    )


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one completion.

    `temperature=0` is greedy decoding; `top_k=0` and `top_p=1` disable those filters.
    `seed` makes a batch's sampling reproducible.
    """

    max_new_tokens: int = 48
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None


@dataclass
class GenerationRequest:
    """One prompt to complete, with the adapter that must serve it (None = base model)."""

    prompt_ids: list[int]
    adapter: str | None
    sampling: SamplingParams = SamplingParams()
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)


@dataclass
class Completion:
    """One finished completion.

    Attributes:
        completion_ids: sampled token ids, EOS included when the model stopped.
        logprobs: log-probability (nats) of each sampled token under the sampling
            temperature, one per completion token (`inference_logprobs`).
        finish_reason: `stop` (EOS), `length` (hit max_new_tokens) or `abort` (no tokens kept;
            see `abort_reason`), as SGLang's `meta_info.finish_reason.type`.
        adapter / adapter_version: what produced it (None = base model): the name and version
            the engine admitted the request with.
        abort_reason: why an aborted request ended (one of `ABORT_REASONS`); None otherwise.
    """

    request_id: str
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    finish_reason: Literal["stop", "length", "abort"]
    adapter: str | None
    adapter_version: int | None
    abort_reason: str | None = None


class InferenceEngine(Protocol):
    """What the flow needs from an inference engine (embedded, server or SGLang).

    Semantics follow SGLang's LoRA API (`sglang/srt/entrypoints/http_server.py`, `lora/lora_registry.py`);
    see `EmbeddedEngine` for the reference implementation and docs/SGLANG.md for the wire format.
    """

    def generate(
        self, requests: list[GenerationRequest], *, timeout_s: float | None = None, inline: bool = False
    ) -> list[Completion]:
        """Complete every request with its named adapter; order is preserved. Requests still unfinished
        at the deadline come back with `finish_reason="abort"`, `abort_reason="timeout"`. `inline` asks an
        in-process engine to compute on the calling thread; remote engines ignore it."""

    def abort(self, request_id: str | None = None) -> int:
        """Abort one request (or all when None); returns how many were aborted."""

    def load_adapter(
        self,
        name: str,
        *,
        path: str | None = None,
        tensors: dict | None = None,
        config: dict | None = None,
        pinned: bool = False,
    ) -> None:
        """Load an adapter under `name` from a folder/URI, or from tensors plus PEFT config."""

    def unload_adapter(self, name: str) -> None:
        """Unregister `name`, wait (bounded) for its in-flight requests, then free it."""

    def list_adapters(self) -> dict[str, dict[str, Any]]:
        """Loaded adapters: name -> info (version, source, in-flight requests)."""

    def pause(self, mode: str = "in_place") -> None:
        """Stop admitting new generation work; `mode` is one of `PAUSE_MODES`."""

    def resume(self) -> None:
        """Admit generation work again."""

    def flush_cache(self) -> bool:
        """Drop cached prefixes/KV (no-op where there is none); True when flushed."""

    def health(self) -> dict[str, Any]:
        """Liveness and readiness facts."""

    def metrics(self) -> dict[str, Any]:
        """Counters: requests, tokens, loads, per adapter."""
