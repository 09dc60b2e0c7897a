"""STYLE rule 3: importing any `lora_rl_core` module never imports prefect."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.support import processes

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import importlib, pkgutil, sys
import lora_rl_core
names = [m.name for m in pkgutil.walk_packages(lora_rl_core.__path__, "lora_rl_core.")]
for name in names:
    importlib.import_module(name)
assert len(names) > 10, names
leaked = sorted(m for m in sys.modules if m == "prefect" or m.startswith("prefect."))
assert not leaked, leaked
print(len(names))
"""


@pytest.mark.slow  # a fresh interpreter
def test_core_never_imports_prefect():
    proc = processes.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert int(proc.stdout.split()[-1]) > 10
