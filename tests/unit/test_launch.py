"""sglang_launch_command: flags rendered as SGLang parses them, and SGLang's start-up checks."""

from __future__ import annotations

import json
import shlex

import pytest

from lora_rl_core.config import config_from_dict, sglang_section
from lora_rl_core.engines.launch.command import render, sglang_launch_command, sglang_launch_command_from_config
from lora_rl_core.errors import ConfigError, EngineError


def flag(argv: list[str], name: str) -> list[str]:
    """The values after `name`, up to the next `--flag`."""
    values = []
    for arg in argv[argv.index(name) + 1 :]:
        if arg.startswith("--"):
            break
        values.append(arg)
    return values


def test_renders_pool_targets_and_pinned_paths():
    argv = sglang_launch_command(
        "Qwen/Qwen2.5-0.5B-Instruct",
        max_lora_rank=16,
        target_modules=["q_proj", "v_proj"],
        max_loras_per_batch=4,
        max_loaded_loras=8,
        eviction_policy="fifo",
        lora_paths=[("run-v000001", "/adapters/v1", False), ("run-v000002", "/adapters/v2", True)],
        host="0.0.0.0",
        port=31000,
        extra=["--api-key", "k"],
    )
    assert argv[:3] == ["python", "-m", "sglang.launch_server"]
    assert flag(argv, "--model-path") == ["Qwen/Qwen2.5-0.5B-Instruct"]
    assert flag(argv, "--host") == ["0.0.0.0"] and flag(argv, "--port") == ["31000"]
    assert "--enable-lora" in argv
    assert flag(argv, "--max-lora-rank") == ["16"]
    assert flag(argv, "--lora-target-modules") == ["q_proj", "v_proj"]
    assert flag(argv, "--max-loras-per-batch") == ["4"]
    assert flag(argv, "--max-loaded-loras") == ["8"]
    assert flag(argv, "--lora-eviction-policy") == ["fifo"]
    plain, pinned = flag(argv, "--lora-paths")
    assert plain == "run-v000001=/adapters/v1"
    assert json.loads(pinned) == {"lora_name": "run-v000002", "lora_path": "/adapters/v2", "pinned": True}
    assert argv[-2:] == ["--api-key", "k"]
    assert shlex.split(render(argv)) == argv  # the JSON entry survives shell quoting


def test_defaults_all_linear_and_no_cap():
    argv = sglang_launch_command("m", max_lora_rank=8, target_modules="all-linear")
    assert flag(argv, "--lora-target-modules") == ["all"]
    assert "--max-loaded-loras" not in argv and "--lora-paths" not in argv
    assert flag(argv, "--max-loras-per-batch") == ["8"] and flag(argv, "--lora-eviction-policy") == ["lru"]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_loaded_loras": 2}, "--max-loaded-loras"),
        ({"target_modules": ["all", "q_proj"]}, "stand alone"),
        ({"target_modules": []}, "at least one"),
        ({"max_lora_rank": 0}, "--max-lora-rank"),
        ({"lora_paths": [(f"r-v00000{i}", f"/a/{i}", True) for i in range(4)]}, "at most"),
        ({"lora_paths": [("r-v000001", "/a", False), ("r-v000001", "/b", False)]}, "more than once"),
        ({"lora_paths": [("../evil", "/a", False)]}, "bad adapter name"),
        ({"max_loaded_loras": 4, "lora_paths": [(f"r-v00000{i}", "/a", False) for i in range(5)]}, "more than"),
    ],
)
def test_refuses_what_sglang_refuses(kwargs, message):
    args = {"max_lora_rank": 8, "target_modules": ["q_proj"], "max_loras_per_batch": 4, **kwargs}
    with pytest.raises(ConfigError, match=message):
        sglang_launch_command("m", **args)


def test_an_eviction_policy_sglang_refuses_is_refused_by_the_config():
    """The allowed policies are checked once, by the engine config (`EngineLimits`; the launch command trusts it)."""
    with pytest.raises(ConfigError, match="lru"):
        config_from_dict({"engine": {"eviction_policy": "random"}})


def test_three_pinned_of_four_slots_is_allowed():
    paths = [(f"r-v00000{i}", f"/a/{i}", True) for i in range(3)]
    argv = sglang_launch_command(
        "m", max_lora_rank=8, target_modules=["q_proj"], max_loras_per_batch=4, lora_paths=paths
    )
    assert len(flag(argv, "--lora-paths")) == 3


def test_from_config_uses_model_lora_and_engine_sections():
    cfg = config_from_dict(
        {
            "model": {"name_or_path": "smollm2-135m-instruct", "dtype": "bfloat16"},
            "lora": {"rank": 8, "target_modules": ["q_proj", "v_proj", "o_proj"], "exclude_modules": ["o_proj"]},
            "engine": {"max_loras_per_batch": 4, "max_loaded_loras": 6, "eviction_policy": "lru"},
        }
    )
    argv = sglang_launch_command_from_config(
        cfg.engine, cfg.model, cfg.lora, lora_paths=[("r-v000001", "/a", True)], port=30001
    )
    assert flag(argv, "--model-path") == ["HuggingFaceTB/SmolLM2-135M-Instruct"]
    assert flag(argv, "--max-lora-rank") == ["8"]
    assert flag(argv, "--lora-target-modules") == ["q_proj", "v_proj"]
    assert flag(argv, "--max-loras-per-batch") == ["4"] and flag(argv, "--max-loaded-loras") == ["6"]
    assert flag(argv, "--dtype") == ["bfloat16"] and flag(argv, "--port") == ["30001"]
    cfg = config_from_dict({"lora": {"exclude_modules": ["o_proj"]}})
    with pytest.raises(ConfigError, match="exclude_modules"):
        sglang_launch_command_from_config(cfg.engine, cfg.model, cfg.lora)


def test_launch_flags_follow_the_resolved_launch_section():
    from lora_rl_core.config import SGLangLaunchConfig
    from lora_rl_core.engines.launch.command import launch_flags
    from lora_rl_core.engines.launch.probe import SGLangEnvironment
    from lora_rl_core.engines.launch.resolve import resolve_launch

    h100 = SGLangEnvironment(fa3=True, flashinfer=True, gpu_total_bytes=80 * 1024**3, gpu_capability=(9, 0))
    flags = launch_flags(resolve_launch(SGLangLaunchConfig(), h100, rollout_batch=128, mem_fraction=0.42))
    assert flags[flags.index("--mem-fraction-static") + 1] == "0.420"
    assert flags[flags.index("--cuda-graph-max-bs-decode") + 1] == "256"  # SGLang's own default is larger
    assert flags[flags.index("--cuda-graph-backend-prefill") + 1] == "disabled"
    # SGLang's own backends where it has the kernels: no flag; LoRA kernels: Triton's (faster decode)
    assert not {"--attention-backend", "--sampling-backend", "--enable-memory-saver"} & set(flags)
    assert flags[flags.index("--lora-backend") + 1] == "triton"
    eager = launch_flags(
        resolve_launch(
            SGLangLaunchConfig(cuda_graph_max_bs=None, mem_fraction_static=None, extra_args=["--x", "1"]), h100
        )
    )
    assert "--disable-cuda-graph" in eager and "--cuda-graph-max-bs-decode" not in eager
    assert "--mem-fraction-static" not in eager and eager[-2:] == ["--x", "1"]


def test_auto_launch_settings_follow_the_installation_and_the_batch():
    from lora_rl_core.config import SGLangLaunchConfig
    from lora_rl_core.engines.launch.command import launch_flags
    from lora_rl_core.engines.launch.probe import SGLangEnvironment
    from lora_rl_core.engines.launch.resolve import resolve_launch

    carry = SGLangEnvironment(memory_saver=True, gpu_total_bytes=80 * 1024**3, gpu_capability=(9, 0))  # no FA3
    resolved = resolve_launch(SGLangLaunchConfig(), carry, rollout_batch=512, mem_fraction=0.3, memory_saver=True)
    flags = launch_flags(resolved)
    assert flags[flags.index("--attention-backend") + 1] == "triton"
    assert flags[flags.index("--sampling-backend") + 1] == "pytorch"
    assert flags[flags.index("--lora-backend") + 1] == "triton"
    assert flags[flags.index("--cuda-graph-max-bs-decode") + 1] == "512"  # the batch is larger than 256
    assert "--enable-memory-saver" in flags
    assert "FA3" in resolved.reasons["attention_backend"]
    small = SGLangEnvironment(flashinfer=True, gpu_total_bytes=24 * 1024**3, gpu_capability=(8, 9))
    flags = launch_flags(resolve_launch(SGLangLaunchConfig(), small, rollout_batch=16))
    assert flags[flags.index("--cuda-graph-max-bs-decode") + 1] == "24"
    assert flags[flags.index("--attention-backend") + 1] == "flashinfer" and "--sampling-backend" not in flags
    # explicit settings are kept as given
    fixed = SGLangLaunchConfig(
        attention_backend="fa3", lora_backend="csgmv", cuda_graph_max_bs=64, mem_fraction_static=0.5, memory_saver=False
    )
    flags = launch_flags(resolve_launch(fixed, carry, rollout_batch=512, mem_fraction=0.3, memory_saver=True))
    assert flags[flags.index("--attention-backend") + 1] == "fa3"
    assert flags[flags.index("--lora-backend") + 1] == "csgmv"
    assert flags[flags.index("--cuda-graph-max-bs-decode") + 1] == "64"
    assert flags[flags.index("--mem-fraction-static") + 1] == "0.500" and "--enable-memory-saver" not in flags


def test_server_command_runs_the_launch_interpreter_on_the_local_folder():
    from lora_rl_core.engines.launch.command import sglang_server_command

    cfg = config_from_dict(
        {
            "engine": {
                "type": "sglang",
                "sync": "store",
                "launch": {"enabled": True, "python": "/opt/py", "port": 31234},
            },
            "lora": {"rank": 8},
        }
    )
    from lora_rl_core.engines.launch.probe import SGLangEnvironment
    from lora_rl_core.engines.launch.resolve import resolve_launch

    engine = sglang_section(cfg.engine, "this test")
    resolved = resolve_launch(engine.launch, SGLangEnvironment(), mem_fraction=0.25)
    argv = sglang_server_command(engine, cfg.model, cfg.lora, "/models/smollm2", resolved)
    assert argv[:3] == ["/opt/py", "-m", "sglang.launch_server"]
    assert flag(argv, "--model-path") == ["/models/smollm2"] and flag(argv, "--port") == ["31234"]
    assert flag(argv, "--max-lora-rank") == ["8"] and flag(argv, "--mem-fraction-static") == ["0.250"]


@pytest.mark.parametrize(
    ("engine", "message"),
    [
        ({"type": "embedded", "launch": {"enabled": True}}, r"engine.launch: not an option of engine.type embedded"),
        (
            {"type": "sglang", "sync": "store", "urls": ["http://127.0.0.1:30000"], "launch": {"enabled": True}},
            r"engine.type sglang needs engine.urls \(servers already running\) or engine.launch.enabled: true",
        ),
        ({"type": "sglang"}, r"engine.type sglang needs engine.urls"),
    ],
)
def test_launch_needs_an_sglang_engine_without_urls(engine, message):
    with pytest.raises(ConfigError, match=message):
        config_from_dict({"engine": engine})


@pytest.mark.parametrize(("version", "refused"), [("0.6.0", True), ("0.5.23", False)])
def test_the_probe_refuses_an_sglang_version_the_client_does_not_know_before_launching(tmp_path, version, refused):
    """The interpreter that would run SGLang has a package of another version: one line naming the version, the
    interpreter and the versions known, before minutes of start-up; a known version passes."""
    import sys

    from lora_rl_core.config import SGLangLaunchConfig
    from lora_rl_core.engines.launch.probe import probe_sglang

    site = tmp_path / "site"
    (site / "sglang").mkdir(parents=True)
    (site / "sglang" / "__init__.py").write_text("")
    meta = site / f"sglang-{version}.dist-info"
    meta.mkdir()
    (meta / "METADATA").write_text(f"Metadata-Version: 2.1\nName: sglang\nVersion: {version}\n")
    launch = SGLangLaunchConfig(python=sys.executable, env={"PYTHONPATH": str(site)})
    if not refused:
        assert probe_sglang(launch).version == version
        return
    with pytest.raises(EngineError) as err:
        probe_sglang(launch)
    message = str(err.value)
    assert message.startswith(f"SGLang {version} at engine.launch.python={sys.executable!r}")
    assert "is not a version this client knows (>=0.5.17,<0.5.24" in message and "\n" not in message


def test_the_gpu_extra_pins_the_sglang_versions_the_client_knows():
    """One range in two places (the client's `SGLANG.versions`, the `gpu` extra's pin that pip reads): equal."""
    import tomllib
    from pathlib import Path

    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet

    from lora_rl_core.engines.remote import SGLANG

    extras = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    pins = [Requirement(r) for r in extras["project"]["optional-dependencies"]["gpu"]]
    assert SGLANG.versions is not None
    assert [r.specifier for r in pins if r.name == "sglang"] == [SpecifierSet(SGLANG.versions)]
