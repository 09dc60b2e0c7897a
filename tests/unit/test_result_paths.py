"""Benchmark results name no machine's folders (`benchmarks/_common.write_json`): a path on its own becomes its
file name, and so does each absolute path inside a string, such as the SGLang command line a GPU result keeps;
URLs and relative paths stay as they are."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from _common import write_json  # noqa: E402


def test_write_json_keeps_no_absolute_folder(tmp_path):
    command = (
        "[lora-rl] command: /opt/torch/.venv/bin/python3 -m sglang.launch_server "
        "--model-path /tmp/models/qwen2.5-7b-random --host 127.0.0.1 --port 30000"
    )
    record = {
        "sglang_command": command,
        "out": "/root/out/ours.json",
        "store": "store.uri=file:///tmp/run/store",
        "urls": ["http://127.0.0.1:30000/v1/models"],
        "note": "rollout tok/s 12/3, benchmarks/results/gpu_scale",
    }
    write_json(record, tmp_path / "r.json")
    got = json.loads((tmp_path / "r.json").read_text())
    assert got["sglang_command"] == (
        "[lora-rl] command: python3 -m sglang.launch_server --model-path qwen2.5-7b-random --host 127.0.0.1 "
        "--port 30000"
    )
    assert got["out"] == "ours.json" and got["store"] == "store.uri=file://store"
    assert got["urls"] == record["urls"] and got["note"] == record["note"]
