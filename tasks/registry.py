"""The open runs of this process, by run id.

Why tasks need a registry: Prefect tasks receive and return small, serialisable values (run id, step,
`AdapterRef`, stats records) that it can persist and cache, but a run's components (the policy model and
its optimizer, the engine with its worker thread, trainer worker processes) cannot cross a task boundary.
The flow's first task builds them once (`open_run`); every later task of the run looks them up by run id.
So all tasks of one run execute in the flow's process (Prefect's default task runner does that); a task
that runs elsewhere finds no open run and fails with a clear error.

A run's plan and inputs are made once per process: `lora-rl train` prepares them before Prefect starts (its
checks print one line) and hands them over (`handed_over`); `open_run` takes them, and prepares them itself
only where nothing was handed over (a deployment's flow run, a retry from the UI).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from lora_rl_core.config import RunConfig
from lora_rl_core.errors import LoraRLError
from lora_rl_core.records import ResumeInfo
from lora_rl_core.run import PreparedRun, RunComponents, build_run, prepare_run
from lora_rl_core.run.resume import restore

_RUNS: dict[str, tuple[RunComponents, ResumeInfo]] = {}
_PREPARED: dict[str, PreparedRun] = {}  # by the config's JSON
_LOCK = threading.Lock()


@contextmanager
def handed_over(prepared: PreparedRun) -> Iterator[None]:
    """Within the block, `open_run` of a run with the same config builds from `prepared` instead of preparing
    again; if no run took it by the end of the block, its worker processes are stopped."""
    key = prepared.plan.config.model_dump_json()
    with _LOCK:
        _PREPARED[key] = prepared
    try:
        yield
    finally:
        with _LOCK:
            left = _PREPARED.pop(key, None)
        if left is not None:
            left.close()


def open_run(cfg: RunConfig, run_id: str) -> ResumeInfo:
    """Build run `run_id` from the plan and inputs handed over for `cfg` (else prepare them: `prepare_run`) and
    restore it, in this process (once; a second call returns the first one's info).

    If building or restoring fails, what was built is closed again.
    """
    with _LOCK:
        if run_id not in _RUNS:
            prepared = _PREPARED.pop(cfg.model_dump_json(), None) or prepare_run(cfg)
            try:
                run = build_run(prepared, run_id)
            except BaseException:
                prepared.close()
                raise
            try:
                _RUNS[run_id] = (run, restore(run))
            except BaseException:
                run.close()
                raise
        return _RUNS[run_id][1]


def get_run(run_id: str) -> RunComponents:
    """The components of open run `run_id`.

    Raises:
        LoraRLError: this process has not opened the run (its tasks ran in another process than `open_run`).
    """
    try:
        return _RUNS[run_id][0]
    except KeyError:
        raise LoraRLError(
            f"run {run_id!r} is not open in this process: its tasks must run in the flow's process, after open_run"
        ) from None


def close_run(run_id: str) -> None:
    """Close and forget run `run_id` (trainer workers, engine); nothing happens if it is not open."""
    with _LOCK:
        entry = _RUNS.pop(run_id, None)
    if entry is not None:
        entry[0].close()
