"""Nothing `lora-rl` starts outlives it, even when it is SIGKILLed (what the OOM killer sends).

SIGINT, SIGTERM and SIGHUP end in an orderly stop (`cli.shutdown`); SIGKILL leaves the process no time, and
what it started is re-parented to init. Measured with `lora-rl train` SIGKILLed mid-run on a 2-core CPU: the
trainer workers, the math verifier's worker and multiprocessing's resource tracker end within a second (their
pipe to the parent closes), and so do Ray's GCS server and raylet (Ray starts them with PR_SET_PDEATHSIG) and
its workers; but Prefect's temporary API server ran on (Prefect has no parent-death hook), and so did Ray's
dashboard and runtime-env agents (they see the raylet die, then try for 60 s to report it to the dead GCS).
A launched SGLang server would run on too, holding its GPU.

`watch()` (train, eval and serve call it once their inputs are checked, before they start anything) marks
this process's environment with `LORA_RL_OWNER=<random token>`, which every process started afterwards
inherits however deep (trainer workers, Prefect's server, SGLang and its children, Ray's processes), and
starts the reaper: this file run as a stdlib-only script (`python -I -S`) in a session of its own, so that
neither a terminal's Ctrl-C nor a signal to lora-rl's process group reaches it. It polls its parent every
`POLL_S` seconds; once lora-rl is gone (exited or killed) it gives the processes whose environment carries
the token `GRACE_S` to end by themselves (multiprocessing's resource tracker then unlinks the semaphores
the dead process left, idle workers see their pipe close), SIGKILLs the rest, scanning until nothing
carrying the token is left, and exits. After an orderly exit there is nothing left to find.
PR_SET_PDEATHSIG alone would not do: it reaches direct children only, fires when the creating *thread*
ends (Prefect starts its server from whichever thread first needs it), and Prefect's server and Ray's
agents are started by code that is not ours.

Linux only (`/proc/<pid>/environ`); elsewhere `watch()` does nothing.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

OWNER_ENV = "LORA_RL_OWNER"  # environment variable: the token of the lora-rl process that started it
POLL_S = 0.2  # how often the reaper checks that lora-rl is still there, seconds
GRACE_S = 1.0  # how long the processes lora-rl started may take to end by themselves before SIGKILL, seconds
SWEEP_LIMIT_S = 10.0  # the reaper gives up scanning after this long
_QUIET_SCANS = 3  # scans in a row that find nothing before the reaper exits (catches processes still starting)

_reaper: subprocess.Popen[bytes] | None = None
_enabled = False


@contextmanager
def enabled() -> Iterator[None]:
    """Within the block, `watch()` starts a reaper: the CLI's entry point runs its command so (`cli.main.main`);
    a command run by another program in its own process (a test's `CliRunner`, or `main()` called by a test
    that then goes on) starts none after the block that would outlive the command's call."""
    global _enabled
    _enabled = True
    try:
        yield
    finally:
        _enabled = False


def watch() -> int | None:
    """Start the reaper of this process (idempotent), and wait until it ignores signals: once this process is
    gone, whatever it started goes too.

    Returns:
        The reaper's pid; None where there is no `/proc`, or outside `enabled()` (no reaper).
    """
    global _reaper
    if _reaper is not None:
        return _reaper.pid
    if not _enabled or not os.path.isdir("/proc/self"):
        return None
    token = secrets.token_hex(16)
    os.environ[OWNER_ENV] = token  # before anything starts: every process started from now on inherits it
    _reaper = subprocess.Popen(
        [sys.executable, "-I", "-S", os.path.abspath(__file__), str(os.getpid()), token],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    assert _reaper.stdout is not None
    _reaper.stdout.readline()  # "ready": its signal handlers are set (an empty line: it could not start)
    _reaper.stdout.close()
    return _reaper.pid


def marked(token: str) -> list[int]:
    """Live processes (this one aside) whose environment carries `LORA_RL_OWNER=token`."""
    needle, me, found = f"{OWNER_ENV}={token}".encode(), os.getpid(), []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == me:
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:  # empty for a zombie: it has ended
                environ = f.read()
        except OSError:  # gone meanwhile, or another user's
            continue
        if needle in environ.split(b"\0"):
            found.append(int(name))
    return found


def sweep(token: str) -> int:
    """SIGKILL every process that carries `token` until `_QUIET_SCANS` scans in a row find none (or
    `SWEEP_LIMIT_S` passes); how many were killed."""
    killed, quiet, deadline = 0, 0, time.monotonic() + SWEEP_LIMIT_S
    while quiet < _QUIET_SCANS and time.monotonic() < deadline:
        pids = marked(token)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                killed += 1
            except (ProcessLookupError, PermissionError):
                pass
        quiet = 0 if pids else quiet + 1
        time.sleep(0.05)
    return killed


def main(argv: list[str]) -> None:
    """The reaper: wait for the owner (`argv[1]`, its parent) to go, then sweep `argv[2]`'s processes."""
    owner, token = int(argv[1]), argv[2]
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGPIPE):  # it ends after its owner
        signal.signal(sig, signal.SIG_IGN)
    try:
        os.write(1, b"ready\n")  # `watch()` waits for this line
        os.close(1)
    except OSError:  # the owner is gone already: sweep at once
        pass
    while os.getppid() == owner:
        time.sleep(POLL_S)
    deadline = time.monotonic() + GRACE_S
    while marked(token) and time.monotonic() < deadline:
        time.sleep(0.05)
    sweep(token)


if __name__ == "__main__":
    main(sys.argv)
