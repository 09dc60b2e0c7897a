"""A stand-in `sglang` package for tests: `python -m sglang.launch_server` starts the fake SGLang server
(`lora_rl_testing.sglang_fake`) instead of SGLang. Put `lora_rl_testing/fake_sglang` first on PYTHONPATH."""
