"""The run's plan: one frozen record made from the config and the machine before anything starts.

`make_plan(cfg, inputs)` resolves every `auto` setting once (the dtypes, the LoRA compute dtype, Liger's
kernels, the devices, the memory plan, a launched SGLang's flags, the tensor transport, the off-policy
correction, the trainer backend), each with the reason for its choice, and returns a `RunPlan`: `run.json`
and the run log show it once, and the builders take its sections (`RunPlan.trainer`, `RunPlan.engine`).
The rules themselves live beside what they decide (`runtime`, `memory`, `trainer.kernels`,
`engines.launch.resolve`, `engines.remote.ipc`); this package is their one caller.
"""

from lora_rl_core.plan.make import make_plan
from lora_rl_core.plan.record import Choice, EnginePlan, RunPlan

__all__ = ["Choice", "EnginePlan", "RunPlan", "make_plan"]
