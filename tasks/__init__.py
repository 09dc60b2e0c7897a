"""Prefect tasks: thin wrappers over `lora_rl_core.run` (retries and caching live here), and the registry of
the runs open in this process (`tasks.registry`)."""
