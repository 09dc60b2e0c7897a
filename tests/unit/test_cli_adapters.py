"""`lora-rl adapters list|pull` on a file store with two tiny adapters."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from flows.cli_adapters import adapters_app
from lora_rl_core.store import AdapterStore

CONFIG = {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["q_proj"]}
KEY = "base_model.model.model.layers.0.self_attn.q_proj.lora_{}.weight"


@pytest.fixture
def store_uri(tmp_path: Path) -> str:
    uri = f"file://{tmp_path}/runs"
    store = AdapterStore(uri)
    for version in (3, 4):
        tensors = {KEY.format("A"): torch.full((2, 8), float(version)), KEY.format("B"): torch.ones(8, 2)}
        store.publish(
            "r1",
            version,
            tensors=tensors,
            adapter_config=CONFIG,
            step=version * 100,
            base_model="tiny",
            metrics={"reward_mean": version / 10},
        )
    return uri


def test_list_runs(store_uri):
    result = CliRunner().invoke(adapters_app, ["list", "--store", store_uri])
    assert result.exit_code == 0, result.output
    rows = [[cell.strip() for cell in line.split("│")[1:-1]] for line in result.output.splitlines()]
    assert ["r1", "2", "4"] in rows


def test_list_versions_of_a_run(store_uri):
    store = AdapterStore(store_uri)
    result = CliRunner().invoke(adapters_app, ["list", "--store", store_uri, "--run", "r1"])
    assert result.exit_code == 0, result.output
    for version, step, reward in ((3, 300, "0.3000"), (4, 400, "0.4000")):
        sha = store.ref("r1", version).sha256[:12]
        rows = [[cell.strip() for cell in line.split("│")[1:-1]] for line in result.output.splitlines()]
        row = next(r for r in rows if sha in r)
        assert row[:2] == [str(version), str(step)] and row[3] == reward


def test_pull_writes_peft_folder(store_uri, tmp_path):
    out = tmp_path / "pulled"
    result = CliRunner().invoke(adapters_app, ["pull", "r1@latest", "--store", store_uri, "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == str(out)
    assert {p.name for p in out.iterdir()} == {"adapter_model.safetensors", "adapter_config.json", "manifest.json"}
    tensors, _ = AdapterStore(store_uri).load_tensors("r1", 4)
    assert torch.equal(load_file(out / "adapter_model.safetensors")[KEY.format("A")], tensors[KEY.format("A")])


@pytest.mark.parametrize(
    "args",
    [
        ["pull", "ghost@latest", "--out", "OUT"],
        ["pull", "r1@9", "--out", "OUT"],
        ["pull", "../x@1", "--out", "OUT"],
        ["list", "--run", "ghost"],
    ],
)
def test_store_errors_exit_2_with_one_line(store_uri, tmp_path, args):
    args = [str(tmp_path / "out") if a == "OUT" else a for a in args] + ["--store", store_uri]
    result = CliRunner().invoke(adapters_app, args)
    assert result.exit_code == 2
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("lora-rl: error: ")
    assert not (tmp_path / "out").exists()
