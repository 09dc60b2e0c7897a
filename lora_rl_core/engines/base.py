"""The inference-engine protocol and the request/completion records it speaks.

Every request names its adapter explicitly (`adapter=None` means the base
model, on purpose): a request that forgets its adapter silently samples from
the base model, a known failure in peers. Every completion records the
adapter name and version that produced it.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from lora_rl_core.records import FinishReason

PAUSE_MODES = ("abort", "retract", "in_place")
"""SGLang's `/pause_generation` modes (`sglang/srt/managers/io_struct.py`, `PauseGenerationReqInput`)."""

ABORT_REASONS = ("aborted", "paused", "timeout", "adapter_unloaded", "engine_closed")
"""Why a request ended with `finish_reason="abort"`: `abort()` was called; `pause(mode="abort")`;
its deadline passed; its adapter was unloaded before the request was admitted; the engine closed."""


def unknown_adapter_message(name: str, loaded: list[str]) -> str:
    """The error for a request naming an adapter that is not registered, worded as SGLang 0.5.17 answered
    `/generate` (HTTP 400) on the GPU host: `Got LoRA adapter that has never been loaded: NAME` and the
    loaded names (benchmarks/results/sglang-real/contract_h100.json)."""
    return f"Got LoRA adapter that has never been loaded: {name}\nAll loaded adapters: {sorted(loaded)}"


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one completion.

    `temperature=0` is greedy decoding; `top_k=0` and `top_p=1` disable those filters.
    `seed` makes a batch's sampling reproducible. `stop` strings and `stop_token_ids` end a completion as EOS
    does (SGLang's `sampling_params.stop` / `stop_token_ids`): generation halts at the token that completes the
    first one, which is kept (with its logprob) and the completion's `finish_reason` is `stop`. Tuples, so the
    params stay hashable (engines batch requests with equal params).
    """

    max_new_tokens: int = 48
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()


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
        completion_ids: sampled token ids, the EOS token or the stop sequence's tokens included when one
            ended it.
        logprobs: log-probability (nats) of each sampled token under the sampling
            temperature, one per completion token (`inference_logprobs`).
        finish_reason: `eos` (the end-of-sequence token), `stop` (a stop string or stop token id of
            `SamplingParams`), `length` (hit max_new_tokens) or `abort` (no tokens kept; see `abort_reason`):
            `FinishReason`.
        adapter / adapter_version: what produced it (None = base model): the name and version
            the engine admitted the request with.
        abort_reason: why an aborted request ended (one of `ABORT_REASONS`); None otherwise.
    """

    request_id: str
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    adapter: str | None
    adapter_version: int | None
    abort_reason: str | None = None


@runtime_checkable
class RolloutEngine(Protocol):
    """What a training step needs from an inference engine: generate completions with named adapters, and load,
    unload and list adapter versions (the hot-swap protocol, `lora_rl_core.subscriber`, also asks `is_paused`
    before an unload and iterates `members`). The run's phases, its syncs, evaluation and the subscriber use
    only these members.

    Semantics follow SGLang's LoRA API (`sglang/srt/entrypoints/http_server.py`, `lora/lora_registry.py`);
    see `EmbeddedEngine` for the reference implementation and docs/SGLANG.md for the wire format.
    Implementations: `EmbeddedEngine` (in process), `HTTPEngine` (our `lora-rl serve` or a real SGLang server,
    by its dialect), `RayEngine` (an engine in a Ray actor) and `MultiEngine` (several of these); the engine
    registry (`lora_rl_core.engines.registry`) builds them. Errors are `EngineError`; an engine that
    cannot be reached or did not answer in time raises its subclass `EngineUnavailable` (HTTP engines).
    Callers use only these members: no engine is probed for optional ones.
    """

    def generate(
        self, requests: list[GenerationRequest], *, timeout_s: float | None = None, inline: bool = False
    ) -> list[Completion]:
        """Complete every request with its named adapter (SGLang `/generate` with `lora_path`).

        Args:
            requests: each names its adapter (`None` = the base model); all are checked before any runs.
            timeout_s: deadline of the call in seconds (default: the engine's own). Requests still
                unfinished then come back with `finish_reason="abort"`, `abort_reason="timeout"` (an HTTP
                engine that gets no answer in time raises `EngineUnavailable` instead).
            inline: ask an in-process engine to compute on the calling thread; remote engines ignore it.

        Returns:
            One `Completion` per request, in request order, each naming the adapter and version that
            produced it.

        Raises:
            EngineError: an adapter that is not loaded (SGLang's "has never been loaded" message; never a
                silent base-model completion), an empty prompt, a duplicate request id, a closed engine.
        """
        ...

    def load_adapter(
        self,
        name: str,
        *,
        path: str | None = None,
        tensors: dict | None = None,
        config: dict | None = None,
        pinned: bool = False,
    ) -> None:
        """Load a PEFT adapter under a new `name` (SGLang `/load_lora_adapter`, or `..._from_tensors`).

        Args:
            name: usually `<run>-v<NNNNNN>`; must not be loaded already (SGLang has no upsert).
            path: a PEFT folder (local path or fsspec URI) or a store version folder.
            tensors, config: a PEFT state dict and its config dict; preferred when given, with `path` (the
                same version published) as the fallback of an engine that cannot take them (SGLang on
                another host with `tensor_transport` auto or disk).
            pinned: never evict it.

        Raises:
            EngineError: bad or duplicate name, unreadable files, rank or target modules outside the pool,
                or neither a path nor tensors with config.
        """
        ...

    def unload_adapter(self, name: str) -> None:
        """Unregister `name` (new requests naming it fail), wait (bounded) for its in-flight requests,
        then free it (SGLang `/unload_lora_adapter`). Never call it while generation is paused.

        Raises:
            EngineError: `name` is not loaded, or its requests did not end in time.
        """
        ...

    def list_adapters(self) -> dict[str, dict[str, Any]]:
        """Loaded adapters (SGLang `/v1/models` cards with a parent): name -> info. `version` is always
        there; `in_flight`, `pinned`, `resident`, `sha256`, `path`/`source` where the engine reports them."""
        ...

    def is_paused(self) -> bool:
        """Whether generation is paused now (`pause` called, `resume` not yet), asked before unloading (never
        unload while paused: `subscriber.retire_stale`). Cheap: it runs nothing on the engine (`health()` on
        SGLang runs a generation); an SGLang client answers from its own `pause`/`resume` calls, our server's
        client asks the server, a `MultiEngine` is paused when any member is.

        Raises:
            EngineError: the engine cannot say (unreachable, no answer in time, closed client); callers
                then treat it as paused.
        """
        ...

    def members(self) -> Sequence[RolloutEngine]:
        """The single engines behind this one: `[self]` for a single engine, every member's members for a
        `MultiEngine`. Per-engine work (verifying a load, retiring versions) iterates these."""
        ...

    def close(self) -> None:
        """Release what the engine holds (worker thread, HTTP connections); queued requests of an in-process
        engine end aborted (`engine_closed`). Idempotent; later calls raise EngineError."""
        ...


@runtime_checkable
class ServingEngine(RolloutEngine, Protocol):
    """What serving needs besides the step's members (`lora-rl serve`, `MultiEngine`, clients' traffic):
    one request at a time (`submit`), abort with a reason, pause and resume (SGLang's `/pause_generation`),
    flush the cache, health and metrics. Every engine kind implements it (`tests/integration/
    test_engine_conformance.py` runs both protocols' suites on each)."""

    def submit(self, request: GenerationRequest) -> Future[Completion]:
        """Start one request in the background (one prompt of `/generate`).

        Returns:
            A future of its `Completion`; it raises as `generate` does. `abort(request.request_id)` ends it
            early with `finish_reason="abort"`.

        Raises:
            EngineError: an engine that checks at once (the embedded one) refuses an unknown adapter, an
                empty prompt, a duplicate id or a closed engine here; HTTP engines raise from the future.
        """
        ...

    def abort(self, request_id: str | None = None, *, reason: str = "aborted") -> int:
        """Abort one request by id, or every queued and running request when None (SGLang `/abort_request`).

        The request's completion comes back with `finish_reason="abort"` and `abort_reason=reason`, and no
        tokens. SGLang's `/abort_request` carries no reason: an HTTP client keeps `reason` itself for the
        requests it sent (and our server also takes it in the body).

        Args:
            request_id: the request to abort; None = all.
            reason: one of `ABORT_REASONS`.

        Returns:
            How many requests were aborted (0 for an unknown or finished id).

        Raises:
            EngineError: `reason` is not one of `ABORT_REASONS`.
        """
        ...

    def pause(self, mode: str = "in_place") -> None:
        """Stop admitting generation work (SGLang `/pause_generation`); returns at once.

        `mode`: `in_place` (queued requests wait), `retract` (running requests go back to the queue) or
        `abort` (queued and running requests end with `abort_reason="paused"`); see `PAUSE_MODES`.

        Raises:
            EngineError: unknown mode.
        """
        ...

    def resume(self) -> None:
        """Admit generation work again (SGLang `/continue_generation`); waiting requests run in order."""
        ...

    def flush_cache(self) -> bool:
        """Drop cached prefixes/KV (SGLang `/flush_cache`); True when flushed, False when the engine refused
        because requests are running. An engine without a cache returns True."""
        ...

    def health(self) -> dict[str, Any]:
        """Liveness facts; always `ok` (bool: serving) and `paused` (bool: generation paused). Never raises
        for an unreachable engine: it is reported not ok."""
        ...

    def metrics(self) -> dict[str, Any]:
        """Counters and gauges; `adapters`: name -> {requests, tokens, ...} where the engine counts them."""
        ...


def spread_groups(requests: Sequence[GenerationRequest], n: int, start: int = 0) -> list[list[int]]:
    """Indices of `requests` for each of `n` engines (replicas, or an SGLang server's data-parallel workers):
    the requests of one prompt (equal `prompt_ids`: a GRPO group) stay together, prompts are dealt
    round-robin from engine `start % n`, so groups are balanced and share their prefix cache."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, r in enumerate(requests):
        groups.setdefault(tuple(r.prompt_ids), []).append(i)
    shares: list[list[int]] = [[] for _ in range(n)]
    for k, indices in enumerate(groups.values()):
        shares[(start + k) % n].extend(indices)
    return shares


def aborted_completion(request: GenerationRequest, version: int | None, reason: str) -> Completion:
    """The Completion of an aborted request: no tokens, `finish_reason="abort"`, `abort_reason=reason`."""
    return Completion(
        request_id=request.request_id,
        prompt_ids=list(request.prompt_ids),
        completion_ids=[],
        logprobs=[],
        finish_reason="abort",
        adapter=request.adapter,
        adapter_version=version,
        abort_reason=reason,
    )
