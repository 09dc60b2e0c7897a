"""Engine replicas as Ray actors: N engines, each built in its own Ray actor, behind one `ServingEngine`.

`start_ray_replicas(build, inputs)` joins the Ray cluster named by `RAY_ADDRESS` (or starts a local one,
`ray.init()`), starts `engine.ray_replicas` `EngineReplica` actors, each building its engine with `build`
(an engine kind's builder from the registry, e.g. the embedded engine; one CPU each), and returns a
`BuiltEngine` whose engine is a `MultiEngine` over one `RayEngine` handle per actor:
the samples of one prompt stay on one replica, adapter loads and unloads go to every replica
(`lora_rl_core.engines.multi`). Tensors for a load travel through Ray's object store (shared memory on one
node); a path (store version) is read by each replica itself.

Choices made here:

* Every call waits with a deadline (`ray.get(..., timeout=)`); a call past it raises `EngineUnavailable`.
* The actor is threaded (`ACTOR_CONCURRENCY`): a generate call held by a paused engine does not block the abort,
  resume or health call that ends it (found by the conformance suite: a single-threaded actor timed out there).
* A replica whose actor died is replaced (`engine.ray_replace_dead`, the default): `RayEngine` starts a new
  actor, loads into it every adapter the dead one held (it records the loads and unloads that went
  through it), and retries the failed call there once; `metrics()["replica_replacements"]` counts them.
  With replacement off, or when the new actor fails too, the call raises `EngineUnavailable` naming the
  replica (the step fails cleanly and the run can be resumed). Nothing moves to another replica.
* Ray itself never restarts an actor (`max_restarts=0`): it would come back without the adapters the
  protocol loaded, and serve stale state silently.
* `close()` kills the actors and gives back the run's use of Ray (`lora_rl_core.ray_cluster`).

SGLang replicas (one SGLang server per actor) are `lora_rl_core.engines.launch.ray_sglang`; the trainer on Ray is
`lora_rl_core.trainer.ray_actors`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from lora_rl_core.config import RayReplicas
from lora_rl_core.engines.base import Completion, GenerationRequest
from lora_rl_core.engines.multi import MultiEngine
from lora_rl_core.engines.records import BuiltEngine, EngineInputs
from lora_rl_core.errors import ConfigError, EngineError, EngineUnavailable
from lora_rl_core.ray_cluster import acquire_ray, release_ray

log = logging.getLogger(__name__)

ACTOR_CONCURRENCY = 32
"""Calls one replica actor runs at once (Ray's `max_concurrency`): generate calls from several submitters, plus
the control calls (abort, pause, resume, health) that must get through while they wait."""


class EngineReplica:
    """The body of one replica actor: the engine `build(inputs)` makes (what it starts is owned here and
    stopped with it), with `torch` limited to `num_threads` threads. Its methods are the engine's own."""

    def __init__(self, build: Callable[[EngineInputs], BuiltEngine], inputs: EngineInputs, num_threads: int) -> None:
        import ray
        import torch

        torch.set_num_threads(max(1, num_threads))
        self.answer: dict[str, Any] = {"node": ray.util.get_node_ip_address()}
        model = inputs.model
        if model is not None:
            # only this host knows its devices: `model.device` and `model.dtype` resolved here (`auto`), once, and
            # reported either way
            from lora_rl_core.models import model_dtype, resolve_device

            device, dtype = resolve_device(model.device), model_dtype(model)
            resolved = model.model_copy(update={"device": str(device), "dtype": dtype.name})
            inputs = dataclasses.replace(inputs, model=resolved)
            self.answer.update(device=str(device), dtype=dtype.name, dtype_reason=dtype.reason)
        self.built = build(inputs)

    def resolved(self) -> dict[str, Any]:
        """What this replica resolved on its host: `node` (its address), and for a model it loads `device`,
        `dtype` and `dtype_reason`."""
        return self.answer

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """`engine.<method>(*args, **kwargs)`; `close` also stops what the builder started."""
        if method == "close":
            return self.built.close()
        return getattr(self.built.engine, method)(*args, **kwargs)

    def pid(self) -> int:
        """The actor's process id."""
        return os.getpid()


class RayEngine:
    """`ServingEngine` over one `EngineReplica` actor. Every method raises `EngineUnavailable` when the
    actor died or did not answer within its deadline, and the engine's own `EngineError`s otherwise.

    Args:
        actor: the actor handle.
        label: how errors and `repr` name the replica.
        timeout_s: deadline of a generate call, seconds; control calls get `control_timeout_s`.
        restart: starts a fresh `EngineReplica` actor to replace a dead one (module docstring); None = no
            replacement.
    """

    def __init__(
        self,
        actor: Any,
        label: str,
        *,
        timeout_s: float,
        control_timeout_s: float = 300.0,
        restart: Callable[[], Any] | None = None,
    ) -> None:
        self.actor = actor
        self.label = label
        self.timeout_s = timeout_s
        self.control_timeout_s = control_timeout_s
        self.replacements = 0
        self._restart = restart
        self._adapters: dict[str, dict[str, Any]] = {}  # name -> load_adapter kwargs, to reload into a new actor
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix=f"ray-{label}")
        self._closed = False

    def __repr__(self) -> str:
        return f"RayEngine({self.label})"

    def _call(self, method: str, *args: Any, wait_s: float | None = None, **kwargs: Any) -> Any:
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        if self._closed:
            raise EngineError(f"{self!r} is closed")
        timeout = wait_s if wait_s is not None else self.control_timeout_s
        for attempt in (0, 1):
            actor = self.actor
            try:
                return ray.get(actor.call.remote(method, *args, **kwargs), timeout=timeout)
            except RayActorError as exc:
                if attempt or self._restart is None or method == "close":
                    raise EngineUnavailable(
                        f"engine replica {self.label} died ({type(exc).__name__}): the step fails; resume the run "
                        "to start fresh replicas"
                    ) from None
                self._replace(actor, exc)
            except GetTimeoutError:
                raise EngineUnavailable(
                    f"engine replica {self.label}: {method} did not answer within {timeout:g} s"
                ) from None
        raise AssertionError("unreachable")

    def _replace(self, dead: Any, cause: Exception) -> None:
        """Start a new actor for this replica and reload the adapters the dead one held (once per death, however
        many threads saw it).

        Raises:
            EngineUnavailable: the new actor did not start or could not load an adapter.
        """
        import ray

        with self._lock:
            if self.actor is not dead:
                return  # another thread replaced it already
            log.warning("engine replica %s died (%s): starting a new one", self.label, type(cause).__name__)
            assert self._restart is not None
            fresh = self._restart()
            try:
                ray.get(fresh.pid.remote(), timeout=600)
                for name, kwargs in self._adapters.items():
                    ray.get(fresh.call.remote("load_adapter", name, **kwargs), timeout=self.control_timeout_s)
            except Exception as exc:
                ray.kill(fresh, no_restart=True)
                raise EngineUnavailable(
                    f"engine replica {self.label} died and its replacement failed ({type(exc).__name__}: {exc}); "
                    "the step fails; resume the run to start fresh replicas"
                ) from None
            ray.kill(dead, no_restart=True)
            self.actor = fresh
            self.replacements += 1

    def generate(
        self, requests: list[GenerationRequest], *, timeout_s: float | None = None, inline: bool = False
    ) -> list[Completion]:
        """The replica's `generate` (order preserved). Raises EngineUnavailable when the actor died."""
        deadline = timeout_s if timeout_s is not None else self.timeout_s
        # the engine ends its requests at `deadline` itself; the extra 30 s only catch a replica that hangs
        return list(self._call("generate", requests, wait_s=deadline + 30.0, timeout_s=deadline))

    def submit(self, request: GenerationRequest) -> Future[Completion]:
        """One request in the background; the future raises as `generate` does."""
        if self._closed:
            raise EngineError(f"{self!r} is closed")
        return self._pool.submit(lambda: self.generate([request])[0])

    def abort(self, request_id: str | None = None, *, reason: str = "aborted") -> int:
        """`ServingEngine.abort` on the replica: how many requests it aborted."""
        return int(self._call("abort", request_id, reason=reason))

    def load_adapter(self, name: str, **kwargs: Any) -> None:
        """`ServingEngine.load_adapter` on the replica (tensors travel through Ray's object store)."""
        self._call("load_adapter", name, **kwargs)
        self._adapters[name] = kwargs

    def unload_adapter(self, name: str, **kwargs: Any) -> None:
        """`ServingEngine.unload_adapter` on the replica."""
        self._call("unload_adapter", name, **kwargs)
        self._adapters.pop(name, None)

    def list_adapters(self) -> dict[str, dict[str, Any]]:
        """`ServingEngine.list_adapters` of the replica: name -> info."""
        return dict(self._call("list_adapters"))

    def pause(self, mode: str = "in_place") -> None:
        """Pause the replica's generation (`abort`, `retract` or `in_place`)."""
        self._call("pause", mode)

    def resume(self) -> None:
        """Resume the replica's generation."""
        self._call("resume")

    def flush_cache(self) -> bool:
        """Flush the replica's cache; True when flushed."""
        return bool(self._call("flush_cache"))

    def is_paused(self) -> bool:
        """Whether the replica's generation is paused; EngineUnavailable when its actor cannot answer."""
        return bool(self._call("is_paused", wait_s=20.0))

    def health(self) -> dict[str, Any]:
        """The replica's health, or `{"ok": False, "error"}` when its actor cannot answer (never raises)."""
        try:
            return {**self._call("health", wait_s=20.0), "replica": self.label}
        except EngineError as exc:
            return {"ok": False, "paused": True, "replica": self.label, "error": str(exc)}

    def metrics(self) -> dict[str, Any]:
        """The replica's `metrics()`, with `replica_replacements` (dead actors this replica replaced)."""
        return {**self._call("metrics"), "replica_replacements": self.replacements}

    def members(self) -> list[RayEngine]:
        """`[self]`: one engine."""
        return [self]

    def close(self) -> None:
        """Close the engine and kill the actor (idempotent)."""
        if self._closed:
            return
        import ray

        try:
            self._call("close", wait_s=30.0)
        except EngineError:
            pass  # a dead replica has nothing left to close
        self._closed = True
        self._pool.shutdown(wait=False, cancel_futures=True)
        ray.kill(self.actor, no_restart=True)


def start_ray_replicas(
    build: Callable[[EngineInputs], BuiltEngine], inputs: EngineInputs, *, num_cpus: float = 1.0
) -> BuiltEngine:
    """Start `engine.ray_replicas` `EngineReplica` actors, each building its engine with `build(inputs)` (Ray
    replicas switched off in the copy it gets), and return a `BuiltEngine` over them: a `MultiEngine` of
    `RayEngine` handles, owning the run's use of Ray.

    Takes one use of Ray (`ray_cluster.acquire_ray`: `RAY_ADDRESS`, else a local Ray), given back when the
    `BuiltEngine` closes. Each actor reserves `num_cpus` CPUs (torch gets as many threads), and
    `engine.ray_gpus_per_replica` GPUs when the model runs on CUDA (Ray hides the GPUs from an actor that
    reserves none). Each replica resolves `model.device` and `model.dtype` on its own host (`BuiltEngine.resolved`
    holds the answers).

    Raises:
        EngineError: an actor failed to start (the ones started are killed).
    """
    import ray

    cfg = inputs.engine
    if not isinstance(cfg, RayReplicas):
        raise ConfigError(f"engine.ray_replicas: engine.type {cfg.type} has no Ray replicas")
    on_gpu = inputs.model is not None and inputs.model.device.startswith("cuda")
    actor_inputs = dataclasses.replace(
        inputs, engine=cfg.model_copy(update={"ray_replicas": 0}), tokenizer=None
    )  # a tokenizer object does not travel; each actor loads its own
    acquire_ray()
    gpus = cfg.ray_gpus_per_replica if on_gpu else 0.0
    # Threaded actor: a generate call waiting in a paused engine must not hold off the abort, resume or health
    # call that ends the wait (the engine is thread-safe; one thread per call, as our server's are).
    options = {"num_cpus": num_cpus, "num_gpus": gpus, "max_restarts": 0, "max_concurrency": ACTOR_CONCURRENCY}
    actor_cls: Any = ray.remote(EngineReplica).options(**options)  # Ray's stubs: untyped

    def restart() -> Any:
        return actor_cls.remote(build, actor_inputs, max(1, int(num_cpus)))

    actors: list[Any] = [restart() for _ in range(cfg.ray_replicas)]
    engines = [
        RayEngine(a, f"replica-{i}", timeout_s=cfg.timeout_s, restart=restart if cfg.ray_replace_dead else None)
        for i, a in enumerate(actors)
    ]
    try:
        resolved = ray.get([a.resolved.remote() for a in actors], timeout=600)  # constructed: the model is loaded
    except Exception as exc:
        for a in actors:
            ray.kill(a, no_restart=True)
        release_ray()
        raise EngineError(f"engine replicas did not start: {type(exc).__name__}: {exc}") from None
    return BuiltEngine(MultiEngine(engines), owned=[release_ray], actors=actors, resolved=resolved)
