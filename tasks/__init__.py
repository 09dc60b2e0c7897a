"""Prefect tasks: thin wrappers over `lora_rl_core.run` (retries and caching live here); the runs open in this
process are the library's (`lora_rl_core.run.components.get_run`)."""
