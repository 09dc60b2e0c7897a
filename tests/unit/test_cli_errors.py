"""`lora-rl train` turns user errors into one `lora-rl: error:` line on stderr and exit code 2.

Each case runs the console entry point `cli.main.main` in this process (stderr captured at the file
descriptor, so C-level and warning output counts too); one case runs the real command in a subprocess,
so a fresh interpreter's start-up, imports and exit add nothing to stderr either.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest

from cli import shutdown
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


def _assert_one_error_line(returncode: int, stderr: str, culprit: str) -> None:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert returncode == 2, stderr[-2000:]
    assert len(lines) == 1, stderr[-2000:]
    assert lines[0].startswith("lora-rl: error: ")
    assert culprit in lines[0]


@pytest.mark.parametrize("case", [c for c in CASES if c != SUBPROCESS_CASE])
def test_train_user_error_is_one_line(tmp_path, case, monkeypatch, capfd):
    from cli.main import main

    config, culprit, env = _write_case(tmp_path, case)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    for name in ("PREFECT_LOGGING_LEVEL", "PREFECT_SERVER_ANALYTICS_ENABLED", "TOKENIZERS_PARALLELISM"):
        value = os.environ.get(name)  # main() sets defaults: monkeypatch puts back what this process had
        monkeypatch.setenv(name, value or "")
        if value is None:
            monkeypatch.delenv(name)
    monkeypatch.setattr(sys, "argv", ["lora-rl", "train", "-c", str(config)])
    handlers = {sig: signal.getsignal(sig) for sig in shutdown.SIGNALS}  # main() installs its own
    capfd.readouterr()
    try:
        with pytest.raises(SystemExit) as exit_:
            main()
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    _assert_one_error_line(exit_.value.code, capfd.readouterr().err, culprit)


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
