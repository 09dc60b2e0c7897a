"""An SGLang server as a subprocess of the run: started in its own process group, waited for until healthy,
logged to a file, and stopped with its whole group (SGLang runs a tokenizer manager, a scheduler and a
detokenizer as separate processes; killing only the parent would leave the GPU held).

`launch_sglang(engine, model, lora, log_path)` starts what `engine.launch` describes for the run's model (the
local folder `lora_rl_core.models.model_folder` resolves, so an offline host needs no hub) and returns a
running `SGLangServer`; the engine registry (`lora_rl_core.engines.registry`) hands it to the run with the
engine, which stops it on close, on failure and on SIGTERM (the CLI turns signals into an exception, so every
`finally` runs).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING

import httpx

from lora_rl_core.engines.records import LaunchBudget, ResolvedLaunch
from lora_rl_core.errors import EngineError

if TYPE_CHECKING:
    from lora_rl_core.config import LoRAConfig, ModelConfig, SGLangEngineConfig

_POLL_S = 1.0
_log = logging.getLogger(__name__)


class SGLangServer:
    """One SGLang server process group.

    Args:
        argv: the command (`lora_rl_core.engines.launch.command.sglang_server_command`).
        url: where it will answer, e.g. `http://127.0.0.1:30000`.
        log_path: file that receives the server's stdout and stderr (appended).
        env: extra environment variables of the server.
        startup_timeout_s: how long `start` waits for `GET /health` to answer 200, seconds.
        memory_saver: `argv` has `--enable-memory-saver` (the KV cache can be released and resumed).
        label: what errors call it (another server of SGLang's HTTP API, e.g. `lora-rl serve`, runs here too).
    """

    def __init__(
        self,
        argv: Sequence[str],
        *,
        url: str,
        log_path: str | Path,
        env: dict[str, str] | None = None,
        startup_timeout_s: float = 900.0,
        memory_saver: bool = False,
        label: str = "SGLang server",
    ) -> None:
        self.argv = list(argv)
        self.label = label
        self.url = url.rstrip("/")
        self.log_path = Path(log_path)
        self.env = dict(env or {})
        self.startup_timeout_s = startup_timeout_s
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None
        self.memory_saver = memory_saver
        self.resolved: ResolvedLaunch | None = None  # set by `launch_sglang`
        """Started with `--enable-memory-saver`: `release_memory` / `resume_memory` work."""

    @property
    def pid(self) -> int | None:
        """The server's process id (its process group id too); None before `start`."""
        return None if self._proc is None else self._proc.pid

    @property
    def running(self) -> bool:
        """True while the server process lives."""
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> SGLangServer:
        """Start the server and wait until `/health` answers 200.

        Raises:
            EngineError: the process exited during start-up, or was not healthy within `startup_timeout_s`
                (it is stopped then); the message ends with the last lines of the log.
        """
        if self._proc is not None:
            raise EngineError(f"{self.label} at {self.url} was already started (pid {self.pid})")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        self._proc = subprocess.Popen(
            self.argv,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **self.env},
            start_new_session=True,  # its own process group: stop() ends SGLang's child processes too
        )
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_healthy(self) -> None:
        start = time.monotonic()
        with httpx.Client(timeout=5.0) as client:
            while time.monotonic() - start < self.startup_timeout_s:
                if self._proc is not None and self._proc.poll() is not None:
                    raise EngineError(
                        f"{self.label} exited with code {self._proc.returncode} during start-up "
                        f"({time.monotonic() - start:.0f} s); last lines of {self.log_path}:\n{self.log_tail()}"
                    )
                try:
                    if client.get(f"{self.url}/health").status_code == 200:
                        return
                except httpx.HTTPError:
                    pass  # not listening yet
                time.sleep(_POLL_S)
        raise EngineError(
            f"{self.label} at {self.url} was not healthy after {self.startup_timeout_s:.0f} s "
            f"(engine.launch.startup_timeout_s); last lines of {self.log_path}:\n{self.log_tail()}"
        )

    def stop(self, grace_s: float = 20.0) -> None:
        """SIGTERM the process group, then SIGKILL it after `grace_s` seconds; idempotent."""
        proc, self._proc = self._proc, None
        if proc is not None:
            _signal_group(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
            _signal_group(proc.pid, signal.SIGKILL)  # the group's other processes, even if the parent is gone
            proc.wait()
        if self._log is not None:
            self._log.close()
            self._log = None

    def release_memory(self, tags: Sequence[str] = ("kv_cache",), timeout_s: float = 120.0) -> float:
        """Free the GPU memory of `tags` (`POST /release_memory_occupation`; needs `--enable-memory-saver` and
        an idle server: no request in flight). Base weights and the LoRA pool stay (tag `kv_cache` alone;
        measured on SGLang 0.5.17: 44.6 GiB freed in 24 ms, ../shared/sglang-offline/memory_saver/).

        Returns:
            seconds the call took.

        Raises:
            EngineError: the server refused or did not answer.
        """
        return self._memory_call("release_memory_occupation", tags, timeout_s)

    def resume_memory(self, tags: Sequence[str] = ("kv_cache",), timeout_s: float = 120.0) -> float:
        """Take back what `release_memory` freed (`POST /resume_memory_occupation`); the prefix cache starts
        empty. Returns the seconds the call took.

        Raises:
            EngineError: the server refused or did not answer.
        """
        return self._memory_call("resume_memory_occupation", tags, timeout_s)

    def _memory_call(self, path: str, tags: Sequence[str], timeout_s: float) -> float:
        start = time.perf_counter()
        try:
            response = httpx.post(f"{self.url}/{path}", json={"tags": list(tags)}, timeout=timeout_s)
        except httpx.HTTPError as exc:
            raise EngineError(f"SGLang /{path} at {self.url} failed: {exc!r}") from None
        if response.status_code != 200:
            raise EngineError(f"SGLang /{path} at {self.url} answered {response.status_code}: {response.text[:300]}")
        return time.perf_counter() - start

    def log_tail(self, lines: int = 30) -> str:
        """The last `lines` lines of the server's log."""
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def __enter__(self) -> SGLangServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def launch_sglang(
    engine: SGLangEngineConfig,
    model: ModelConfig,
    lora: LoRAConfig,
    log_path: str | Path,
    *,
    resolved: ResolvedLaunch | None = None,
    plan: LaunchBudget | None = None,
    index: int = 0,
) -> SGLangServer:
    """Start the SGLang server `engine.launch` describes, for the run's model, and wait until it is healthy.
    Its `auto` settings come resolved (`resolved`, from the run's plan) or are resolved here against `plan`
    (`resolve.resolve_launch`, after probing the installation with `probe.probe_sglang`: a Ray replica on
    its own host); the resolved command and the reasons go to the top of the log.

    Args:
        resolved: the flags with every `auto` resolved (the run's plan, `lora_rl_core.plan`).
        plan: without `resolved`: the rollout batch and the memory plan's fraction and saver (None: SGLang's
            own defaults).
        index: which of `resolved.gpus` this server runs on (its `CUDA_VISIBLE_DEVICES`), on port
            `engine.launch.port + index`.

    Raises:
        ModelError: the model folder cannot be had.
        ConfigError: a pool SGLang would refuse (`sglang_launch_command`).
        EngineError: SGLang cannot be probed, or the server did not become healthy (the log's tail is in the
            message).
    """
    from lora_rl_core.engines.launch.command import render, sglang_server_command
    from lora_rl_core.engines.launch.probe import SGLangEnvironment, probe_for_launch
    from lora_rl_core.engines.launch.resolve import resolve_launch
    from lora_rl_core.models import model_folder

    launch = engine.launch
    env: SGLangEnvironment | str = "flags resolved by the run's plan"
    if resolved is None:
        plan = plan or LaunchBudget()
        env = probe_for_launch(launch)
        resolved = resolve_launch(
            launch,
            env,
            rollout_batch=plan.rollout_batch,
            mem_fraction=plan.mem_fraction,
            memory_saver=plan.memory_saver,
        )
    port = launch.port + index
    argv = sglang_server_command(engine, model, lora, str(model_folder(model)), resolved, port=port)
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "a") as log:
        log.write(f"[lora-rl] {env}\n[lora-rl] resolved: {resolved.reasons}\n[lora-rl] command: {render(argv)}\n")
    _log.info("SGLang command: %s", render(argv))
    server = SGLangServer(
        argv,
        url=f"http://{launch.host}:{port}",
        log_path=log_path,
        env={**launch.env, "CUDA_VISIBLE_DEVICES": resolved.gpus[index]} if resolved.gpus else launch.env,
        startup_timeout_s=launch.startup_timeout_s,
        memory_saver=resolved.memory_saver,
    )
    server.resolved = resolved  # what its `auto` flags became, and why
    return server.start()
