"""The Prefect tasks of a run, made from one table over the library's phase functions (`PHASE_TASKS`): each
phase function of `lora_rl_core.run` (`phases`, `versions`, `samples`) becomes the task of the same name, which
takes the run id in place of the run's components and looks them up (`lora_rl_core.run.components.get_run`).
`TaskPhases` runs them for the step loop (`lora_rl_core.run.loop.run_steps`) and the flow, so a phase has one
name from the loop to the task run the UI shows.

Tasks take the run id and small values and return small typed records (`lora_rl_core.records` stats,
`AdapterRef`s); models, engines and tensors stay in the run's components, open in the flow's process
(`lora_rl_core.run.components`).

Resume: `rollout` and `score` persist their results with cache keys that name
the run, the task and the step (`<run>-rollout-000007`), in result storage next
to the run in the adapter store (`TaskPhases(run_id, result_storage(...))`). A retried flow
run, or a new flow run with the same run id, takes them from the cache (their
task runs show `Cached`); `open_run` restores the trainer from the newest
checkpoint. `train` and `publish` are not cached: they return as
soon as their snapshot is handed to the run's store writer, before the store
holds it, so a cached result could name a checkpoint or version a crash never
let land. The library answers them from the store instead: a step the restored
checkpoint holds replays its recorded stats, a version the store holds is
returned as stored (`lora_rl_core.run.phases.train`, `versions.publish`).
`flush` waits for the writes at the end of the steps (and on a failure).
"""

from __future__ import annotations

import importlib
import inspect
import re
from collections.abc import Callable
from typing import Any, Concatenate, ParamSpec, TypeVar

from prefect import Task, task
from prefect.cache_policies import NO_CACHE
from prefect.filesystems import LocalFileSystem, RemoteFileSystem, WritableFileSystem
from prefect.futures import PrefectFuture
from prefect.runtime import flow_run

from lora_rl_core.records import ResumeInfo
from lora_rl_core.run import RunComponents, components, phases, samples, versions
from lora_rl_core.run.resume import resume_run

P = ParamSpec("P")
T = TypeVar("T")


def _step_key(context: Any, params: dict[str, Any]) -> str:
    return f"{params['run_id']}-{context.task.name}-{int(params['step']):06d}"


def _eval_key(context: Any, params: dict[str, Any]) -> str:
    # "graded": evaluations by the fixed grader (issue 31); one cached by a run of an older version, graded by
    # the training reward, is not reused when the run resumes
    return f"{params['run_id']}-evaluate-graded-{params['adapter'] or 'base'}"


_NO_CACHE: dict[str, Any] = {"cache_policy": NO_CACHE, "persist_result": False}
_BY_STEP: dict[str, Any] = {"cache_key_fn": _step_key, "persist_result": True}
_BY_ADAPTER: dict[str, Any] = {"cache_key_fn": _eval_key, "persist_result": True}

PHASE_TASKS: tuple[tuple[Callable[..., Any], dict[str, Any]], ...] = (
    (phases.rollout, _BY_STEP),  # a retried run takes a step's rollouts and scores from the cache
    (phases.score, _BY_STEP),
    (phases.train, _NO_CACHE),  # answered from the restored checkpoint instead (module docstring)
    (versions.publish, _NO_CACHE),  # answered from the store; not retried: the store retries its own writes
    (versions.sync, _NO_CACHE),
    (versions.flush, _NO_CACHE),
    (phases.evaluate, _BY_ADAPTER),
    (samples.step_samples, _NO_CACHE),
    (samples.heldout_preview, _NO_CACHE),
    (samples.report, _NO_CACHE),
)
"""Every phase function a flow runs, with its task's cache options (the table the tasks are made from)."""


def phase_task(phase: Callable[..., Any], **options: Any) -> Task[..., Any]:
    """The Prefect task of `phase`: named as the function (task runs `<name>-<step>` where it takes a step),
    taking `run_id` in place of the run's components (`lora_rl_core.run.components.get_run`), documented by its
    docstring."""
    signature = inspect.signature(phase)
    params = list(signature.parameters.values())[1:]
    module, name = importlib.import_module(phase.__module__), phase.__name__

    def run_phase(run_id: str, *args: Any, **kwargs: Any) -> Any:
        # the module's function at call time, as a direct call would find it (a test may wrap it)
        return getattr(module, name)(components.get_run(run_id), *args, **kwargs)

    run_id = inspect.Parameter("run_id", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=str)
    run_phase.__signature__ = signature.replace(parameters=[run_id, *params])  # type: ignore[attr-defined]
    run_phase.__name__ = run_phase.__qualname__ = phase.__name__
    run_phase.__doc__ = phase.__doc__
    named = "step" in signature.parameters
    return task(name=phase.__name__, task_run_name=f"{phase.__name__}-{{step}}" if named else None, **options)(
        run_phase
    )


_TASKS: dict[str, Task[..., Any]] = {phase.__name__: phase_task(phase, **o) for phase, o in PHASE_TASKS}


@task(name="open_run", **_NO_CACHE)
def open_run(config_path: str | None, overrides: list[str], run_id: str | None) -> ResumeInfo:
    """The run `lora-rl train` opened before the flow started, else one built here from the config, restored
    from its newest checkpoint (`lora_rl_core.run.resume.resume_run`; the default id's suffix is the flow run's
    id)."""
    return resume_run(run_id, config_path, overrides, str(flow_run.id))


class TaskPhases:
    """The phase functions of run `run_id` as Prefect task runs (a `lora_rl_core.run.loop.PhaseRunner`): each
    call is a task run, cached, retried and persisted as `PHASE_TASKS` says (persisted results go to
    `storage`); submitted phases are task futures, run by the flow's task runner while the flow goes on."""

    def __init__(self, run_id: str, storage: WritableFileSystem) -> None:
        self.run_id = run_id
        self._tasks = {
            name: t.with_options(result_storage=storage) if t.persist_result else t for name, t in _TASKS.items()
        }

    def call(self, phase: Callable[Concatenate[RunComponents, P], T], /, *args: P.args, **kwargs: P.kwargs) -> T:
        """Run `phase`'s task (the task of its name) now."""
        return self._tasks[phase.__name__](self.run_id, *args, **kwargs)  # type: ignore[return-value]  # a sync task

    def submit(
        self, phase: Callable[Concatenate[RunComponents, P], T], /, *args: P.args, **kwargs: P.kwargs
    ) -> PrefectFuture[T]:
        """Submit `phase`'s task to the flow's task runner."""
        return self._tasks[phase.__name__].submit(self.run_id, *args, **kwargs)


def result_storage(store_uri: str, storage_options: dict[str, Any], run_id: str) -> WritableFileSystem:
    """Where task results persist: `<store_uri>/<run_id>/prefect-results` (local folder or fsspec remote; the
    open run's store, `ResumeInfo.store_uri`), saved as a block named after the run so a retry on any worker
    reads the same results."""
    url = f"{store_uri.rstrip('/')}/{run_id}/prefect-results"
    block = (
        LocalFileSystem(basepath=url.removeprefix("file://"))
        if url.startswith("file://")
        else RemoteFileSystem(basepath=url, settings=storage_options)
    )
    block.save(f"lora-rl-results-{prefect_slug(run_id)}"[:120], overwrite=True)
    return block


def prefect_slug(text: str) -> str:
    """`text` as a Prefect block/artifact key: lowercase letters, digits and dashes."""
    return re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")
