"""`engine.launch`: the run starts an SGLang server as a subprocess, waits for its health, keeps its log and
stops its whole process group; a training run talks to it through `SGLangEngine` with store sync.

SGLang itself needs a GPU, so here `python -m sglang.launch_server` is the stand-in package
`lora_rl_testing/fake_sglang` (the fake SGLang server over the tiny model); the launcher, the flags it
renders and the run's ownership of the process are what is tested. The real server: tests marked `gpu`.
"""

from __future__ import annotations

import json
import time

import pytest

from lora_rl_core.config import load_config
from lora_rl_core.engines import GenerationRequest, SamplingParams
from lora_rl_core.engines.launch.process import launch_sglang
from lora_rl_core.engines.remote import SGLANG, HTTPEngine
from lora_rl_core.errors import EngineError
from lora_rl_core.store import AdapterStore
from lora_rl_testing.fake_launch import fake_launch
from tests.integration.tiny_run import write_tiny_config
from tests.support.processes import ended, pid_alive

pytestmark = pytest.mark.slow  # subprocesses and the Prefect test server


def _config(tmp_path, tiny_model_dir, *extra_args: str, **launch):
    launch = fake_launch(extra_args=list(extra_args), **launch)
    path = write_tiny_config(
        tmp_path, tiny_model_dir, "launched", engine={"type": "sglang", "sync": "store", "launch": launch}
    )
    return load_config(path)


def test_launch_waits_for_health_renders_the_flags_and_stops_the_group(tmp_path, tiny_model_dir):
    record = tmp_path / "argv.json"
    cfg = _config(tmp_path, tiny_model_dir, "--fake-record", str(record))
    server = launch_sglang(cfg.engine, cfg.model, cfg.lora, tmp_path / "sglang.log")
    try:
        argv = json.loads(record.read_text())["argv"]
        helper = json.loads(record.read_text())["helper_pid"]
        assert argv[argv.index("--model-path") + 1] == str(tiny_model_dir)
        # `auto` settings resolved by probing the launch interpreter: the stand-in has no FA3, no FlashInfer,
        # no GPU, so the Triton/PyTorch fallbacks, SGLang's graph default for an unknown GPU, its own fraction
        assert "--mem-fraction-static" not in argv and "--enable-memory-saver" not in argv
        assert argv[argv.index("--cuda-graph-max-bs-decode") + 1] == "160" and "--enable-lora" in argv
        assert argv[argv.index("--attention-backend") + 1] == "triton"
        assert argv[argv.index("--sampling-backend") + 1] == "pytorch"
        assert argv[argv.index("--lora-backend") + 1] == "triton"
        log = (tmp_path / "sglang.log").read_text()
        assert "[lora-rl] command: " in log and "neither FA3 nor a usable FlashInfer" in log
        with HTTPEngine(SGLANG, server.url, timeout_s=60) as engine:
            [done] = engine.generate([GenerationRequest([5, 6, 7], None, SamplingParams(max_new_tokens=2))])
            assert done.finish_reason in ("eos", "length")
        assert pid_alive(helper) and server.running
    finally:
        server.stop()
    assert not server.running and ended(helper)  # SGLang's child processes go with it


def test_a_server_that_dies_at_start_names_its_exit_code_and_log(tmp_path, tiny_model_dir):
    cfg = _config(tmp_path, tiny_model_dir, "--fake-exit-at-start", "3")
    with pytest.raises(EngineError, match=r"exited with code 3 during start-up(.|\n)*fake start-up failure"):
        launch_sglang(cfg.engine, cfg.model, cfg.lora, tmp_path / "sglang.log")


def test_a_server_never_healthy_is_stopped_after_the_timeout(tmp_path, tiny_model_dir):
    record = tmp_path / "argv.json"
    cfg = _config(tmp_path, tiny_model_dir, "--fake-never-healthy", "--fake-record", str(record), startup_timeout_s=3)
    start = time.monotonic()
    with pytest.raises(EngineError, match=r"not healthy after 3 s \(engine.launch.startup_timeout_s\)"):
        launch_sglang(cfg.engine, cfg.model, cfg.lora, tmp_path / "sglang.log")
    assert time.monotonic() - start < 60
    assert ended(json.loads(record.read_text())["helper_pid"])


def test_a_run_with_a_launched_sglang_trains_and_stops_it(tmp_path, tiny_model_dir):
    from flows.grpo_lora import train

    record = tmp_path / "argv.json"
    cfg_path = write_tiny_config(
        tmp_path,
        tiny_model_dir,
        "sglang-run",
        run={"id": "sglang-run", "eval_before_after": False},
        engine={
            "type": "sglang",
            "sync": "store",
            "launch": fake_launch(extra_args=["--fake-record", str(record)]),
        },
    )
    summary = train(config_path=str(cfg_path))
    assert summary["steps"] == 2 and summary["final_adapter"] == "sglang-run-v000002"
    assert AdapterStore(f"file://{tmp_path / 'store'}").versions("sglang-run") == [0, 1, 2]
    assert (tmp_path / "runs" / "sglang-run" / "sglang.log").exists()
    assert ended(json.loads(record.read_text())["helper_pid"])  # the run stopped the server it started
