"""tests.support.processes: tests' processes end with their group, and a process left behind is found."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.support import processes

pytestmark = pytest.mark.slow  # starts processes (small ones: a bare python, no imports)

# Prints the pid of a grandchild that sleeps in a session of its own (as Prefect starts flow-run processes),
# then sleeps; SIGTERM is ignored by both, so only SIGKILL ends them.
NESTED = """
import signal, subprocess, sys, time
stubborn = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"
signal.signal(signal.SIGTERM, signal.SIG_IGN)
child = subprocess.Popen([sys.executable, "-c", stubborn], start_new_session=True)
print(child.pid, flush=True)
time.sleep(600)
"""

# Starts a grandchild that outlives it (an orphan, re-parented to init), prints its pid, exits.
ORPHAN = """
import subprocess, sys
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True,
                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
print(child.pid, flush=True)
"""


def _alive(pid: int) -> bool:
    proc = processes.process_table().get(pid)
    return proc is not None and proc.alive


def test_stop_ends_descendants_in_other_sessions_and_escalates_to_sigkill():
    proc = processes.popen([sys.executable, "-c", NESTED], stdout=subprocess.PIPE, text=True)
    grandchild = int(proc.stdout.readline())
    assert _alive(grandchild) and os.getpgid(grandchild) != os.getpgid(proc.pid)
    start = time.monotonic()
    assert processes.stop(proc, grace_s=0.5) == -signal.SIGKILL
    assert time.monotonic() - start < 5
    proc.stdout.close()
    deadline = time.monotonic() + 5
    while _alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(grandchild)


def test_an_orphan_is_found_and_ended():
    check = processes.LeakCheck()
    check.accept(lambda: True)  # what already runs (a session fixture's server, say) is not this test's
    out = processes.run([sys.executable, "-c", ORPHAN], timeout=30, capture_output=True, text=True)
    orphan = int(out.stdout)
    try:
        strays = check.leftovers(wait_s=0)
        assert [p.pid for p in strays] == [orphan]  # re-parented to init, in a group of its own: by its marker
        assert strays[0].ppid != os.getpid()
    finally:
        check.end(check.leftovers(wait_s=0))
    assert not _alive(orphan)
    assert check.leftovers(wait_s=0) == []


def test_run_ends_the_group_when_the_command_times_out():
    check = processes.LeakCheck()
    check.accept(lambda: True)
    with pytest.raises(subprocess.TimeoutExpired):
        processes.run([sys.executable, "-c", "import time; time.sleep(600)"], timeout=0.5)
    assert check.leftovers(wait_s=0) == []
