"""Deployments and UI-style retries against a real local Prefect server.

A temporary `PREFECT_HOME`, `prefect server start` on 127.0.0.1, a process work pool, `prefect deploy --all`
from the project's prefect.yaml, a worker, and `prefect deployment run` with a tiny random model:

1. an injected fault (`LORA_RL_FAULT=train:2`) fails the flow run; `prefect flow-run retry` (what the UI's
   Retry does: AwaitingRetry, then a worker runs it again) completes it: the finished rollouts and scores show
   as Cached, step 1's update comes from its checkpoint and version 1 from the store;
2. `kill -9` of the worker (and its flow process) while the background upload of version 2 has written its files
   but not its manifest leaves no partial version; setting the run to AwaitingRetry and starting a new worker
   completes it (version 2 published again from step 2's checkpoint).

A retry waits until the worker has let go of the failed attempt: Prefect sets FAILED from inside the flow-run
process, which then still flushes its logs and exits (seconds on a busy CPU), and until the worker has seen it
exit, the run's id holds the worker's one slot (`--limit 1`). A run scheduled again meanwhile (the UI's Retry, or
`prefect flow-run retry`) makes Prefect 3.8's worker ask its limiter for a second slot for the same id, which raises
`RuntimeError: this borrower is already holding one of this CapacityLimiter's tokens` out of its polling loop:
the worker exits and the retried run waits for a worker that is gone (both tests timed out so in full-suite runs:
the retried run, left scheduled, was then taken by the next test's worker, whose hang fault held its one slot).
The worker announces that it is done with a run (`prefect.worker.executed-flow-run`) after it freed the slot.
A wait fails at once, with the worker's log, when the worker has exited; a test that fails cancels its flow run,
so that no later worker takes it.

Every process runs in a process group of its own (`tests.support.processes`) and is stopped with its group and
its descendants, which covers the flow-run processes a worker starts in sessions of their own: the hung one of
the kill test (`publish:2:hang`) once outlived the test suite.
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
from typing import Any, NoReturn

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


def _wait(
    predicate, seconds: float, what: str, log: Path | None = None, worker: subprocess.Popen | None = None
) -> None:
    """Poll `predicate` until it holds; on timeout, or at once when `worker` has exited (nothing would run the
    flow run any more), the error names `what` and ends with the worker's log (`log`), which holds the
    flow-run processes' output: a run that failed or never started says why."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if predicate():
                return
        except httpx.HTTPError:
            pass
        if worker is not None and worker.poll() is not None:
            _fail(f"the worker exited with status {worker.returncode} while waiting for {what}", log)
        time.sleep(0.5)
    _fail(f"timed out after {seconds} s waiting for {what}", log)


def _fail(message: str, log: Path | None) -> NoReturn:
    tail = log.read_text(errors="replace")[-6000:] if log is not None and log.exists() else ""
    raise AssertionError(message + (f"; worker log:\n{tail}" if tail else ""))


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


def _executed(api: str, flow_run_id: str) -> int:
    """How many times a worker reported that it ran the flow run: `prefect.worker.executed-flow-run`, emitted
    once the flow-run process has exited and the worker has freed the run's slot."""
    body = {
        "filter": {
            "event": {"name": ["prefect.worker.executed-flow-run"]},
            "related": {"id": [f"prefect.flow-run.{flow_run_id}"]},
        },
        "limit": 50,
    }
    return len(httpx.post(f"{api}/events/filter", json=body, timeout=10).json()["events"])


def _cancel_unless_final(api: str, flow_run_id: str | None) -> None:
    """Cancel the flow run unless it ended: a run a failed test left scheduled would be taken by the next
    test's worker."""
    if flow_run_id is None:
        return
    state = httpx.get(f"{api}/flow_runs/{flow_run_id}", timeout=10).json()["state"]
    if state["type"] not in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED"):
        body = {"state": {"type": "CANCELLED", "message": "the test failed"}, "force": True}
        httpx.post(f"{api}/flow_runs/{flow_run_id}/set_state", json=body, timeout=10).raise_for_status()


def _task_states(api: str, flow_run_id: str) -> dict[str, str]:
    body = {"flow_runs": {"id": {"any_": [flow_run_id]}}, "limit": 200, "offset": 0, "sort": "EXPECTED_START_TIME_ASC"}
    runs = httpx.post(f"{api}/task_runs/filter", json=body, timeout=10).json()
    return {r["name"]: r["state"]["name"] for r in runs}


def _run_deployment(env: dict[str, str], config: Path, run_id: str) -> str:
    out = _cli(env, "deployment", "run", DEPLOYMENT, "--param", f"config_path={config}", "--param", f"run_id={run_id}")
    found = re.search(r"UUID:\s*([0-9a-f-]{36})", out)
    assert found is not None, f"no flow run id in the output of prefect deployment run:\n{out}"
    return found.group(1)


def _config(tmp_path: Path, tiny_model_dir: Path) -> tuple[Path, Path]:
    sections: dict[str, dict[str, Any]] = {
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
    worker = _worker(env, log, {"LORA_RL_FAULT": "train:2"})
    flow_run = None
    try:
        flow_run = _run_deployment(env, config, "it-fault")
        _wait(lambda: _reaches(api, flow_run, "FAILED"), 240, "the injected fault to fail the flow run", log, worker)
        assert AdapterStore(f"file://{store}").versions("it-fault") == [0, 1]
        # the failed attempt's process exits after FAILED; a retry before the worker freed its slot kills the worker
        done = f"the worker to report that it ran flow run {flow_run} (prefect.worker.executed-flow-run)"
        _wait(lambda: _executed(api, flow_run) >= 1, 120, done, log, worker)
        _cli(env, "flow-run", "retry", flow_run)  # the UI's Retry: AwaitingRetry, picked up by the worker
        _wait(lambda: _reaches(api, flow_run, "COMPLETED"), 240, "the retried flow run to complete", log, worker)
    finally:
        _stop(worker)
        _cancel_unless_final(api, flow_run)
    states = _task_states(api, flow_run)
    assert states["rollout-1"] == "Cached" and states["score-1"] == "Cached"
    # not cached, answered from the store: the step-1 checkpoint holds the update (its stats are replayed, nothing
    # is recomputed), and version 1 is returned as stored
    assert states["train-1"] == "Completed" and states["publish-1"] == "Completed"
    assert AdapterStore(f"file://{store}").versions("it-fault") == [0, 1, 2, 3]


def test_kill_worker_mid_publish_leaves_no_partial_version(server, tiny_model_dir, tmp_path):
    api, env = server
    config, store = _config(tmp_path, tiny_model_dir)
    log = tmp_path / "worker.log"
    worker = _worker(env, log, {"LORA_RL_FAULT": "publish:2:hang"})
    attempt_dir = store / "it-kill" / "adapters" / "v000002"
    flow_run = None
    try:
        try:
            flow_run = _run_deployment(env, config, "it-kill")
            wrote = lambda: any(attempt_dir.glob("*/adapter_model.safetensors"))  # noqa: E731
            _wait(wrote, 240, "publish of v2 to write its files", log, worker)
        finally:
            _stop(worker, signal.SIGKILL)  # kill -9 the worker and the (hung) flow process it started
        assert AdapterStore(f"file://{store}").versions("it-kill") == [0, 1]  # no partial version
        assert not (attempt_dir / "manifest.json").exists()
        body = {"state": {"type": "SCHEDULED", "name": "AwaitingRetry"}, "force": True}
        assert httpx.post(f"{api}/flow_runs/{flow_run}/set_state", json=body, timeout=10).status_code in (200, 201)
        worker = _worker(env, log)  # a new worker: the killed one's slot went with it
        try:
            _wait(lambda: _reaches(api, flow_run, "COMPLETED"), 240, "the retried flow run to complete", log, worker)
        finally:
            _stop(worker)
    finally:
        _cancel_unless_final(api, flow_run)
    assert AdapterStore(f"file://{store}").versions("it-kill") == [0, 1, 2, 3]
