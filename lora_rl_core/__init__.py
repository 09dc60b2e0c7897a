"""lora-rl core library: config, models, LoRA, algorithm, engines, store, trainer (no Prefect here).

Importing it leaves the process environment alone; the entry points set what must be set before torch loads
(`OMP_WAIT_POLICY`: `lora_rl_core.runtime`, "OpenMP waiting").
"""
