"""A training run without Prefect: load its inputs, make its plan, build its components once, then run the step
over them.

`inputs`: the store, data, tokenizer, reward terms and grader (`load_inputs`, `RunInputs`), and the checks made
before step 1 (gold answers, the reward leak check, stop token ids); `components`: `build_run` (the one place
that builds a run from its plan and inputs: engine, run files, trainer; open by run id until closed), `open_run`
(the inputs, the plan, then `build_run`),
`RunComponents`, `build_evaluation` for `lora-rl eval`; `state`: the policy version rollouts use and the last
published version; `step`: the step as pure functions over records; `phases`: rollout, score, train, evaluate
(thin wrappers that read and write the run's files); `loop`: the step order; `versions`: publish and sync
adapter versions; `resume`: checkpoints and restore; `rundir`: the run's files in the store; `samples`: sample
completions of the first, middle and last steps, for the report.
"""

from lora_rl_core.run.components import (
    RunComponents,
    build_evaluation,
    build_run,
    close_run,
    get_run,
    is_open,
    open_run,
)
from lora_rl_core.run.inputs import RunInputs, load_inputs

__all__ = [
    "RunComponents",
    "RunInputs",
    "build_evaluation",
    "build_run",
    "close_run",
    "get_run",
    "is_open",
    "load_inputs",
    "open_run",
]
