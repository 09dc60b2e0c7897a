"""SGLang replicas as Ray actors: each actor launches and owns one SGLang server; the run talks to the servers
through `HTTPEngine` clients (dialect `SGLANG`) behind one `MultiEngine` (`engine.type: sglang`,
`engine.launch.enabled`, `engine.ray_replicas: N`).

`start_sglang_replicas(inputs, connect)` joins the Ray cluster of `RAY_ADDRESS` (or starts a local one),
starts `engine.ray_replicas` `SGLangReplica` actors, each reserving `engine.ray_gpus_per_replica` GPUs (a
fraction shares a GPU, e.g. with a trainer rank of `trainer.backend.gpus_per_rank`) and launching the server
`engine.launch` describes on port `launch.port + i` (`lora_rl_core.engines.launch.process.launch_sglang`; Ray
gives the actor, and so the server, its GPU through `CUDA_VISIBLE_DEVICES`). Generation, loads and retirement
then go over HTTP as with one launched server: the samples of a prompt stay on one replica, versions load into every
replica (tensor path by CUDA IPC when the server is on this host, `engine.tensor_transport: auto`).

Choices made here:

* The actor owns its server: `stop()` stops the server's process group, and a reaper process started beside
  the server stops the group if the actor's process dies (`ray.kill`, a crash), so no server outlives its
  actor. Closing the `BuiltEngine` stops every server, kills the actors and gives back the run's use of Ray.
* A replica whose server or actor died fails the call with `EngineUnavailable` naming its URL (the step
  fails cleanly; resume the run). It is not replaced: a new server needs minutes to start, longer than a
  step, and the version history to reload is the run's to replay on resume.
* With `launch.host` 127.0.0.1 (the default) the servers must be on the driver's node; for replicas on
  other nodes bind `0.0.0.0` (the URL then names the node's address) and set an API key.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lora_rl_core.config import sglang_section
from lora_rl_core.engines.records import BuiltEngine, EngineInputs
from lora_rl_core.errors import ConfigError, EngineError
from lora_rl_core.ray_cluster import acquire_ray, release_ray

if TYPE_CHECKING:
    from lora_rl_core.engines.launch.process import SGLangServer

# The reaper: while the actor (argv[1]) lives, wait; then stop the server's process group (argv[2]). It ends on
# its own when the group is gone (the server was stopped normally). It forks away first and prints its pid:
# when an actor dies, Ray kills the actor's child processes (the server's main process among them), and the
# reaper must not be one of them.
_REAPER = """
import os, signal, sys, time
if os.fork():
    os._exit(0)
print(os.getpid(), flush=True)
sys.stdout.close()
actor, group = int(sys.argv[1]), int(sys.argv[2])
def alive(kill, target):
    try:
        kill(target, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
while alive(os.killpg, group):
    if not alive(os.kill, actor):
        os.killpg(group, signal.SIGTERM)
        time.sleep(5)
        if alive(os.killpg, group):
            os.killpg(group, signal.SIGKILL)
        break
    time.sleep(0.5)
"""


class SGLangReplica:
    """The body of one replica actor: launches the SGLang server of `engine.launch` on port
    `launch.port + index`, logs to `<log_dir>/sglang-<index>.log`, and starts its reaper.

    Raises:
        EngineError: the server did not become healthy (from `launch_sglang`).
    """

    def __init__(self, inputs: EngineInputs, index: int, log_dir: str) -> None:
        from lora_rl_core.engines.launch.process import launch_sglang

        assert inputs.model is not None and inputs.lora is not None  # start_sglang_replicas checked
        section = sglang_section(inputs.engine, "an SGLang replica")
        launch = section.launch.model_copy(update={"port": section.launch.port + index})
        engine = section.model_copy(update={"launch": launch})
        self.host = launch.host
        self.server: SGLangServer = launch_sglang(
            engine, inputs.model, inputs.lora, Path(log_dir) / f"sglang-{index}.log", plan=inputs.launch_budget
        )
        assert self.server.pid is not None
        starter = subprocess.Popen(
            [sys.executable, "-c", _REAPER, str(os.getpid()), str(self.server.pid)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            start_new_session=True,  # not in the actor's group: it must outlive the actor by a moment
        )
        assert starter.stdout is not None
        self.reaper_pid = int(starter.stdout.readline())
        starter.stdout.close()
        starter.wait()

    def url(self) -> str:
        """Where the server answers; a wildcard bind is named by this node's address."""
        if self.host in ("0.0.0.0", "::"):
            import ray

            return self.server.url.replace(self.host, ray.util.get_node_ip_address(), 1)
        return self.server.url

    def resolved(self) -> dict[str, Any]:
        """What this replica resolved on its host: `node` (its address), `url`, and its server's `auto` flags
        (`flags`: each resolved value) with their `reasons`."""
        import ray

        launch = self.server.resolved
        reasons = dict(launch.reasons) if launch is not None else {}
        return {
            "node": ray.util.get_node_ip_address(),
            "url": self.url(),
            "flags": {key: getattr(launch, key) for key in reasons},
            "reasons": reasons,
        }

    def pids(self) -> dict[str, int | None]:
        """The actor's, the server's (its process group) and the reaper's process ids."""
        return {"actor": os.getpid(), "server": self.server.pid, "reaper": self.reaper_pid}

    def stop(self) -> None:
        """Stop the server's process group; the reaper then ends by itself (killed after 10 s if not)."""
        self.server.stop()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                os.kill(self.reaper_pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.1)
        os.kill(self.reaper_pid, signal.SIGKILL)


def start_sglang_replicas(inputs: EngineInputs, connect: Callable[[list[str]], BuiltEngine]) -> BuiltEngine:
    """Start `engine.ray_replicas` `SGLangReplica` actors and return a `BuiltEngine` over clients of their
    servers (`connect(urls)`, a `MultiEngine`), owning the actors and the run's use of Ray. Each replica's entry
    of `BuiltEngine.resolved` (run.json `replicas`) says what it resolved on its host and the tensor transport
    its client resolved for it (`server_transport`: `ipc` for a server on this host with CUDA here).

    Takes one use of Ray (`ray_cluster.acquire_ray`), given back on close. Each actor reserves one CPU and
    `engine.ray_gpus_per_replica` GPUs.

    Raises:
        ConfigError: no model or lora section given.
        EngineError: a server did not start (the replicas started are stopped; the message names the log), or
            is of an SGLang version the client does not know (`connect`; the replicas are stopped).
    """
    import ray

    if inputs.model is None or inputs.lora is None:
        raise ConfigError("launching SGLang replicas needs the model and lora sections (EngineInputs)")
    engine = sglang_section(inputs.engine, "SGLang replicas")
    log_dir = str(inputs.log_dir or Path.cwd())
    acquire_ray()
    options = {"num_cpus": 1, "num_gpus": engine.ray_gpus_per_replica, "max_restarts": 0}
    actor_cls: Any = ray.remote(SGLangReplica).options(**options)  # Ray's stubs: untyped
    actors = [actor_cls.remote(inputs, i, log_dir) for i in range(engine.ray_replicas)]
    try:
        resolved = ray.get([a.resolved.remote() for a in actors], timeout=engine.launch.startup_timeout_s + 120)
    except Exception as exc:
        _stop_actors(actors)
        release_ray()
        raise EngineError(
            f"SGLang replicas did not start ({type(exc).__name__}: {exc}); their logs: {log_dir}/sglang-*.log"
        ) from None
    try:  # the servers started: a refusal here (an SGLang version the client does not know) is said as it is
        clients = connect([r["url"] for r in resolved])
    except BaseException:
        _stop_actors(actors)
        release_ray()
        raise
    clients.owned += [release_ray, lambda: _stop_actors(actors)]  # run last first: the actors stop, then Ray
    clients.actors += actors
    from lora_rl_core.engines.remote.ipc import server_transport  # lazy: torch only for tensor loads

    requested = inputs.tensor_transport or engine.tensor_transport
    for replica in resolved:  # what each client resolved for its server, now that its URL is known
        replica["tensor_transport"] = server_transport(requested, replica["url"])
    clients.resolved += resolved
    return clients


def _stop_actors(actors: list[Any]) -> None:
    """Stop each actor's server (a dead actor's reaper does that), then kill the actor."""
    import ray

    for actor in actors:
        try:
            ray.get(actor.stop.remote(), timeout=60)
        except Exception:  # noqa: BLE001 - a dead actor has no server left to stop (its reaper stopped it)
            pass
        try:
            ray.kill(actor, no_restart=True)
        except Exception:  # noqa: BLE001 - Ray already gone: its actors went with it
            pass
