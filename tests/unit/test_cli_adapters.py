"""`lora-rl adapters list|show|pull|tag|untag|gc` on a file store with tiny adapters."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from cli.adapters import adapters_app
from lora_rl_core.store import AdapterStore

CONFIG = {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["q_proj"]}
KEY = "base_model.model.model.layers.0.self_attn.q_proj.lora_{}.weight"


def _tensors(version: int) -> dict[str, torch.Tensor]:
    return {KEY.format("A"): torch.full((2, 8), float(version)), KEY.format("B"): torch.ones(8, 2)}


@pytest.fixture
def store_uri(tmp_path: Path) -> str:
    uri = f"file://{tmp_path}/runs"
    store = AdapterStore(uri)
    for version in (3, 4):
        tensors = _tensors(version)
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
    assert ["r1", "2", "4", "-"] in rows


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
        ["show", "r1@best"],
        ["tag", "r1", "3", "latest"],
        ["tag", "r1", "3", "../evil"],
        ["tag", "r1", "9", "best"],
        ["untag", "r1", "nope"],
        ["gc", "r1", "--keep-last", "0"],
        ["gc", "ghost", "--keep-last", "1"],
        ["list", "--storage-options", "{not json"],
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


def _rows(output: str) -> list[list[str]]:
    return [[cell.strip() for cell in line.split("│")[1:-1]] for line in output.splitlines()]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["tag", "r1", "3", "latest"], "invalid tag name 'latest': it is reserved"),
        (["tag", "r1", "3", "../evil"], "invalid tag name '../evil'"),
        (["show", "r1@best"], "run 'r1' has no tag 'best'"),
        (["gc", "r1", "--keep-last", "0"], "keep_last must be an integer >= 1"),
        (["list", "--storage-options", "[1]"], "--storage-options must be a JSON object"),
    ],
)
def test_error_text(store_uri, args, message):
    result = CliRunner().invoke(adapters_app, [*args, "--store", store_uri])
    assert result.exit_code == 2 and message in result.stderr


def test_tag_show_and_list_with_tags(store_uri):
    runner = CliRunner()
    tagged = runner.invoke(adapters_app, ["tag", "r1", "3", "best", "--store", store_uri])
    assert tagged.exit_code == 0 and tagged.stdout.strip() == "tagged r1-v000003 as r1@best"
    again = runner.invoke(adapters_app, ["tag", "r1", "best", "release", "--store", store_uri])  # a tag as VERSION
    assert again.exit_code == 0 and "r1-v000003 as r1@release" in again.stdout
    listed = runner.invoke(adapters_app, ["list", "--store", store_uri, "--run", "r1"])
    row = next(r for r in _rows(listed.output) if r and r[0] == "3")
    assert row[-1] == "best, release"
    assert ["r1", "2", "4", "best=3, release=3"] in _rows(
        runner.invoke(adapters_app, ["list", "--store", store_uri]).output
    )
    shown = runner.invoke(adapters_app, ["show", "r1@best", "--store", store_uri, "--verify"])
    assert shown.exit_code == 0, shown.output
    rows = _rows(shown.output)
    assert ["adapter", "r1-v000003"] in rows and ["step", "300"] in rows and ["tags", "best, release"] in rows
    sha = AdapterStore(store_uri).ref("r1", 3).sha256
    assert [
        "adapter_model.safetensors",
        next(r[1] for r in rows if r and r[0] == "adapter_model.safetensors"),
        sha,
    ] in rows
    assert "verified: 2 files match their sha256" in shown.output
    removed = runner.invoke(adapters_app, ["untag", "r1", "release", "--store", store_uri])
    assert removed.exit_code == 0 and AdapterStore(store_uri).tags("r1") == {"best": 3}


def test_gc_dry_run_then_delete(store_uri):
    store = AdapterStore(store_uri)
    for version in (5, 6):
        store.publish("r1", version, tensors=_tensors(version), adapter_config=CONFIG, step=version, base_model="tiny")
    store.tag("r1", 3, "best")
    runner = CliRunner()
    dry = runner.invoke(adapters_app, ["gc", "r1", "--keep-last", "2", "--dry-run", "--store", store_uri])
    assert dry.exit_code == 0, dry.output
    assert "dry run: would delete 1 of 4 versions: [4]" in dry.output
    assert ["3", "best", "keep (tag best)"] in _rows(dry.output) and ["4", "-", "delete"] in _rows(dry.output)
    assert store.versions("r1") == [3, 4, 5, 6]
    real = runner.invoke(adapters_app, ["gc", "r1", "--keep-last", "2", "--store", store_uri])
    assert real.exit_code == 0 and "deleted 1 of 4 versions: [4]" in real.output
    assert store.versions("r1") == [3, 5, 6]


def test_console_entry_point_exits_2_on_store_errors(store_uri, tmp_path, monkeypatch, capsys):
    from cli.main import main

    argv = ["lora-rl", "adapters", "pull", "r1@9", "--out", str(tmp_path / "out"), "--store", store_uri]
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit) as exc:
        main()
    assert exc.value.code == 2
    assert capsys.readouterr().err.startswith("lora-rl: error: adapter r1@9 not found")
