"""`engine.launch` settings that start the look-alike SGLang server (`lora_rl_testing/fake_sglang`, which
stands in for `python -m sglang.launch_server`) instead of a real one: for tests of the launcher and of runs
that launch SGLang."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from lora_rl_core.distributed import free_port

REPO = Path(__file__).resolve().parents[1]
FAKE_SGLANG = REPO / "lora_rl_testing" / "fake_sglang"


def fake_launch(**overrides: Any) -> dict[str, Any]:
    """An `engine.launch` section: this interpreter, the stand-in package first on `PYTHONPATH`, a free
    port, a 120 s start-up limit; `overrides` replace or add keys (e.g. `extra_args`, `port`)."""
    return {
        "enabled": True,
        "python": sys.executable,
        "env": {"PYTHONPATH": f"{FAKE_SGLANG}{os.pathsep}{REPO}"},
        "port": free_port(),
        "startup_timeout_s": 120,
        **overrides,
    }
