"""Harness shared by the tests and the benchmarks, outside both and outside the library (`lora_rl_core` never
imports it): random LoRA adapters (`adapters`), servers in a thread (`servers`), the hot-swap stress run and its
report (`stress`, `stress_report`), an SGLang look-alike server (`sglang_fake`) and a launchable stand-in for
`sglang.launch_server` (`fake_sglang/`, `fake_launch`). Pytest's own plumbing (the process leak check) stays in
`tests/support`.
"""
