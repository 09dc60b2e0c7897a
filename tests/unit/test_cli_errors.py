"""`lora-rl train` turns user errors into one `lora-rl: error:` line on stderr and exit code 2."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

CASES = {
    "unknown-key": ("lora:\n  rnak: 8\n", "lora.rnak"),
    "missing-data": ("data:\n  source: mawps\n  train_path: {tmp}/missing.jsonl\n", "{tmp}/missing.jsonl"),
    "bad-reward": ("reward:\n  functions:\n    - name: no_such_module:fn\n", "no_such_module"),
    "unknown-model": ("model:\n  name_or_path: nobody/no-such-model\n", "nobody/no-such-model"),
}


@pytest.mark.parametrize("case", CASES)
def test_train_user_error_is_one_line(tmp_path, case):
    text, culprit = (s.format(tmp=tmp_path) for s in CASES[case])
    config = tmp_path / "run.yaml"
    config.write_text(text)
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "LORA_RL_CACHE": str(tmp_path / "cache"),
        "HF_HOME": str(tmp_path / "hf"),
    }
    proc = subprocess.run(
        [sys.executable, "-m", "flows.cli", "train", "-c", str(config)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert len(lines) == 1, proc.stderr[-2000:]
    assert lines[0].startswith("lora-rl: error: ")
    assert culprit in lines[0]
