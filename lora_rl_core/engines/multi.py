"""Several engines behind one `ServingEngine` (`MultiEngine`): HTTP clients of several URLs
(`remote.connect`), Ray replicas (`launch.ray_replicas`, `launch.ray_sglang`), or any mix.

Choices made here:

* Generation is spread: every sample of one prompt goes to one engine (its prefix cache), prompts are
  dealt round-robin from a rotating start. A failing engine fails the call, naming the engine; nothing is
  retried on another engine.
* Adapter loads and unloads are broadcast to every engine concurrently; a failure lists the engines that
  failed (`EngineUnavailable` only when every failure was one), the others keep the change.
* Per-engine work (`sync_version` verifying a load, `retire_stale`) iterates `members()`.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from lora_rl_core.engines.base import Completion, GenerationRequest, RolloutEngine, ServingEngine, spread_groups
from lora_rl_core.errors import EngineError, EngineUnavailable


class MultiEngine:
    """Several engines behind one `ServingEngine`: generation is spread, adapter changes broadcast.

    Args:
        engines: any engines of the protocol (HTTP clients, embedded engines, or a mix).

    Raises:
        EngineError: no engines given.
    """

    def __init__(self, engines: Sequence[ServingEngine]) -> None:
        if not engines:
            raise EngineError("MultiEngine needs at least one engine")
        self.engines = list(engines)
        self._turn = itertools.count()
        self._pool = ThreadPoolExecutor(max_workers=max(2, len(self.engines)), thread_name_prefix="multi-engine")
        self._closed = False

    def __repr__(self) -> str:
        return f"MultiEngine({self.engines!r})"

    def generate(
        self, requests: list[GenerationRequest], *, timeout_s: float | None = None, inline: bool = False
    ) -> list[Completion]:
        """Deal prompts round-robin (all samples of a prompt on one engine); order is preserved.

        Raises:
            EngineError: naming the engine that failed (no silent retry on another engine); closed.
        """
        self._check_open()
        shares = self._spread(requests)
        futures = [
            self._pool.submit(_generate_on, engine, [requests[i] for i in share], timeout_s)
            for engine, share in zip(self.engines, shares, strict=True)
        ]
        out: list[Completion | None] = [None] * len(requests)
        for engine, share, future in zip(self.engines, shares, futures, strict=True):
            for i, completion in zip(share, _result(engine, future), strict=True):
                out[i] = completion
        return out  # type: ignore[return-value]  # every slot is filled above

    def _spread(self, requests: list[GenerationRequest]) -> list[list[int]]:
        """Indices per engine: prompts (equal `prompt_ids`) dealt round-robin from a rotating start."""
        return spread_groups(requests, len(self.engines), next(self._turn))

    def submit(self, request: GenerationRequest) -> Future[Completion]:
        """Submit to the next engine in turn."""
        self._check_open()
        return self.engines[next(self._turn) % len(self.engines)].submit(request)

    def abort(self, request_id: str | None = None, *, reason: str = "aborted") -> int:
        """Abort on every engine; the total count."""
        return sum(engine.abort(request_id, reason=reason) for engine in self.engines)

    def load_adapter(self, name: str, **kwargs: Any) -> None:
        """Load on every engine (concurrently). Raises EngineError listing the engines that failed;
        the others keep the adapter."""
        self._broadcast(lambda engine: engine.load_adapter(name, **kwargs), f"load_adapter({name!r})")

    def unload_adapter(self, name: str, **kwargs: Any) -> None:
        """Unload from every engine (concurrently); EngineError lists the engines that failed."""
        self._broadcast(lambda engine: engine.unload_adapter(name, **kwargs), f"unload_adapter({name!r})")

    def _broadcast(self, call: Any, what: str) -> None:
        futures = [self._pool.submit(call, engine) for engine in self.engines]
        failures = []
        for engine, future in zip(self.engines, futures, strict=True):
            try:
                future.result()
            except EngineError as exc:
                failures.append((engine, exc))
        if failures:
            text = "; ".join(f"{engine!r}: {exc}" for engine, exc in failures)
            unavailable = all(isinstance(exc, EngineUnavailable) for _, exc in failures)
            error = EngineUnavailable if unavailable else EngineError
            raise error(f"{what} failed on {len(failures)} of {len(self.engines)} engines: {text}")

    def list_adapters(self) -> dict[str, dict[str, Any]]:
        """Adapters loaded on every engine (info from the first engine)."""
        listed = [engine.list_adapters() for engine in self.engines]
        common = set(listed[0]).intersection(*listed[1:])
        return {name: info for name, info in listed[0].items() if name in common}

    def pause(self, mode: str = "in_place") -> None:
        """Pause every engine."""
        for engine in self.engines:
            engine.pause(mode)

    def resume(self) -> None:
        """Resume every engine."""
        for engine in self.engines:
            engine.resume()

    def flush_cache(self) -> bool:
        """Flush every engine's cache; True when every engine flushed."""
        return all([engine.flush_cache() for engine in self.engines])

    def is_paused(self) -> bool:
        """Whether any engine is paused (EngineError when one cannot say)."""
        return any([engine.is_paused() for engine in self.engines])

    def health(self) -> dict[str, Any]:
        """`{"ok": all ok, "paused": any paused, "engines": [each health]}`."""
        facts = [engine.health() for engine in self.engines]
        return {"ok": all(f.get("ok") for f in facts), "paused": any(f.get("paused") for f in facts), "engines": facts}

    def metrics(self) -> dict[str, Any]:
        """`{"engines": [each metrics]}`."""
        return {"engines": [engine.metrics() for engine in self.engines]}

    def members(self) -> list[RolloutEngine]:
        """The single engines behind this one (members of member `MultiEngine`s included), in order."""
        return [member for engine in self.engines for member in engine.members()]

    def close(self) -> None:
        """Close every engine and the worker threads (idempotent); later calls raise EngineError."""
        self._closed = True
        for engine in self.engines:
            engine.close()
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _check_open(self) -> None:
        if self._closed:
            raise EngineError(f"{self!r} is closed")


def _generate_on(engine: ServingEngine, requests: list[GenerationRequest], timeout_s: float | None) -> list[Completion]:
    return engine.generate(requests, timeout_s=timeout_s) if requests else []


def _result(engine: ServingEngine, future: Future) -> list[Completion]:
    try:
        return future.result()
    except EngineError as exc:
        raise type(exc)(f"{engine!r}: {exc}") from exc
