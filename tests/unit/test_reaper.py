"""cli.reaper: once its owner is gone, SIGKILLed or exited, whatever the owner started goes too, however deep
and in whatever session; processes the owner did not start are left alone."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cli import reaper
from tests.support import processes

pytestmark = pytest.mark.slow  # starts processes (bare pythons)

REPO = Path(__file__).resolve().parents[2]

# Ignores SIGTERM, starts a grandchild in a session of its own that ignores it too, prints the grandchild's pid.
NESTED = """
import signal, subprocess, sys, time
stubborn = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"
signal.signal(signal.SIGTERM, signal.SIG_IGN)
child = subprocess.Popen([sys.executable, "-c", stubborn], start_new_session=True)
print(child.pid, flush=True)
time.sleep(600)
"""

# The owner: starts its reaper, then NESTED; prints the reaper's, the child's and the grandchild's pids;
# then sleeps (argv[1] == "stay") or exits at once, leaving its child behind.
OWNER = f"""
import subprocess, sys, time
sys.path.insert(0, {str(REPO)!r})
from cli import reaper
with reaper.enabled():
    watcher = reaper.watch()
child = subprocess.Popen([sys.executable, "-c", {NESTED!r}], stdout=subprocess.PIPE)
print(watcher, child.pid, child.stdout.readline().decode().strip(), flush=True)
if sys.argv[1] == "stay":
    time.sleep(600)
"""


def _start(mode: str) -> tuple[subprocess.Popen, list[int]]:
    owner = processes.popen([sys.executable, "-c", OWNER, mode], stdout=subprocess.PIPE)
    assert owner.stdout is not None
    pids = [int(p) for p in owner.stdout.readline().split()]
    assert len(pids) == 3 and all(processes.pid_alive(p) for p in pids[:2]), pids
    return owner, pids


def _seconds_until_ended(pids: list[int], within_s: float = 10.0) -> float:
    start = time.monotonic()
    for pid in pids:
        assert processes.ended(pid, within_s - (time.monotonic() - start)), f"pid {pid} still running"
    return time.monotonic() - start


def test_what_a_sigkilled_owner_started_ends_after_the_grace():
    bystander = processes.popen([sys.executable, "-c", "import time; time.sleep(600)"])  # not the owner's
    try:
        owner, (watcher, child, grandchild) = _start("stay")
        owner.send_signal(signal.SIGKILL)
        owner.wait()
        assert _seconds_until_ended([child, grandchild, watcher]) < reaper.GRACE_S + 1.5
        assert processes.pid_alive(bystander.pid)
    finally:
        processes.stop(bystander)


def test_what_an_owner_left_behind_at_exit_ends_too():
    owner, (watcher, child, grandchild) = _start("exit")
    assert owner.wait(timeout=30) == 0
    assert _seconds_until_ended([child, grandchild, watcher]) < reaper.GRACE_S + 1.5


def test_the_reaper_ignores_signals_and_goes_after_its_owner():
    owner, (watcher, child, grandchild) = _start("stay")
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        os.kill(watcher, sig)
    time.sleep(0.5)
    assert processes.pid_alive(watcher)
    owner.send_signal(signal.SIGKILL)
    owner.wait()
    assert _seconds_until_ended([child, grandchild, watcher]) < reaper.GRACE_S + 1.5
