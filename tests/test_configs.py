"""Every shipped YAML config validates; overrides and config errors behave as documented."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from lora_rl_core.config import RunConfig, load_config
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
    assert cfg.lora.target_modules == ["q_proj", "v_proj"]
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
    assert cfg.algorithm.correction(cfg.rollout.mode) == "token-truncate"  # `auto` in async mode
    assert cfg.rollouts_ahead() == 1 and load_config(None, []).rollouts_ahead() == 0
    assert load_config(None, []).algorithm.correction("sync") == "none"
    chosen = load_config(None, ["rollout.mode=async", "algorithm.off_policy_correction=sequence-mask"])
    assert chosen.algorithm.correction("async") == "sequence-mask"


def test_the_old_tis_cap_names_its_replacement():
    with pytest.raises(ConfigError, match=r"off_policy_correction=token-truncate and algorithm.is_cap=2.0"):
        load_config(None, ["algorithm.tis_cap=2.0"])
