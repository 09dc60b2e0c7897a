"""lora_rl_core.adapters: the naming rules, adapter file reading and the validation shared by store and engines."""

from __future__ import annotations

import json

import pytest
import torch
from peft import LoraConfig, get_peft_model

from lora_rl_core.adapters import (
    AdapterRules,
    adaptable_module_names,
    adapter_name,
    adapter_run,
    adapter_version,
    check_adapter_name,
    check_finite,
    parse_adapter_name,
    parse_adapter_spec,
    parse_version_uri,
    peft_folder,
    refuse_pickles,
    safetensors_bytes,
    safetensors_shapes,
    validate_run_id,
)
from lora_rl_core.errors import StoreError
from lora_rl_core.lora import linear_suffixes
from lora_rl_core.store.sources import read_adapter_folder
from tests.support.store_adapters import SMALL_CONFIG, small_lora, tiny_base

# ----------------------------------------------------------------- names


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("run-v000007", ("run", 7)),
        ("run-v000000", ("run", 0)),
        ("run-v999999", ("run", 999999)),
        ("run-v1000000", ("run", 1000000)),  # versions grow past 6 digits: the engine's old regex refused this
        ("grpo.qwen-0.5b-v2-v000012", ("grpo.qwen-0.5b-v2", 12)),  # the last -vNNNNNN is the version
        ("a-v999999999999", ("a", 10**12 - 1)),
    ],
)
def test_parse_adapter_name(name, expected):
    assert parse_adapter_name(name) == expected
    assert (adapter_run(name), adapter_version(name)) == expected
    assert adapter_name(*expected) == name  # the inverse of adapter_name


@pytest.mark.parametrize(
    "name",
    [
        None,
        "",
        "base",
        "run-v7",  # under 6 digits
        "run-v00007",
        "run-v0000007",  # not how adapter_name writes 7: not the same adapter as run-v000007
        "run-v1000000000000",  # over 12 digits
        "run-v000007x",
        "-v000007",  # empty run id
        "../x-v000007",
        "a/b-v000007",
        "a..b-v000007",
        ".hidden-v000007",
        "x" * 129 + "-v000001",  # run id over 128 characters
    ],
)
def test_parse_adapter_name_rejects(name):
    assert parse_adapter_name(name) is None
    assert adapter_version(name) is None and adapter_run(name) is None


@pytest.mark.parametrize(("run_id", "version"), [("r1", 0), ("r1", 7), ("r.x_y-z", 999999), ("r", 1000000)])
def test_adapter_name_roundtrips(run_id, version):
    name = adapter_name(run_id, version)
    assert parse_adapter_name(name) == (run_id, version)
    assert parse_adapter_spec(name) == (run_id, version)
    assert adapter_name("r1", 7) == "r1-v000007"


def test_check_adapter_name():
    assert check_adapter_name("run-v1000000") == "run-v1000000"
    assert check_adapter_name("my.adapter_1") == "my.adapter_1"  # unversioned names are allowed
    for bad in ("../evil", "a/b", "a..b", "bad name", "", "store://run@1", "x" * 201):
        with pytest.raises(ValueError, match="bad adapter name"):
            check_adapter_name(bad)


def test_parse_version_uri():
    assert parse_version_uri("s3://b/runs/r1/adapters/v1000000/") == ("s3://b/runs", "r1", 1000000)
    assert parse_version_uri("file:///x/r1/adapters/v000007") == ("file:///x", "r1", 7)
    assert parse_version_uri("file:///x/r1/adapters/v7") is None
    assert parse_version_uri("file:///x/a..b/adapters/v000007") is None


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("r1@7", ("r1", 7)),
        ("r1@latest", ("r1", None)),
        ("r1", ("r1", None)),
        ("r1-v000007", ("r1", 7)),
        ("r1-v1000000", ("r1", 1000000)),
        ("grpo.qwen-0.5b@12", ("grpo.qwen-0.5b", 12)),
        ("r1@best", ("r1", "best")),
        ("r1@release-1.0", ("r1", "release-1.0")),
    ],
)
def test_parse_adapter_spec(spec, expected):
    assert parse_adapter_spec(spec) == expected


@pytest.mark.parametrize("spec", ["", "@3", "r1@", "r1@-1", "../x@1", "a/b", "r1@../x", "r1@a/b", "r1@.x", "r1@a..b"])
def test_parse_adapter_spec_rejects(spec):
    with pytest.raises(StoreError):
        parse_adapter_spec(spec)


@pytest.mark.parametrize("bad", ["../x", "a/b", "", "..", "a..b", ".hidden", "x" * 129])
def test_validate_run_id_rejects(bad):
    with pytest.raises(StoreError, match="invalid run id"):
        validate_run_id(bad)


def test_validate_run_id_accepts():
    assert validate_run_id("grpo-qwen_0.5b.v2") == "grpo-qwen_0.5b.v2"


# ----------------------------------------------------------------- io


def test_safetensors_bytes_roundtrip_through_the_folder_reader(tmp_path):
    tensors = small_lora(seed=3)
    data = safetensors_bytes(tensors)
    assert safetensors_shapes(data) == {k: list(v.shape) for k, v in tensors.items()}
    (tmp_path / "adapter_model.safetensors").write_bytes(data)
    (tmp_path / "adapter_config.json").write_text(json.dumps(SMALL_CONFIG))
    got, config = read_adapter_folder(str(tmp_path))
    assert config == SMALL_CONFIG and all(torch.equal(got[k], tensors[k]) for k in tensors)
    assert peft_folder(str(tmp_path)) == str(tmp_path)


def test_read_adapter_folder_errors_name_the_file_and_the_fix(tmp_path):
    (tmp_path / "adapter_model.bin").write_bytes(b"pickle")
    with pytest.raises(StoreError, match=r"pickle files \['adapter_model.bin'\] refused; .*safe_serialization=True"):
        read_adapter_folder(str(tmp_path))
    (tmp_path / "adapter_model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json")
    with pytest.raises(StoreError, match=r"missing .*adapter_config.json: an adapter folder needs"):
        read_adapter_folder(str(tmp_path))
    (tmp_path / "adapter_config.json").write_text("{")
    with pytest.raises(StoreError, match=r"adapter_config.json is not valid JSON"):
        read_adapter_folder(str(tmp_path))
    (tmp_path / "adapter_config.json").write_text("{}")
    with pytest.raises(StoreError, match=r"adapter_model.safetensors is not a safetensors file"):
        read_adapter_folder(str(tmp_path))


def test_refuse_pickles():
    refuse_pickles(["adapter_model.safetensors", "adapter_config.json", "README.md"], "x")
    with pytest.raises(StoreError, match=r"x: pickle files \['a.pt', 'b.ckpt'\] refused"):
        refuse_pickles(["b.ckpt", "ok.json", "a.pt"], "x")


def test_peft_folder_of_a_store_version_is_its_data_folder(tmp_path):
    version = tmp_path / "r1/adapters/v000001"
    version.mkdir(parents=True)
    (version / "manifest.json").write_text(json.dumps({"data_dir": "abc-123"}))
    assert peft_folder(str(version)) == f"{version}/abc-123"
    (version / "manifest.json").write_text(json.dumps({"data_dir": "../elsewhere"}))
    with pytest.raises(StoreError, match="unsafe data folder"):
        peft_folder(str(version))


# ----------------------------------------------------------------- validation


def test_check_finite():
    check_finite({"a": torch.ones(2), "i": torch.tensor([1, 2])})
    check_finite({"big": torch.full((4,), 3e38)})  # the sum overflows to inf, the values are finite
    with pytest.raises(StoreError, match=r"tensor 'b' has NaN or inf values"):
        check_finite({"a": torch.ones(2), "b": torch.tensor([1.0, float("inf")])}, "w")
    with pytest.raises(StoreError, match=r"'x' is a list, not a tensor"):
        check_finite({"x": [1.0]})


def test_rules_check_tensors_names_the_file_and_the_fix():
    rules = AdapterRules.for_model(tiny_base(), max_rank=1)
    with pytest.raises(
        StoreError, match=r"^adapter_config.json: r = 2 exceeds the engine's maximum LoRA rank 1; start the engine"
    ):
        rules.check_tensors(small_lora(), SMALL_CONFIG)
    with pytest.raises(StoreError, match=r"^/f/adapter_model.safetensors: tensor .* has NaN"):
        rules.check_tensors({k: v * float("nan") for k, v in small_lora().items()}, SMALL_CONFIG, "/f")


def test_adaptable_module_names_see_through_injected_lora():
    base_names = adaptable_module_names(tiny_base())
    assert "model.layers.0.self_attn.q_proj" in base_names and "lm_head" in base_names
    assert "model.embed_tokens" in base_names  # LoRA adapts embeddings too
    assert "model.embed_tokens" not in adaptable_module_names(tiny_base(), linear_only=True)
    wrapped = get_peft_model(tiny_base(), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "embed_tokens"]))
    assert adaptable_module_names(wrapped) == base_names
    assert "lm_head" not in linear_suffixes(tiny_base())  # lora.py: the same list, output head left out
    assert set(linear_suffixes(tiny_base())) == {
        n.rsplit(".", 1)[-1] for n in adaptable_module_names(tiny_base(), linear_only=True) if n != "lm_head"
    }


def test_safetensors_bytes_are_what_safetensors_save_makes_and_leave_no_temp_file(tmp_path, monkeypatch):
    """Written through a temporary file (its writer releases the interpreter lock), the bytes are those of
    `safetensors.torch.save`, with PEFT's `{"format": "pt"}` header metadata or none, and the file is gone."""
    import tempfile

    from safetensors.torch import save

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    tensors = {"a.lora_A.weight": torch.randn(4, 8), "b": torch.randn(3).to(torch.bfloat16), "c": torch.arange(5)}
    assert safetensors_bytes(tensors) == save(tensors, metadata={"format": "pt"})
    assert safetensors_bytes(tensors, metadata=None) == save(tensors)
    assert list(tmp_path.iterdir()) == []


def test_safetensors_bytes_without_a_writable_temp_folder_are_made_in_memory(tmp_path, monkeypatch):
    import tempfile

    from safetensors.torch import save

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "does-not-exist"))
    tensors = {"a.lora_A.weight": torch.randn(4, 8)}
    assert safetensors_bytes(tensors) == save(tensors, metadata={"format": "pt"})


def test_safetensors_bytes_when_the_temp_file_cannot_be_written_are_made_in_memory(tmp_path, monkeypatch):
    """A full temporary folder: safetensors' writer raises its own `SafetensorError` (not an OSError)."""
    import tempfile

    import safetensors.torch
    from safetensors import SafetensorError

    def full_disk(*args, **kwargs):
        raise SafetensorError("Error while serializing: File too large (os error 27)")

    monkeypatch.setattr(safetensors.torch, "save_file", full_disk)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    tensors = {"a.lora_A.weight": torch.randn(4, 8)}
    assert safetensors_bytes(tensors, metadata=None) == safetensors.torch.save(tensors)
    assert list(tmp_path.iterdir()) == []
