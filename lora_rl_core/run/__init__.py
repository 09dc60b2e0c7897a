"""A training run without Prefect: load its inputs, make its plan, build its components once, then run the step
over them.

`inputs`: the data and tokenizer (`load_inputs`, `RunInputs`), the reward terms, and the checks made before
step 1 (`preflight`, gold answers, the reward leak check); `components`: `plan_run` (inputs, then the plan),
`build_run` (the one place that builds store, run files, rewards, engine and trainer from the plan) and
`RunComponents`, `build_evaluation` for `lora-rl eval`; `state`: the policy version rollouts use and the last
published version; `step`: the step as pure functions over records; `phases`: rollout, score, train, evaluate
(thin wrappers that read and write the run's files); `loop`: the step order; `versions`: publish and sync
adapter versions; `resume`: checkpoints and restore; `rundir`: the run's files in the store; `samples`: sample
completions of the first, middle and last steps, for the report.
"""

from lora_rl_core.run.components import RunComponents, build_evaluation, build_run, plan_run, start_run
from lora_rl_core.run.inputs import RunInputs, build_problems, load_inputs, preflight

__all__ = [
    "RunComponents",
    "RunInputs",
    "build_evaluation",
    "build_problems",
    "build_run",
    "load_inputs",
    "plan_run",
    "preflight",
    "start_run",
]
