"""`benchmarks/tune_sglang_lora.py`: the LoRA layer shapes, SGLang's chunk sizes and config file names, the search
space and how a config is chosen (the pure parts; the kernels need a GPU and SGLang)."""

from __future__ import annotations

import ast
import importlib
import json
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
tune = importlib.import_module("tune_sglang_lora")


def _layers(shape: str) -> dict:
    cfg = json.loads((BENCHMARKS / "model_configs" / f"qwen2.5-{shape}.json").read_text())
    return {layer.name: layer for layer in tune.lora_layers(cfg)}


def test_the_script_imports_sglang_and_triton_only_inside_functions():
    """So that `--help` and `--dry-run` work where neither is installed."""
    body = ast.parse((BENCHMARKS / "tune_sglang_lora.py").read_text()).body
    top = [a.name for n in body if isinstance(n, ast.Import) for a in n.names]
    top += [n.module for n in body if isinstance(n, ast.ImportFrom) and n.module]
    assert not [m for m in top if m.split(".")[0] in ("sglang", "triton")]


def test_qwen_1_5b_layers_as_sglang_fuses_them():
    layers = _layers("1.5b")  # hidden 1536, 12 heads of 128, 2 KV heads, intermediate 8960
    assert (layers["qkv"].in_dim, layers["qkv"].slices) == (1536, (1536, 256, 256))
    assert (layers["qkv"].offsets, layers["qkv"].max_slice) == ((0, 1536, 1792, 2048), 1536)
    assert (layers["o_proj"].in_dim, layers["o_proj"].out_dim) == (1536, 1536)
    assert (layers["gate_up"].offsets, layers["gate_up"].max_slice) == ((0, 8960, 17920), 8960)
    assert (layers["down_proj"].in_dim, layers["down_proj"].out_dim) == (8960, 1536)


def test_qwen_7b_layers_as_sglang_fuses_them():
    layers = _layers("7b")  # hidden 3584, 28 heads of 128, 4 KV heads, intermediate 18944
    assert layers["qkv"].slices == (3584, 512, 512)
    assert layers["gate_up"].out_dim == 37888
    assert (layers["down_proj"].in_dim, layers["down_proj"].out_dim) == (18944, 3584)


def test_head_dim_from_the_config_wins_over_hidden_by_heads():
    cfg = {
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 32,
        "intermediate_size": 96,
    }
    qkv, o_proj, _, _ = tune.lora_layers(cfg)
    assert qkv.slices == (128, 32, 32)
    assert (o_proj.in_dim, o_proj.out_dim) == (128, 64)


def test_expand_files_are_keyed_by_the_total_output_dim_and_o_and_down_share_one():
    layers = _layers("1.5b")
    shrink, expand = tune.layer_kernels(layers["qkv"], 16)
    assert (shrink.K, shrink.S, expand.K, expand.S) == (1536, 3, 2048, 3)
    assert expand.file_name("NVIDIA H100 80GB HBM3") == "lora_expand,K=2048,R=16,S=3,device=NVIDIA_H100_80GB_HBM3.json"
    problems = tune.kernel_problems(list(layers.values()), 16)
    assert len(problems) == 7
    assert problems[tune.Kernel("expand", 1536, 16, 1)].name == "o_proj"


@pytest.mark.parametrize(
    ("tokens", "max_chunk", "chunk"),
    [(128, 128, 32), (63, 128, 16), (64, 128, 32), (255, 128, 32), (256, 128, 128), (6144, 64, 64), (6144, 16, 16)],
)
def test_chunk_size_is_sglangs(tokens, max_chunk, chunk):
    assert tune.chunk_size_for_tokens(tokens, max_chunk) == chunk


def test_cases_drop_repeated_chunk_sizes():
    assert tune.tuning_cases([128, 6144], [16, 128]) == [(128, 16), (128, 32), (6144, 16), (6144, 128)]
    assert tune.tuning_cases([20], [16, 128]) == [(20, 16)]


def test_segments_cut_the_tokens_into_chunks():
    assert tune.segment_indptr(128, 32) == [0, 32, 64, 96, 128]
    assert tune.segment_indptr(70, 32) == [0, 32, 64, 70]


def test_candidates_start_with_the_default_and_skip_what_cannot_matter():
    default = {"BLOCK_N": 16, "BLOCK_K": 256, "num_warps": 4, "num_stages": 3}
    down = tune.Kernel("shrink", 8960, 16, 1)  # N = S*R = 16: only 16-wide tiles
    configs = tune.candidates(down, 32, tune.SHRINK_SPACE, default)
    assert configs[0] == default and configs.count(default) == 1
    assert {c["BLOCK_N"] for c in configs} == {16}
    assert len(configs) == 3 * 3 * 3  # BLOCK_K x warps x stages
    expand = tune.Kernel("expand", 1536, 16, 1)  # R = 16: one 16-deep reduction tile, so one stage count
    assert {(c["BLOCK_K"], c["num_stages"]) for c in tune.candidates(expand, 32, tune.EXPAND_SPACE, None)} == {(16, 1)}


def test_candidates_drop_tiles_that_overflow_shared_memory():
    qkv = tune.Kernel("shrink", 1536, 16, 3)  # 2 x (128x512 + 512x64) bf16 = 384 KiB > 227 KiB
    configs = tune.candidates(qkv, 128, tune.SHRINK_SPACE, None)
    assert {"BLOCK_N": 64, "BLOCK_K": 512, "num_warps": 4, "num_stages": 3} not in configs
    assert {"BLOCK_N": 64, "BLOCK_K": 512, "num_warps": 4, "num_stages": 2} in configs


def test_config_name():
    assert tune.config_name({"BLOCK_N": 16, "BLOCK_K": 256, "num_warps": 4, "num_stages": 3}) == "N16-K256-w4-s3"


def test_configs_rank_by_summed_ratio_to_each_cases_fastest():
    # a: 10/10 + 30/20 = 2.5, b: 11/10 + 20/20 = 2.1, c: 12/10 + 21/20 = 2.25
    assert tune.rank_configs([{"a": 10.0, "b": 11.0, "c": 12.0}, {"a": 30.0, "b": 20.0, "c": 21.0}]) == ["b", "c", "a"]
    # a config missing from one case (it failed there) is out; the case's fastest still sets its scale:
    # a: 10/1 + 30/20 = 11.5, b: 11/1 + 20/20 = 12
    assert tune.rank_configs([{"a": 10.0, "b": 11.0, "x": 1.0}, {"a": 30.0, "b": 20.0}]) == ["a", "b"]
    assert tune.rank_configs([{"a": 1.0}, {}]) == []


def test_a_decode_step_pays_every_layer_kind_in_every_layer():
    assert tune.per_step_us({"qkv": 1.5, "o_proj": 2.5}, 28) == 112.0


def test_dry_run_prints_shapes_without_a_gpu(capsys, monkeypatch):
    config = str(BENCHMARKS / "model_configs" / "qwen2.5-7b.json")
    argv = ["tune_sglang_lora.py", "--model-config", config, "--tokens", "128", "6144", "--dry-run"]
    monkeypatch.setattr(sys, "argv", argv)
    tune.main()
    out = capsys.readouterr().out
    assert "lora_expand,K=37888,R=16,S=2,device=<device>.json" in out
    assert "T=6144 chunk=128" in out
