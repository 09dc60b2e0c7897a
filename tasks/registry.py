"""The open runs of this process, by run id.

Why tasks need a registry: Prefect tasks receive and return small, serialisable values (run id, step,
`AdapterRef`, stats records) that it can persist and cache, but a run's components (the policy model and
its optimizer, the engine with its worker thread, trainer worker processes) cannot cross a task boundary.
The flow's first task builds them once (`open_run`); every later task of the run looks them up by run id.
So all tasks of one run execute in the flow's process (Prefect's default task runner does that); a task
that runs elsewhere finds no open run and fails with a clear error.
"""

from __future__ import annotations

import threading

from lora_rl_core.config import RunConfig
from lora_rl_core.errors import LoraRLError
from lora_rl_core.records import ResumeInfo
from lora_rl_core.run import start_run
from lora_rl_core.run.components import RunComponents
from lora_rl_core.run.resume import restore

_RUNS: dict[str, tuple[RunComponents, ResumeInfo]] = {}
_LOCK = threading.Lock()


def open_run(cfg: RunConfig, run_id: str) -> ResumeInfo:
    """Load the inputs of run `run_id`, make its plan, build and restore it in this process (once; a second
    call returns the first one's info).

    If restoring fails, the components just built are closed again.
    """
    with _LOCK:
        if run_id not in _RUNS:
            run = start_run(cfg, run_id)
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
