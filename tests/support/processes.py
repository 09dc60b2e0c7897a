"""Processes that tests start, and the check that none outlives its test.

Starting: `popen` runs a command in a session (process group) of its own and remembers the group; `stop`
ends it: the group and every descendant seen before the signal, wherever it moved (Prefect starts flow-run
processes in new sessions, and a killed parent's children are re-parented), with SIGTERM, then SIGKILL for
what is left after a grace period. `running` is the context-manager form, for a `with` that stops the
process pass or fail; `run` is `subprocess.run` with the same clean-up on timeout or error.

Checking: `LeakCheck` finds, after each test, every live descendant of pytest, every live member of a group
that `popen` started, and every orphan (a process whose parent died is re-parented to init, and escapes
the descendant tree) that carries this pytest run's `MARKER` in its environment (set by tests/conftest.py,
inherited by every process started with `os.environ`), that no fixture of a wider scope owns.
`LeakCheckPlugin` (registered by tests/conftest.py) ends them (group SIGTERM, then SIGKILL) and fails the
test's teardown, naming them, and checks once more when the session ends.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import Any

import pytest

GRACE_S = 10.0  # SIGTERM to SIGKILL
MARKER = "LORA_RL_TEST_RUN"  # environment variable: the pid of the pytest process whose test started it
_started_groups: set[int] = set()  # process groups that `popen` started; emptied as they end


# ----------------------------------------------------------------------------- the process table
@dataclass(frozen=True)
class Proc:
    """One process, as /proc shows it. `key` (pid, start time) survives pid reuse."""

    pid: int
    ppid: int
    pgid: int
    state: str  # Z: zombie (exited, not yet reaped)
    start: int

    @property
    def key(self) -> tuple[int, int]:
        return (self.pid, self.start)

    @property
    def alive(self) -> bool:
        return self.state not in ("Z", "X")

    def cmdline(self) -> str:
        try:
            with open(f"/proc/{self.pid}/cmdline", "rb") as f:
                return f.read().replace(b"\0", b" ").decode(errors="replace").strip() or "?"
        except OSError:
            return "?"


def pid_alive(pid: int) -> bool:
    """True while `pid` exists and has not exited (a zombie has)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def ended(pid: int, within_s: float = 10.0) -> bool:
    """Wait up to `within_s` seconds for `pid` to end (a SIGKILLed process takes a moment); True once it has."""
    deadline = time.monotonic() + within_s
    while pid_alive(pid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


def process_table() -> dict[int, Proc]:
    """Every process of this machine (Linux /proc; psutil elsewhere)."""
    if not os.path.isdir("/proc/self"):
        return _psutil_table()
    table = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                data = f.read()
        except OSError:  # gone meanwhile
            continue
        fields = data[data.rindex(b")") + 2 :].split()  # after "pid (comm) ": state ppid pgrp ... starttime
        table[int(name)] = Proc(int(name), int(fields[1]), int(fields[2]), fields[0].decode(), int(fields[19]))
    return table


def _psutil_table() -> dict[int, Proc]:
    import psutil

    table = {}
    for p in psutil.process_iter(["pid", "ppid", "status", "create_time"]):
        with suppress(psutil.Error, OSError):
            state = "Z" if p.info["status"] == psutil.STATUS_ZOMBIE else "R"
            table[p.pid] = Proc(p.pid, p.info["ppid"], os.getpgid(p.pid), state, int(p.info["create_time"] * 100))
    return table


def descendants(pid: int, table: dict[int, Proc] | None = None) -> list[Proc]:
    """Live processes below `pid` in the parent tree (not `pid` itself)."""
    table = process_table() if table is None else table
    children: dict[int, list[Proc]] = {}
    for proc in table.values():
        children.setdefault(proc.ppid, []).append(proc)
    found: dict[int, Proc] = {}
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child.pid != pid and child.pid not in found:
                found[child.pid] = child
                todo.append(child.pid)
    return [p for p in found.values() if p.alive]


def group_members(pgid: int, table: dict[int, Proc] | None = None) -> list[Proc]:
    """Live processes of process group `pgid`."""
    table = process_table() if table is None else table
    return [p for p in table.values() if p.pgid == pgid and p.alive]


def describe(procs: Iterable[Proc]) -> str:
    return "; ".join(f"pid {p.pid} (group {p.pgid}): {p.cmdline()[:160]}" for p in procs)


# ----------------------------------------------------------------------------- starting and stopping
def popen(args: Sequence[str], **kwargs: Any) -> subprocess.Popen:
    """`subprocess.Popen(args, **kwargs)` in a new session (its own process group), remembered for the check."""
    if kwargs.pop("start_new_session", True) is not True:
        raise ValueError("tests start processes in their own process group")
    proc = subprocess.Popen(args, start_new_session=True, **kwargs)
    _started_groups.add(proc.pid)
    return proc


def stop(proc: subprocess.Popen, sig: int = signal.SIGTERM, grace_s: float = GRACE_S) -> int:
    """End `proc`, its process group and its descendants in other groups: `sig`, then SIGKILL after `grace_s`.

    Returns:
        The exit status of `proc` (negative: the signal that ended it).
    """
    table = process_table()
    tree = [p for p in table.values() if p.pid == proc.pid and p.alive] + descendants(proc.pid, table)
    end_processes(tree, groups={proc.pid} | {p.pgid for p in tree}, sig=sig, grace_s=grace_s, leader=proc)
    return proc.wait(timeout=GRACE_S)


@contextmanager
def running(args: Sequence[str], *, grace_s: float = GRACE_S, **kwargs: Any) -> Iterator[subprocess.Popen]:
    """`popen(args, **kwargs)`, stopped (`stop`) when the block ends, pass or fail."""
    proc = popen(args, **kwargs)
    try:
        yield proc
    finally:
        stop(proc, grace_s=grace_s)


def run(args: Sequence[str], *, timeout: float, **kwargs: Any) -> subprocess.CompletedProcess:
    """`subprocess.run(args, timeout=timeout, **kwargs)` in its own process group, which is ended whatever
    happens (a timeout raises `subprocess.TimeoutExpired` as usual)."""
    capture = kwargs.pop("capture_output", False)
    if capture:
        kwargs.update(stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc = popen(args, **kwargs)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    finally:
        stop(proc)
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def end_processes(
    procs: Sequence[Proc],
    *,
    groups: Iterable[int] = (),
    sig: int = signal.SIGTERM,
    grace_s: float = GRACE_S,
    leader: subprocess.Popen | None = None,
) -> None:
    """Send `sig` to `groups` and `procs`, wait up to `grace_s` for all of them (and every member of the
    groups) to end, then SIGKILL what is left. `leader` is reaped through its Popen (keeps its exit status)."""
    groups = {g for g in groups if g > 1 and g != os.getpgrp()}
    keys = {p.key for p in procs}

    def left() -> list[Proc]:
        if leader is not None:
            leader.poll()  # reap it, recording its status
        table = process_table()
        return [p for p in table.values() if p.alive and (p.key in keys or p.pgid in groups)]

    for signum, wait_s in ((sig, grace_s), (signal.SIGKILL, 10.0)):
        targets = left()
        if not targets:
            break
        for pgid in groups:
            with suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, signum)
        for p in targets:
            with suppress(ProcessLookupError, PermissionError):
                os.kill(p.pid, signum)
        deadline = time.monotonic() + wait_s
        while left() and time.monotonic() < deadline:
            time.sleep(0.05)
    _started_groups.difference_update(g for g in groups if not group_members(g))


# ----------------------------------------------------------------------------- the check
def mark_environment() -> None:
    """Set `MARKER` to this process's pid, so that the processes tests start can be told from others'."""
    os.environ[MARKER] = str(os.getpid())


def orphans(table: dict[int, Proc] | None = None, run: int | None = None) -> list[Proc]:
    """Live processes re-parented to init (or whose parent is not visible) that carry `MARKER=run` (default:
    this process) in their environment: orphans of this test run."""
    table = process_table() if table is None else table
    needle = f"{MARKER}={os.getpid() if run is None else run}".encode()
    found = []
    for p in table.values():
        if p.alive and p.pid != 1 and (p.ppid <= 1 or p.ppid not in table):
            try:
                with open(f"/proc/{p.pid}/environ", "rb") as f:
                    environ = f.read().split(b"\0")
            except OSError:  # gone, another user's, or no /proc
                continue
            if needle in environ:
                found.append(p)
    return found


def _expected(proc: Proc, me: int) -> bool:
    """multiprocessing's resource tracker: started on first use of spawn, lives as long as pytest."""
    return proc.ppid == me and "multiprocessing.resource_tracker" in proc.cmdline()


class LeakCheck:
    """Processes that outlive the test (or the fixture) that started them.

    `accept(owner)` after a fixture of a wider scope than a test is set up: what it started belongs to it
    until `owner()` says it was torn down. `leftovers()` after a test's teardown: live descendants and
    members of `popen` groups that no live owner accounts for, given `wait_s` to end on their own.
    """

    def __init__(self) -> None:
        self.me = os.getpid()
        self.owned: dict[tuple[int, int], Any] = {}  # process key -> callable, True while its owner is set up

    def _live(self) -> list[Proc]:
        table = process_table()
        found = {p.key: p for p in [*descendants(self.me, table), *orphans(table, self.me)]}
        for pgid in list(_started_groups):
            members = group_members(pgid, table)
            if not members:
                _started_groups.discard(pgid)
            found.update((p.key, p) for p in members)
        return [p for p in found.values() if not _expected(p, self.me)]

    def accept(self, owner_alive: Any) -> None:
        for proc in self._live():
            self.owned.setdefault(proc.key, owner_alive)

    def leftovers(self, wait_s: float = 5.0) -> list[Proc]:
        deadline = time.monotonic() + wait_s
        while True:
            live = self._live()
            keys = {p.key for p in live}
            self.owned = {k: owner for k, owner in self.owned.items() if k in keys and owner()}
            strays = [p for p in live if p.key not in self.owned]
            if not strays or time.monotonic() >= deadline:
                return strays
            time.sleep(0.1)

    def end(self, strays: Sequence[Proc]) -> None:
        """Stop `strays`, their groups too when they lead one (group SIGTERM, SIGKILL after 5 s)."""
        groups = {p.pgid for p in strays if p.pgid == p.pid or p.pgid in _started_groups}
        end_processes(strays, groups=groups, grace_s=5.0)


class LeakCheckPlugin:
    """pytest hooks around `LeakCheck`: processes are marked with this run, fixtures wider than a test own
    what they start until their teardown, a test's teardown fails when the test left a process running."""

    def __init__(self) -> None:
        self.check = LeakCheck()

    def pytest_configure(self, config: pytest.Config) -> None:
        mark_environment()

    @pytest.hookimpl(wrapper=True)
    def pytest_fixture_setup(self, fixturedef: pytest.FixtureDef, request: pytest.FixtureRequest) -> Any:
        result = yield
        if fixturedef.scope != "function":
            self.check.accept(lambda: fixturedef.cached_result is not None)
        return result

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_teardown(self, item: pytest.Item, nextitem: pytest.Item | None) -> Any:
        try:
            result = yield
        finally:
            strays = self.check.leftovers()
            described = describe(strays)
            if strays:
                self.check.end(strays)
        if strays:
            pytest.fail(f"{item.nodeid} left processes running (now ended): {described}", pytrace=False)
        return result

    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        strays = self.check.leftovers()
        if strays:
            message = f"processes left running after the session (now ended): {describe(strays)}"
            self.check.end(strays)
            reporter = session.config.pluginmanager.get_plugin("terminalreporter")
            if reporter is not None:
                reporter.write_line(f"ERROR: {message}", red=True)
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
