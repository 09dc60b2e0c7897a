"""Deployments and UI-style retries against a real local Prefect server.

A temporary `PREFECT_HOME`, `prefect server start` on 127.0.0.1, a process work pool, `prefect deploy --all`
from the project's prefect.yaml, a worker, and `prefect deployment run` with a tiny random model:

1. an injected fault (`LORA_RL_FAULT=train_step:2`) fails the flow run; `prefect flow-run retry` (what the UI's
   Retry does: AwaitingRetry, then a worker runs it again) completes it: the finished rollouts and scores show
   as Cached, step 1's update comes from its checkpoint and version 1 from the store;
2. `kill -9` of the worker (and its flow process) while the background upload of version 2 has written its files
   but not its manifest leaves no partial version; setting the run to AwaitingRetry and starting a new worker
   completes it (version 2 published again from step 2's checkpoint).

Every process runs in a process group of its own (`tests.support.processes`) and is stopped with its group and
its descendants, which covers the flow-run processes a worker starts in sessions of their own: the hung one of
the kill test (`publish_adapter:2:hang`) once outlived the test suite.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from lora_rl_core.store import AdapterStore
from tests.integration.tiny_run import write_tiny_config
from tests.support import processes

pytestmark = pytest.mark.slow  # a Prefect server, workers and flow-run processes

REPO = Path(__file__).resolve().parents[2]
PREFECT = str(Path(sys.executable).with_name("prefect"))
DEPLOYMENT = "lora-rl-train/smollm2-arith"
POOL = "lora-rl"


@pytest.fixture(scope="module", autouse=True)
def prefect_harness():  # overrides the package-wide test harness: this module runs a real server
    yield


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    home = tmp_path_factory.mktemp("prefect-home")
    port = _free_port()
    env = {
        **os.environ,
        "PREFECT_HOME": str(home),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_UI_ENABLED": "false",
        "LORA_RL_HOME": str(REPO),
        "PREFECT_WORKER_QUERY_SECONDS": "1",
        "PREFECT_LOGGING_LEVEL": "WARNING",
        "HF_HUB_OFFLINE": "1",
    }
    env.pop("PREFECT_API_URL", None)
    proc = processes.popen(
        [PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(port)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    api = f"http://127.0.0.1:{port}/api"
    env["PREFECT_API_URL"] = api
    try:
        _wait(lambda: httpx.get(f"{api}/health", timeout=2).status_code == 200, 90, "prefect server health")
        _cli(env, "work-pool", "create", POOL, "--type", "process")
        _cli(env, "--no-prompt", "deploy", "--all")
        yield api, env
    finally:
        processes.stop(proc, grace_s=30)


def _cli(env: dict[str, str], *args: str) -> str:
    out = processes.run([PREFECT, *args], env=env, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, f"prefect {' '.join(args)} failed:\n{out.stdout}\n{out.stderr}"
    return out.stdout


def _wait(predicate, seconds: float, what: str, log: Path | None = None) -> None:
    """Poll `predicate` until it holds; on timeout the error names `what` and ends with the worker's log
    (`log`), which holds the flow-run processes' output: a run that failed or never started says why."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if predicate():
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    tail = log.read_text(errors="replace")[-6000:] if log is not None and log.exists() else ""
    raise AssertionError(f"timed out after {seconds} s waiting for {what}" + (f"; worker log:\n{tail}" if tail else ""))


def _worker(env: dict[str, str], log: Path, extra_env: dict[str, str] | None = None) -> subprocess.Popen:
    """A process worker of the pool, its output (and its flow-run processes') appended to `log`."""
    with log.open("ab") as out:  # the child keeps its own copy of the descriptor
        return processes.popen(
            [PREFECT, "worker", "start", "--pool", POOL, "--limit", "1"],
            cwd=REPO,
            env={**env, **(extra_env or {}), "PREFECT_LOGGING_LEVEL": "INFO"},
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def _stop(worker: subprocess.Popen, sig: int = signal.SIGTERM) -> None:
    """Stop the worker, its group and its flow-run processes (in sessions of their own), with `sig` first."""
    processes.stop(worker, sig, grace_s=60)


def _reaches(api: str, run_id: str, want: str) -> bool:
    """Whether the flow run is in state `want`; a run that ended in another final state fails the test at
    once, with its state's message, instead of running out the wait."""
    state = httpx.get(f"{api}/flow_runs/{run_id}", timeout=10).json()["state"]
    if state["type"] != want and state["type"] in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED"):
        raise AssertionError(f"flow run ended {state['type']} instead of {want}: {state.get('message')}")
    return state["type"] == want


def _task_states(api: str, flow_run_id: str) -> dict[str, str]:
    body = {"flow_runs": {"id": {"any_": [flow_run_id]}}, "limit": 200, "offset": 0, "sort": "EXPECTED_START_TIME_ASC"}
    runs = httpx.post(f"{api}/task_runs/filter", json=body, timeout=10).json()
    return {r["name"]: r["state"]["name"] for r in runs}


def _run_deployment(env: dict[str, str], config: Path, run_id: str) -> str:
    out = _cli(env, "deployment", "run", DEPLOYMENT, "--param", f"config_path={config}", "--param", f"run_id={run_id}")
    return re.search(r"UUID:\s*([0-9a-f-]{36})", out).group(1)


def _config(tmp_path: Path, tiny_model_dir: Path) -> tuple[Path, Path]:
    sections = {
        "run": {"eval_before_after": False},
        "rollout": {"max_new_tokens": 6},
        "trainer": {"steps": 3},
        "data": {"train_size": 32},
    }
    return write_tiny_config(tmp_path, tiny_model_dir, "deploy", **sections), tmp_path / "store"


def test_injected_fault_then_ui_retry_completes_from_cache(server, tiny_model_dir, tmp_path):
    api, env = server
    config, store = _config(tmp_path, tiny_model_dir)
    log = tmp_path / "worker.log"
    worker = _worker(env, log, {"LORA_RL_FAULT": "train_step:2"})
    try:
        flow_run = _run_deployment(env, config, "it-fault")
        _wait(lambda: _reaches(api, flow_run, "FAILED"), 240, "the injected fault to fail the flow run", log)
        assert AdapterStore(f"file://{store}").versions("it-fault") == [0, 1]
        _cli(env, "flow-run", "retry", flow_run)  # the UI's Retry: AwaitingRetry, picked up by the worker
        _wait(lambda: _reaches(api, flow_run, "COMPLETED"), 240, "the retried flow run to complete", log)
    finally:
        _stop(worker)
    states = _task_states(api, flow_run)
    assert states["rollout-1"] == "Cached" and states["score-1"] == "Cached"
    # not cached, answered from the store: the step-1 checkpoint holds the update (its stats are replayed, nothing
    # is recomputed), and version 1 is returned as stored
    assert states["train_step-1"] == "Completed" and states["publish_adapter-1"] == "Completed"
    assert AdapterStore(f"file://{store}").versions("it-fault") == [0, 1, 2, 3]


def test_kill_worker_mid_publish_leaves_no_partial_version(server, tiny_model_dir, tmp_path):
    api, env = server
    config, store = _config(tmp_path, tiny_model_dir)
    log = tmp_path / "worker.log"
    worker = _worker(env, log, {"LORA_RL_FAULT": "publish_adapter:2:hang"})
    attempt_dir = store / "it-kill" / "adapters" / "v000002"
    try:
        flow_run = _run_deployment(env, config, "it-kill")
        wrote = lambda: any(attempt_dir.glob("*/adapter_model.safetensors"))  # noqa: E731
        _wait(wrote, 240, "publish of v2 to write its files", log)
    finally:
        _stop(worker, signal.SIGKILL)  # kill -9 the worker and the (hung) flow process it started
    assert AdapterStore(f"file://{store}").versions("it-kill") == [0, 1]  # no partial version
    assert not (attempt_dir / "manifest.json").exists()
    body = {"state": {"type": "SCHEDULED", "name": "AwaitingRetry"}, "force": True}
    assert httpx.post(f"{api}/flow_runs/{flow_run}/set_state", json=body, timeout=10).status_code in (200, 201)
    worker = _worker(env, log)
    try:
        _wait(lambda: _reaches(api, flow_run, "COMPLETED"), 240, "the retried flow run to complete", log)
    finally:
        _stop(worker)
    assert AdapterStore(f"file://{store}").versions("it-kill") == [0, 1, 2, 3]
