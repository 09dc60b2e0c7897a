"""A trainer worker whose parent drops a shared-memory handover mid-handshake (a SIGTERM while the run's process
receives a step's tensors) prints nothing: multiprocessing's resource sharer reports the dropped connection
through `sys.excepthook`, which a worker sets to `workers._parent_gone_quietly`. Seen once in a full suite as a
`[rank0]: Traceback ... ConnectionResetError` after `lora-rl: interrupted by SIGTERM`
(`test_cli_signals.py`, kill-TERM)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # a Python subprocess

REPO = Path(__file__).resolve().parents[2]

# The sharer's side of a handover: a file descriptor offered for sending (`DupFd`, as a tensor's shared memory is
# offered when a worker replies), and a peer that connects and goes away before the handshake ends.
HANDOVER = """
import os, socket, sys, time
from multiprocessing import resource_sharer
from lora_rl_core.trainer import workers
if sys.argv[1] == "worker":
    sys.excepthook = workers._parent_gone_quietly
read_fd, _ = os.pipe()
address, _ = resource_sharer.DupFd(read_fd)._id
peer = socket.socket(socket.AF_UNIX)
peer.connect(address)
peer.close()
time.sleep(0.5)  # the sharer's thread meets the closed connection
if sys.argv[1] == "worker":
    sys.excepthook(ValueError, ValueError("not a connection error"), None)  # anything else still shows
"""


@pytest.mark.parametrize("hook", ["default", "worker"])
def test_a_dropped_handover_is_silent_in_a_worker_and_only_there(hook: str) -> None:
    run = subprocess.run(
        [sys.executable, "-c", HANDOVER, hook], cwd=REPO, capture_output=True, text=True, timeout=60, check=True
    )
    if hook == "default":  # what the log showed before
        assert "Traceback" in run.stderr and ("BrokenPipeError" in run.stderr or "ConnectionResetError" in run.stderr)
    else:
        assert "Error" not in run.stderr.replace("ValueError: not a connection error", "")
        assert "ValueError: not a connection error" in run.stderr
