"""A stand-in `sglang` package for tests: `python -m sglang.launch_server` starts the fake SGLang server
(`tests.support.sglang_fake`) instead of SGLang. Put `tests/support/fake_sglang` first on PYTHONPATH."""
