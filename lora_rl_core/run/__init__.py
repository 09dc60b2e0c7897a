"""A training run without Prefect: build its components once, then run phases over them.

`components`: `build_run` (the one place that builds store, run files, data, rewards, engine and trainer)
and `RunComponents`; `inputs`: the data and reward terms, and the checks made on them before step 1
(`preflight`, gold answers, the reward leak check); `phases`: rollout, score, train, evaluate; `versions`:
publish and sync adapter versions; `resume`: checkpoints and restore; `rundir`: the run's files in the store;
`samples`: sample completions of the first, middle and last steps, for the report.
"""

from lora_rl_core.run.components import RunComponents, build_run, runtime_info
from lora_rl_core.run.inputs import build_problems, preflight

__all__ = ["RunComponents", "build_problems", "build_run", "preflight", "runtime_info"]
