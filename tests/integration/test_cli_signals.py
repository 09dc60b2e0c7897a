"""SIGTERM and SIGINT to `lora-rl train`, `serve` and `subscribe`: an orderly stop; SIGKILL to `train` and
`serve`: nothing they started survives them.

Each command runs as a real process in a session of its own (`tests.support.processes`). Once it is busy
(train: the line of step 1 is printed, so the trainer workers have trained and everything is running;
serve: /health answers; subscribe: the engine holds the newest version), it gets the signal: `kill -TERM
PID` (to the process alone, as a process manager sends it) or a terminal's Ctrl-C (SIGINT to the whole
process group). It must exit with 128 + the signal number, print exactly one `lora-rl:` line (the last
line of stderr, no traceback), and leave no process behind: not its trainer workers, not Prefect's
ephemeral server (which runs in a session of its own), nothing else it started.

SIGKILL (what the OOM killer sends) leaves the command no time: its reaper (`cli.reaper`) ends what it
started. Within a few seconds none of the processes that ran just before the kill may be alive, and no
orphan of this test run either (a process started meanwhile). Each test waits for an explicit sign of
readiness, never a fixed sleep, and its deadlines are minutes, so a loaded machine only makes it slower.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from lora_rl_core.engines import EmbeddedEngine
from lora_rl_core.store import AdapterStore
from lora_rl_testing.adapters import random_lora_factory
from lora_rl_testing.fake_launch import fake_launch
from lora_rl_testing.servers import serve_in_thread
from tests.integration.tiny_run import write_tiny_config
from tests.support import processes

pytestmark = pytest.mark.slow  # `lora-rl` processes, Prefect's ephemeral server, trainer workers

REPO = Path(__file__).resolve().parents[2]
LORA_RL = str(Path(sys.executable).with_name("lora-rl"))
PREFECT_SERVER = "prefect.server.api.server:create_app"  # in the command line of Prefect's ephemeral server
REAPER = "cli/reaper.py"  # in the command line of the reaper (cli.reaper)
EXIT_S = 180  # the most an orderly stop may take (it takes seconds; a loaded 2-core machine is slow)
GONE_S = 30  # after the exit status: the most what the command started may take to end
KILLED_S = 5  # after a SIGKILL: the most what the command started may take to end (the reaper grants 1 s)


@pytest.fixture(scope="module", autouse=True)
def prefect_harness():
    """No Prefect test server: `lora-rl train` starts its own ephemeral one. Overrides the package's harness."""
    yield


@pytest.fixture()
def env(tmp_path) -> dict[str, str]:
    """No PREFECT_API_URL (so train starts an ephemeral server), a fresh PREFECT_HOME, offline HF."""
    env = {
        **os.environ,
        "PREFECT_HOME": str(tmp_path / "prefect-home"),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "HF_HUB_OFFLINE": "1",
        "LORA_RL_CACHE": str(tmp_path / "cache"),
        "PYTHONPATH": os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]),  # the reward
    }
    env.pop("PREFECT_API_URL", None)
    return env


class Command:
    """A `lora-rl` process with stdout and stderr in files."""

    def __init__(self, args: list[str], env: dict[str, str], tmp_path: Path) -> None:
        self.out, self.err = tmp_path / "stdout.txt", tmp_path / "stderr.txt"
        with self.out.open("w") as out, self.err.open("w") as err:
            self.proc = processes.popen([LORA_RL, *args], cwd=REPO, env=env, stdout=out, stderr=err)

    def wait_until(self, ready: Callable[[], bool], what: str, seconds: float = 600) -> None:
        deadline = time.monotonic() + seconds
        while not ready():
            assert self.proc.poll() is None, f"exited with {self.proc.returncode} before {what}:\n{self.stderr()}"
            assert time.monotonic() < deadline, f"timed out after {seconds} s waiting for {what}:\n{self.stderr()}"
            time.sleep(0.2)

    def tree(self) -> list[processes.Proc]:
        """The process and everything it started, wherever it runs."""
        table = processes.process_table()
        return [table[self.proc.pid], *processes.descendants(self.proc.pid, table)]

    def printed(self, prefix: str) -> Callable[[], bool]:
        """Readiness: a line of stdout starts with `prefix`."""
        return lambda: any(line.startswith(prefix) for line in self.out.read_text(errors="replace").splitlines())

    def interrupt(self, sig: int, *, group: bool) -> list[processes.Proc]:
        """Send `sig` (to the process, or its whole group as a terminal's Ctrl-C does) and wait for the exit;
        the processes that ran just before."""
        tree = self.tree()
        (os.killpg if group else os.kill)(self.proc.pid, sig)
        try:
            self.proc.wait(timeout=EXIT_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"still running {EXIT_S} s after {signal.Signals(sig).name}:\n{self.stderr()}")
        return tree

    def stderr(self) -> str:
        return self.err.read_text(errors="replace")[-4000:]


@pytest.fixture()
def command(env, tmp_path) -> Iterator[Callable[..., Command]]:
    started: list[Command] = []

    def start(*args: str) -> Command:
        started.append(Command(list(args), env, tmp_path))
        return started[-1]

    yield start
    for cmd in started:  # pass or fail: the process, its group and its descendants end with the test
        processes.stop(cmd.proc)


def assert_stopped_in_order(cmd: Command, tree: list[processes.Proc], sig: int, stopped: str) -> None:
    name = signal.Signals(sig).name
    err = cmd.err.read_text(errors="replace")
    assert cmd.proc.returncode == 128 + sig, err[-4000:]
    ours = [line for line in err.splitlines() if line.startswith("lora-rl:")]
    assert ours == [f"lora-rl: interrupted by {name}; stopped {stopped}"], err[-4000:]
    assert err.rstrip().splitlines()[-1] == ours[0], err[-4000:]  # nothing after it (no late log, no warning)
    assert "Traceback" not in err, err[-4000:]
    deadline = time.monotonic() + GONE_S  # the exit status is in; give a child's own exit a moment
    while (left := [p for p in tree if _alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, f"left running after {name}: {processes.describe(left)}"
    assert not processes.group_members(cmd.proc.pid), processes.describe(processes.group_members(cmd.proc.pid))


def _alive(proc: processes.Proc) -> bool:
    now = processes.process_table().get(proc.pid)
    return now is not None and now.key == proc.key and now.alive


@pytest.mark.parametrize(
    ("sig", "group"), [(signal.SIGTERM, False), (signal.SIGINT, True)], ids=["kill-TERM", "ctrl-C"]
)
def test_train_stops_trainer_workers_and_prefect_server(command, tiny_model_dir, tmp_path, sig, group):
    config = write_tiny_config(
        tmp_path,
        tiny_model_dir,
        "sig",
        run={"eval_before_after": False},
        trainer={
            "steps": 1000,
            "backend": {"type": "local", "world_size": 2},
        },  # never finishes: interrupted while training
    )
    cmd = command("train", "-c", str(config), "--run-id", "sig")
    cmd.wait_until(cmd.printed("step 1/"), "the line of step 1")
    commands = [p.cmdline() for p in cmd.tree()]
    assert sum("spawn_main" in c for c in commands) == 2, commands  # the trainer workers
    assert sum(PREFECT_SERVER in c for c in commands) == 1, commands  # the ephemeral Prefect server
    assert sum(REAPER in c for c in commands) == 1, commands
    tree = cmd.interrupt(sig, group=group)
    assert_stopped_in_order(cmd, tree, sig, "trainer workers, engine and Prefect server")


def serving(command: Callable[..., Command], model_dir: Path, tmp_path: Path) -> Command:
    """`lora-rl serve` of the tiny model on a free port of 127.0.0.1, once /health answers."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    model = [f"model.name_or_path={model_dir}", "model.dtype=float32", f"store.uri=file://{tmp_path}/store"]
    cmd = command("serve", *model, "--host", "127.0.0.1", "--port", str(port))

    def healthy() -> bool:
        try:
            return httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    cmd.wait_until(healthy, "the server to answer /health")
    return cmd


def test_serve_stops_on_ctrl_c(command, tiny_model_dir, tmp_path):
    cmd = serving(command, tiny_model_dir, tmp_path)
    tree = cmd.interrupt(signal.SIGINT, group=True)
    assert_stopped_in_order(cmd, tree, signal.SIGINT, "the HTTP server and the engine")


def test_subscribe_stops_on_sigterm(command, tiny_model_dir, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    make_adapter = random_lora_factory(model)
    store = AdapterStore(f"file://{tmp_path / 'store'}")
    for version in (0, 1):
        tensors, config = make_adapter(version)
        store.publish("sub", version, tensors=tensors, adapter_config=config, step=version, base_model="tiny")
    with EmbeddedEngine(model, AutoTokenizer.from_pretrained(tiny_model_dir)) as engine:
        with serve_in_thread(engine, store=store) as url:
            cmd = command("subscribe", "--store", store.uri, "--run", "sub", "--engine", url, "--poll-interval", "0.2")
            cmd.wait_until(lambda: "sub-v000001" in engine.list_adapters(), "version 1 to reach the engine")
            tree = cmd.interrupt(signal.SIGTERM, group=False)
    assert_stopped_in_order(cmd, tree, signal.SIGTERM, "the subscriber and closed its engine connections")


def assert_nothing_survives_sigkill(cmd: Command, expected: dict[str, int]) -> float:
    """SIGKILL the command once the processes named in `expected` (a command-line fragment and how many
    carry it) run; within `KILLED_S` seconds none of the processes that ran just before may be alive, nor
    any orphan of this test run. Returns the seconds the last of them took to end."""
    tree = cmd.tree()
    commands = [p.cmdline() for p in tree]
    for fragment, count in {REAPER: 1, **expected}.items():
        assert sum(fragment in c for c in commands) == count, (fragment, commands)
    os.kill(cmd.proc.pid, signal.SIGKILL)
    cmd.proc.wait(timeout=30)
    start = time.monotonic()
    while (left := [p for p in tree if _alive(p)] + processes.orphans()) and time.monotonic() - start < KILLED_S:
        time.sleep(0.05)
    seconds = time.monotonic() - start
    assert not left, f"alive {KILLED_S} s after SIGKILL: {processes.describe(left)}"
    print(f"the {len(tree) - 1} processes {cmd.proc.args[1]} started ended {seconds:.2f} s after its SIGKILL")
    return seconds


def test_train_sigkilled_leaves_no_process(command, tiny_model_dir, tmp_path):
    """Trainer workers, the math verifier's worker, a launched SGLang (the look-alike, with a child of its own
    as SGLang has) and Prefect's server. Not with a local Ray: Ray listens on every interface (no option binds
    it to 127.0.0.1) and tests bind servers to 127.0.0.1 only; the reaper sweeps Ray's processes by the same
    owner token (measured by hand: gone 1.4-1.5 s after the SIGKILL). The math verifier's worker starts for
    symbolic gold answers only (numbers are compared in process): the data's answers are square roots."""
    rows = [{"prompt": f"What is the square root of {n}?", "answer": f"\\sqrt{{{n}}}"} for n in range(2, 40)]
    for split, part in (("train", rows[:30]), ("test", rows[30:])):
        (tmp_path / f"roots-{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))
    sections: dict[str, Any] = {
        "trainer": {"steps": 1000, "backend": {"type": "local", "world_size": 2}},
        "engine": {"type": "sglang", "sync": "store", "launch": fake_launch()},
        "data": {
            "source": "dataset",
            "train_path": str(tmp_path / "roots-train.jsonl"),
            "test_path": str(tmp_path / "roots-test.jsonl"),
            "eval_size": 4,
        },
        "reward": {"functions": [{"name": "math"}, {"name": "tests.integration.rewards:digit_fraction"}]},
    }
    expected = {"spawn_main": 3, "sglang.launch_server": 1, "time.sleep(600)": 1, PREFECT_SERVER: 1}
    config = write_tiny_config(tmp_path, tiny_model_dir, "kill", run={"eval_before_after": False}, **sections)
    cmd = command("train", "-c", str(config), "--run-id", "kill")
    cmd.wait_until(cmd.printed("step 1/"), "the line of step 1")
    assert_nothing_survives_sigkill(cmd, expected)


def test_serve_sigkilled_leaves_no_process(command, tiny_model_dir, tmp_path):
    assert_nothing_survives_sigkill(serving(command, tiny_model_dir, tmp_path), {})
