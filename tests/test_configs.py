"""Every shipped YAML config validates; overrides and config errors behave as documented."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from lora_rl_core.config import (
    EmbeddedEngineConfig,
    InProcessBackend,
    MaskCorrection,
    RayBackend,
    RunConfig,
    TruncateCorrection,
    load_config,
)
from lora_rl_core.errors import ConfigError

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "configs").rglob("*.yaml"))


def test_configs_folder_is_not_empty():
    assert CONFIGS, "no YAML files found in configs/"


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_config_loads(path):
    assert isinstance(load_config(path), RunConfig)


def test_overrides_parse_values_as_yaml():
    cfg = load_config(None, ["lora.rank=32", "lora.target_modules=[q_proj,v_proj]", "rollout.temperature=0.7"])
    assert cfg.lora.rank == 32
    assert cfg.lora.target_modules == ("q_proj", "v_proj")  # a YAML list, held as a tuple (frozen)
    assert cfg.rollout.temperature == 0.7


def test_override_applies_on_top_of_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("lora:\n  rank: 4\n  alpha: 8\n")
    cfg = load_config(path, ["lora.rank=32"])
    assert (cfg.lora.rank, cfg.lora.alpha) == (32, 8)


def test_unknown_top_level_key(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("lorra:\n  rank: 4\n")
    with pytest.raises(ConfigError, match=r"lorra: unknown key"):
        load_config(path)


def test_unknown_nested_key():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["lora.rnak=8"])
    assert "lora.rnak" in str(err.value)
    assert "unknown key" in str(err.value)


def test_bad_value_names_the_field():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["lora.rank=-1"])
    assert "lora.rank" in str(err.value)
    assert "-1" in str(err.value)


def test_override_without_equals():
    with pytest.raises(ConfigError, match=r"bad override 'lora\.rank'.*key=value"):
        load_config(None, ["lora.rank"])


def test_missing_file(tmp_path):
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError, match=rf"config file not found: {re.escape(str(missing))}"):
        load_config(missing)


def test_yaml_list_is_rejected(tmp_path):
    path = tmp_path / "list.yaml"
    path.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match=r"must be a mapping of sections, got list"):
        load_config(path)


def test_run_id_is_carried_from_overrides():
    # The default id (`<run.name>-<flow run id[:8]>`) is made by the flow, which needs a flow run.
    assert load_config(None, ["run.id=my-run"]).run.id == "my-run"
    assert load_config(None, ["run.name=exp"]).run.id is None


def test_async_rollouts_need_a_staleness_window():
    with pytest.raises(ConfigError, match=r"rollout.mode=async needs algorithm.max_staleness >= 1"):
        load_config(None, ["rollout.mode=async", "algorithm.max_staleness=0"])
    cfg = load_config(None, ["rollout.mode=async"])
    assert cfg.algorithm.correction("async") == TruncateCorrection(type="token-truncate", is_cap=2.0)
    assert cfg.rollouts_ahead("async") == 1 and load_config(None, []).rollouts_ahead("sync") == 0
    assert load_config(None, []).algorithm.correction("sync").type == "none"
    chosen = load_config(None, ["rollout.mode=async", "algorithm.off_policy_correction=sequence-mask"])
    assert chosen.algorithm.correction("async") == MaskCorrection(type="sequence-mask", is_cap=2.0, is_floor=0.0)


def test_m2po_takes_its_threshold_and_turns_the_ppo_clip_off():
    from lora_rl_core.plan import make_plan

    cfg = load_config(None, ["rollout.mode=async", "algorithm.off_policy_correction=m2po", "model.device=cpu"])
    assert cfg.algorithm.correction("async").model_dump() == {"type": "m2po", "m2_threshold": 0.04}
    plan = make_plan(cfg)
    assert plan.trainer is not None and (plan.trainer.loss.clip_eps_low, plan.trainer.loss.clip_eps_high) == (
        None,
        None,
    )
    assert "clip_eps_low and clip_eps_high are not used" in plan.choices["algorithm.off_policy_correction"].reason
    with pytest.raises(ConfigError, match=r"m2_threshold .*: Input should be greater than 0") as err:
        load_config(
            None, ["algorithm.off_policy_correction.type=m2po", "algorithm.off_policy_correction.m2_threshold=0"]
        )
    assert "\n" not in str(err.value)


def test_the_old_tis_cap_names_its_replacement():
    moved = r"algorithm.tis_cap moved into algorithm.off_policy_correction: set algorithm.off_policy_correction="
    with pytest.raises(ConfigError, match=moved + r"\{type: token-truncate, is_cap: 2.0\}"):
        load_config(None, ["algorithm.tis_cap=2.0"])


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["engine.launch.enabled=true"],
            "engine.launch: not an option of engine.type embedded (an option of engine.type sglang)",
        ),
        (
            ["engine.type=server", "engine.urls=[http://127.0.0.1:8000]", "engine.tensor_transport=ipc"],
            "engine.tensor_transport: not an option of engine.type server (an option of engine.type sglang)",
        ),
        (
            ["engine.type=sglang", "engine.urls=[http://127.0.0.1:30000]", "engine.max_batch_size=8"],
            "engine.max_batch_size: not an option of engine.type sglang (an option of engine.type embedded)",
        ),
        (
            ["engine.type=server", "engine.ray_replicas=2", "engine.urls=[http://h:1]"],
            "engine.ray_replicas: not an option of engine.type server (an option of engine.type embedded / sglang)",
        ),
        (["engine.type=vllm"], "does not match any of the expected tags: 'embedded', 'server', 'sglang'"),
        (["engine.type=server"], "engine (engine.type server): Value error, engine.type server needs engine.urls"),
        (
            ["algorithm.off_policy_correction=token-truncate", "algorithm.off_policy_correction.is_floor=0.5"],
            "algorithm.off_policy_correction.is_floor: not an option of algorithm.off_policy_correction.type "
            "token-truncate (an option of algorithm.off_policy_correction.type sequence-mask / token-mask)",
        ),
        (
            ["algorithm.off_policy_correction.is_cap=3"],
            "algorithm.off_policy_correction.is_cap: not an option of algorithm.off_policy_correction.type auto",
        ),
        (
            ["trainer.backend.world_size=2"],
            "trainer.backend.world_size: not an option of trainer.backend.type in-process (an option of "
            "trainer.backend.type local / ray)",
        ),
        (
            ["trainer.backend=local", "trainer.backend.gpus_per_rank=0.5"],
            "trainer.backend.gpus_per_rank: not an option of trainer.backend.type local (an option of "
            "trainer.backend.type ray)",
        ),
        (
            ["algorithm.is_cap=3"],
            "algorithm.is_cap moved into algorithm.off_policy_correction: set "
            "algorithm.off_policy_correction={type: token-truncate, is_cap: 3}",
        ),
        (
            ["trainer.world_size=2"],
            "trainer.world_size moved into trainer.backend: set trainer.backend={type: local, world_size: 2}",
        ),
    ],
)
def test_an_option_of_another_kind_is_an_error_naming_the_kind(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert message in str(err.value)


def test_type_keyed_sections_take_a_bare_kind_a_mapping_or_their_default():
    cfg = load_config(
        None, ["trainer.backend=ray", "trainer.backend.world_size=2", "trainer.backend.gpus_per_rank=0.5"]
    )
    assert cfg.trainer.backend == RayBackend(world_size=2, gpus_per_rank=0.5) and cfg.trainer.ranks() == 2
    assert load_config(None, []).trainer.backend == InProcessBackend() and load_config(None, []).trainer.ranks() == 0
    masked = load_config(None, ["algorithm.off_policy_correction={type: token-mask, is_cap: 3, is_floor: 0.5}"])
    assert masked.algorithm.correction("sync") == MaskCorrection(type="token-mask", is_cap=3.0, is_floor=0.5)
    assert masked.algorithm.correction("sync").weight_args() == {"cap": 3.0, "floor": 0.5}
    # an engine mapping without `type` is the default kind, and its own options are kept
    assert load_config(None, ["engine.max_batch_size=8"]).engine == EmbeddedEngineConfig(max_batch_size=8)
    # a round trip through the snapshot (run.json) gives the same config back
    sglang = load_config(None, ["engine.type=sglang", "engine.launch.enabled=true", "engine.tensor_transport=file"])
    assert RunConfig.model_validate(sglang.model_dump()) == sglang


def test_the_config_mappings_are_read_only_and_pickle_as_they_are():
    """`engine.launch.env` and `store.storage_options` are `FrozenDict`s: a validated config is never changed,
    and it still travels pickled to Ray actors and FSDP2 ranks, and dumps to JSON."""
    import json
    import pickle

    from lora_rl_core.config.base import FrozenDict

    cfg = load_config(
        None,
        ["engine.type=sglang", "engine.launch.enabled=true", "engine.launch.env={PYTHONPATH: /x}",
         "store.storage_options={anon: true}"],
    )  # fmt: skip
    env, options = cfg.engine.launch.env, cfg.store.storage_options
    assert isinstance(env, FrozenDict) and env == {"PYTHONPATH": "/x"} and options == {"anon": True}
    for change in (lambda: env.__setitem__("A", "1"), lambda: options.update(key="k"), lambda: env.pop("PYTHONPATH")):
        with pytest.raises(TypeError, match="read-only"):
            change()
    assert env == {"PYTHONPATH": "/x"}
    back = pickle.loads(pickle.dumps(cfg))
    assert isinstance(back.engine.launch.env, FrozenDict) and back == cfg
    assert json.loads(cfg.model_dump_json())["store"]["storage_options"] == {"anon": True}
    assert {**env, "B": "2"} == {"PYTHONPATH": "/x", "B": "2"}  # a changed copy is a plain dict
