"""The flow's tasks are made from one table over the library's phase functions (`tasks.steps.PHASE_TASKS`): each
task carries its phase's name (the step loop's, the fault injector's and the UI's task runs), takes the run id in
place of the run's components, and keeps the phase's other parameters, which the cache keys read."""

from __future__ import annotations

import inspect

from lora_rl_core.run import phases, versions
from tasks.steps import _TASKS, PHASE_TASKS


def test_every_phase_function_is_the_task_of_its_own_name_taking_the_run_id():
    assert len(_TASKS) == len(PHASE_TASKS)
    for phase, _ in PHASE_TASKS:
        task = _TASKS[phase.__name__]
        assert task.name == phase.__name__
        params = list(inspect.signature(task.fn).parameters)
        assert params == ["run_id", *list(inspect.signature(phase).parameters)[1:]]
    loop = (phases.rollout, phases.score, phases.train, versions.publish, versions.sync, versions.flush)
    assert [_TASKS[f.__name__].name for f in loop] == ["rollout", "score", "train", "publish", "sync", "flush"]
    assert _TASKS["train"].task_run_name == "train-{step}" and _TASKS["sync"].task_run_name is None


def test_only_rollout_score_and_evaluate_persist_their_results():
    persisted = sorted(t.name for t in _TASKS.values() if t.persist_result)
    assert persisted == ["evaluate", "rollout", "score"]
