"""`lora-rl` turns user errors into a short message on stderr and exit code 2, never a traceback.

A bad config, store, data, reward or model is one `lora-rl: error:` line; a bad command line (an unknown
option or command, a missing option, a bad value) is click's usage error: `Usage: ...`, `Try ... --help`,
`Error: ...`. Each case runs the console entry point `cli.main.main` in this process (stderr captured at
the file descriptor, so C-level and warning output counts too); a few run the real command in a
subprocess, so a fresh interpreter's start-up, imports, exception hook and exit add nothing either.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest

from cli import shutdown
from lora_rl_core.errors import LoraRLError
from tests.support import processes

ROOT = Path(__file__).resolve().parents[2]

CASES = {
    "unknown-key": ("lora:\n  rnak: 8\n", "lora.rnak"),
    "missing-data": ("data:\n  source: mawps\n  train_path: {tmp}/missing.jsonl\n", "{tmp}/missing.jsonl"),
    "bad-reward": ("reward:\n  functions:\n    - name: no_such_module:fn\n", "no_such_module"),
    "unknown-model": ("model:\n  name_or_path: nobody/no-such-model\n", "nobody/no-such-model"),
}
SUBPROCESS_CASE = "unknown-model"  # the one that imports and tries the most before failing


def _write_case(tmp_path: Path, case: str) -> tuple[Path, str, dict[str, str]]:
    text, culprit = (s.format(tmp=tmp_path) for s in CASES[case])
    config = tmp_path / "run.yaml"
    config.write_text(text)
    env = {"HF_HUB_OFFLINE": "1", "LORA_RL_CACHE": str(tmp_path / "cache"), "HF_HOME": str(tmp_path / "hf")}
    return config, culprit, env


def _assert_one_error_line(returncode: object, stderr: str, culprit: str) -> None:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert returncode == 2, stderr[-2000:]
    assert len(lines) == 1, stderr[-2000:]
    assert lines[0].startswith("lora-rl: error: ")
    assert culprit in lines[0]


def _run_main(argv: list[str], env: dict[str, str], monkeypatch, capfd) -> tuple[object, str, str]:
    """Run `cli.main.main` with `argv` in this process: (its exit code, stdout, stderr)."""
    from cli.main import main

    for name, value in env.items():
        monkeypatch.setenv(name, value)
    for name in (
        "PREFECT_LOGGING_LEVEL",
        "PREFECT_SERVER_ANALYTICS_ENABLED",
        "TOKENIZERS_PARALLELISM",
        "OMP_WAIT_POLICY",
    ):
        had = os.environ.get(name)  # main() sets defaults: monkeypatch puts back what this process had
        monkeypatch.setenv(name, had or "")
        if had is None:
            monkeypatch.delenv(name)
    monkeypatch.setattr(sys, "argv", ["lora-rl", *argv])
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)  # typer installs its own
    handlers = {sig: signal.getsignal(sig) for sig in shutdown.SIGNALS}  # main() installs its own
    capfd.readouterr()
    try:
        with pytest.raises(SystemExit) as exit_:  # an exception escaping main() would print a traceback
            main()
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    out, err = capfd.readouterr()
    return exit_.value.code, out, err


@pytest.mark.parametrize("case", [c for c in CASES if c != SUBPROCESS_CASE])
def test_train_user_error_is_one_line(tmp_path, case, monkeypatch, capfd):
    config, culprit, env = _write_case(tmp_path, case)
    code, _, err = _run_main(["train", "-c", str(config)], env, monkeypatch, capfd)
    _assert_one_error_line(code, err, culprit)


@pytest.mark.slow
def test_train_user_error_is_one_line_in_a_real_process(tmp_path):
    config, culprit, env = _write_case(tmp_path, SUBPROCESS_CASE)
    proc = processes.run(
        [sys.executable, "-m", "cli.main", "train", "-c", str(config)],
        cwd=ROOT,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    _assert_one_error_line(proc.returncode, proc.stderr, culprit)


# --------------------------------------------------------------------------- config errors on the command line
NOWHERE = "model.name_or_path=/nonexistent/model"  # should a check regress, the command fails fast, not loads a model
CONFIG_ERRORS = {  # argv (after `lora-rl`), what the one line names; {tmp}: the test's folder
    "missing-file": (["train", "-c", "{tmp}/does-not-exist.yaml"], "config file not found: {tmp}/does-not-exist.yaml"),
    "yaml-syntax": (
        ["train", "-c", "{tmp}/broken.yaml"],
        "config {tmp}/broken.yaml is not valid YAML: line 3, column 10",
    ),
    "unknown-override-key": (["train", "-c", "{tmp}/run.yaml", "no.such.key=1"], "no: unknown key"),
    "bad-override-value": (["train", "-c", "{tmp}/run.yaml", "lora.rank=abc"], "lora.rank"),
    "answer-format": (
        ["train", "-c", "{tmp}/run.yaml", "reward.answer_format=loose"],
        "reward.answer_format: Input should be 'strict' or 'flexible' (got 'loose')",
    ),
    "truncation-type": (
        ["train", "-c", "{tmp}/run.yaml", "algorithm.truncation=drop"],
        "algorithm.truncation: Input tag 'drop' found using 'type' does not match any of the expected tags: "
        "'keep', 'mask', 'overlong-penalty'",
    ),
    "overlong-buffer": (  # a rule across two sections: its own message, not the whole config dumped
        ["train", "-c", "{tmp}/run.yaml", "algorithm.truncation={{type: overlong-penalty, buffer: 99}}"],
        "invalid config {tmp}/run.yaml: algorithm.truncation.buffer is 99 tokens, longer than "
        "rollout.max_new_tokens (48): set a buffer of at most 48",
    ),
    "stop-not-a-string": (["train", "-c", "{tmp}/run.yaml", "rollout.stop=[5]"], "rollout.stop: Value error, each"),
    "train-store-uri": (["train", "-c", "{tmp}/run.yaml", "store.uri=nosuch://x", NOWHERE], "'nosuch://x'"),
    "eval-store-uri": (["eval", "-c", "{tmp}/run.yaml", "store.uri=nosuch://x", NOWHERE], "'nosuch://x'"),
    "serve-store-uri": (["serve", "store.uri=nosuch://x", NOWHERE, "--port", "30999"], "'nosuch://x'"),
}


def _config_error_case(tmp_path: Path, case: str) -> tuple[list[str], str, dict[str, str]]:
    (tmp_path / "run.yaml").write_text("lora:\n  rank: 8\n")
    (tmp_path / "broken.yaml").write_text("lora:\n  rank: 8\n    alpha: 16\n")  # line 3: a mapping in a scalar
    argv, culprit = CONFIG_ERRORS[case]
    env = {"HF_HUB_OFFLINE": "1", "LORA_RL_CACHE": str(tmp_path / "cache"), "HF_HOME": str(tmp_path / "hf")}
    return [a.format(tmp=tmp_path) for a in argv], culprit.format(tmp=tmp_path), env


@pytest.mark.parametrize("case", list(CONFIG_ERRORS))
def test_config_error_is_one_line(tmp_path, case, monkeypatch, capfd):
    argv, culprit, env = _config_error_case(tmp_path, case)
    code, out, err = _run_main(argv, env, monkeypatch, capfd)
    _assert_one_error_line(code, err, culprit)
    assert not out.strip()  # nothing started: no "serving ..." line, no progress bar


def test_a_reward_that_pays_for_the_restated_prompt_is_one_line_before_anything_starts(
    tmp_path, tiny_model_dir, monkeypatch, capfd
):
    (tmp_path / "run.yaml").write_text("lora:\n  rank: 8\n")
    argv = ["train", "-c", str(tmp_path / "run.yaml"), f"model.name_or_path={tiny_model_dir}"]
    argv.append("reward.functions=[{name: math}, {name: tests.integration.rewards:digit_fraction}]")
    env = {"HF_HUB_OFFLINE": "1", "LORA_RL_CACHE": str(tmp_path / "cache"), "HF_HOME": str(tmp_path / "hf")}
    code, out, err = _run_main(argv, env, monkeypatch, capfd)
    _assert_one_error_line(code, err, "reward 'digit_fraction' gives credit to 128 of 128 held-out prompts")
    assert "reward.leak_check=false" in err and not out.strip()


# --------------------------------------------------------------------------- serve on the port of its own SGLang
SGLANG_LAUNCHED = ["engine.type=sglang", "engine.launch.enabled=true", "engine.launch.python=/nonexistent/python"]
PORT_CLASH = (
    "lora-rl serve --port 30000 is the port of the SGLang it launches (engine.launch.port); "
    "pass another --port (e.g. 30001) or set engine.launch.port"
)


@pytest.mark.parametrize(
    ("port_args", "culprit"),
    [
        (["--port", "30000"], PORT_CLASH),
        ([], PORT_CLASH),  # serve's default port is SGLang's default too
        (["--port", "30001"], "'nosuch://x'"),  # another port passes, and the store fails next
    ],
    ids=["same-port", "default-port", "other-port"],
)
def test_serve_refuses_the_port_of_the_sglang_it_launches(tmp_path, port_args, culprit, monkeypatch, capfd):
    # Before the store is built and before anything starts: a launch would fail on the missing interpreter.
    argv = ["serve", *SGLANG_LAUNCHED, "store.uri=nosuch://x", NOWHERE, *port_args]
    env = {"HF_HUB_OFFLINE": "1", "LORA_RL_CACHE": str(tmp_path / "cache"), "HF_HOME": str(tmp_path / "hf")}
    code, out, err = _run_main(argv, env, monkeypatch, capfd)
    _assert_one_error_line(code, err, culprit)
    assert not out.strip()  # no "serving ..." line: nothing started


# --------------------------------------------------------------------------- usage errors: click's, exit 2
USAGE_ERRORS = {  # argv (after `lora-rl`), what the `Error:` line names
    "train-unknown-option": (["train", "--bogus"], "No such option: --bogus"),
    "eval-unknown-option": (["eval", "--bogus"], "No such option: --bogus"),
    "serve-unknown-option": (["serve", "--model", "x"], "No such option: --model"),
    "serve-port-too-big": (["serve", "--port", "99999", NOWHERE], "Invalid value for '--port'"),
    "serve-port-not-a-number": (["serve", "--port", "abc", NOWHERE], "Invalid value for '--port'"),
    "subscribe-missing-option": (["subscribe", "--run", "r", "--engine", "http://127.0.0.1:9"], "'--store'"),
    "train-missing-config": (["train"], "'--config'"),
    "unknown-command": (["nosuchcommand"], "No such command 'nosuchcommand'"),
    "adapters-unknown-option": (["adapters", "list", "--bogus"], "No such option: --bogus"),
}


def _assert_usage_error(returncode: object, stdout: str, stderr: str, culprit: str) -> None:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert returncode == 2, stderr[-2000:]
    assert "Traceback" not in stdout + stderr, stderr[-2000:]
    assert not stdout.strip(), stdout[-2000:]  # nothing ran
    assert len(lines) <= 4, stderr[-2000:]  # Usage: ..., Try '... --help' for help., Error: ...
    assert lines[0].startswith("Usage: ") and "[OPTIONS]" in lines[0], stderr[-2000:]  # `python -m cli.main` too
    assert lines[-1].startswith("Error: ") and culprit in lines[-1], stderr[-2000:]


@pytest.mark.parametrize("case", list(USAGE_ERRORS))
def test_usage_error_is_clicks_short_message(case, monkeypatch, capfd):
    argv, culprit = USAGE_ERRORS[case]
    code, out, err = _run_main(argv, {"HF_HUB_OFFLINE": "1"}, monkeypatch, capfd)
    _assert_usage_error(code, out, err, culprit)


def test_no_arguments_prints_the_help(monkeypatch, capfd):
    code, out, err = _run_main([], {}, monkeypatch, capfd)
    assert code == 2 and "Traceback" not in out + err, err[-2000:]
    assert "Usage: " in out and "train" in out and not err.strip()


@pytest.mark.slow
@pytest.mark.parametrize("case", ["train-unknown-option", "serve-port-too-big"])
def test_usage_error_in_a_real_process(case):
    argv, culprit = USAGE_ERRORS[case]
    proc = processes.run(
        [sys.executable, "-m", "cli.main", *argv],
        cwd=ROOT,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    _assert_usage_error(proc.returncode, proc.stdout, proc.stderr, culprit)


# --------------------------------------------------------------------------- a signal behind another exception
@pytest.mark.parametrize("raised", [ValueError, LoraRLError], ids=["crash", "our-error"])
def test_sigterm_that_prefect_fails_to_handle_still_exits_143(monkeypatch, capfd, raised):
    """SIGTERM while Prefect's task engine sets up a task run: its crash handling raises `ValueError: Task run
    is not set` while handling the `TerminationSignal`, and Prefect never re-sends the signal to our handler
    (seen in CI). The command still ends as an interrupt: the one line and 128 + SIGTERM, no traceback."""
    from prefect.exceptions import TerminationSignal

    import cli.main

    def crashing_app(**_: object) -> None:
        try:
            raise TerminationSignal(signal.SIGTERM)
        except TerminationSignal:
            raise raised("Task run is not set")  # noqa: B904 (Prefect raises it just so)

    monkeypatch.setattr(cli.main, "app", crashing_app)
    monkeypatch.setattr(shutdown, "stop_prefect_servers", lambda: 0)  # none of this test's: others' stay up
    monkeypatch.setattr(shutdown, "_state", shutdown._State())  # what this test's interrupt records goes with it
    code, out, err = _run_main(["train"], {}, monkeypatch, capfd)
    assert code == 128 + signal.SIGTERM, err[-2000:]
    assert err.strip().splitlines() == ["lora-rl: interrupted by SIGTERM"], err[-2000:]
    assert shutdown.signal_of(ValueError("no signal behind it")) == signal.SIGTERM  # received: the state says so
    shutdown._state.signum = None
    assert shutdown.signal_of(ValueError("no signal behind it")) is None
