"""AdapterStore against damaged and untrusted stores: truncated or missing files, malicious manifests, size
limits, symlinks, garbage weights, and tensors or configs that are not the configured LoRA (split from
`test_store.py`)."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import pytest
import torch

from lora_rl_core.adapters import AdapterRules
from lora_rl_core.errors import StoreError
from lora_rl_core.store import AdapterStore
from tests.support.store_adapters import BASE, SMALL_CONFIG, SMALL_KEY, small_lora, tiny_base
from tests.support.store_adapters import publish_small as _pub
from tests.support.store_adapters import version_files as _files


@pytest.fixture
def store(tmp_path: Path) -> AdapterStore:
    return AdapterStore(f"file://{tmp_path}/runs")


# ----------------------------------------------------------------- integrity


def test_truncated_file_is_reported_with_its_path_and_previous_version_still_loads(store, tmp_path):
    _pub(store, 1)
    _pub(store, 2)
    stored = _files(tmp_path, store, 2) / "adapter_model.safetensors"
    size = stored.stat().st_size
    stored.write_bytes(stored.read_bytes()[: size // 2])
    message = re.escape(f"file://{stored} is {size // 2} bytes but its manifest says {size} (truncated or replaced)")
    for call in (lambda: store.load_tensors("r1", 2), lambda: store.verify("r1", 2)):
        with pytest.raises(StoreError, match=message):
            call()
    tensors, _ = store.load_tensors("r1", 1)
    assert torch.equal(tensors[SMALL_KEY.format(0, "q_proj", "A")], small_lora(1)[SMALL_KEY.format(0, "q_proj", "A")])


def test_missing_file_is_reported(store, tmp_path):
    _pub(store, 1)
    stored = _files(tmp_path, store, 1) / "adapter_config.json"
    stored.unlink()
    with pytest.raises(StoreError, match=re.escape(f"file://{stored} is missing; adapter r1@1 is corrupt")):
        store.pull("r1", 1, tmp_path / "out")
    assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------- untrusted input


def _edit_manifest(tmp_path: Path, edit, version: int = 1) -> None:
    path = tmp_path / f"runs/r1/adapters/v{version:06d}/manifest.json"
    manifest = json.loads(path.read_text())
    edit(manifest)
    path.write_text(json.dumps(manifest))


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda m: m["files"].update({"weights.bin": {"sha256": "0" * 64, "size": 1}}), "pickle file 'weights.bin'"),
        (lambda m: m["files"].update({"notes.txt": {"sha256": "0" * 64, "size": 1}}), "file 'notes.txt' refused"),
        (lambda m: m["files"].update({"a/b.json": {"sha256": "0" * 64, "size": 1}}), "unsafe file name 'a/b.json'"),
        (lambda m: m.update(data_dir="../../r2"), r"unsafe data_dir '../../r2'"),
        (lambda m: m.update(version=5), r"describes another adapter \(r1-v000005\)"),
        (lambda m: m.pop("files"), "manifest.json is malformed: Field required"),
    ],
)
def test_malicious_manifests_are_refused(store, tmp_path, edit, message):
    _pub(store, 1)
    _edit_manifest(tmp_path, edit)
    with pytest.raises(StoreError, match=message):
        store.load_tensors("r1", 1)


def test_size_limits(tmp_path):
    small = AdapterStore(f"file://{tmp_path}/runs", max_file_bytes=200)
    with pytest.raises(
        StoreError, match=r"adapter_model.safetensors is \d+ bytes, over the store's limit of 200 bytes"
    ):
        _pub(small, 1)
    assert small.versions("r1") == []
    _pub(AdapterStore(f"file://{tmp_path}/runs"), 1)
    with pytest.raises(
        StoreError, match=r"adapter_model.safetensors is \d+ bytes, over .* 200 bytes \(max_file_bytes\)"
    ):
        small.load_tensors("r1", 1)


def test_symlinks_are_refused(store, tmp_path):
    folder = tmp_path / "saved"
    folder.mkdir()
    real = tmp_path / "elsewhere.safetensors"
    from safetensors.torch import save_file

    save_file(small_lora(), real)
    (folder / "adapter_model.safetensors").symlink_to(real)
    (folder / "adapter_config.json").write_text(json.dumps(SMALL_CONFIG))
    with pytest.raises(StoreError, match=r"adapter_model.safetensors is a symbolic link; publish_folder takes plain"):
        store.publish_folder("r1", 1, folder, step=1, base_model=BASE)
    _pub(store, 1)
    stored = _files(tmp_path, store, 1) / "adapter_config.json"
    stored.unlink()
    stored.symlink_to(folder / "adapter_config.json")
    with pytest.raises(
        StoreError, match=re.escape(f"file://{stored} is a symbolic link; the store must hold plain files")
    ):
        store.load_tensors("r1", 1)
    (tmp_path / "target").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "target")
    with pytest.raises(StoreError, match="cannot pull into .*link: it is a symbolic link"):
        store.pull("r1", 1, tmp_path / "link")


def test_garbage_weights_are_not_safetensors(store, tmp_path):
    _pub(store, 1)
    stored = _files(tmp_path, store, 1) / "adapter_model.safetensors"
    garbage = b"\x80\x04\x95pickle bytes, not safetensors"
    stored.write_bytes(garbage)
    _edit_manifest(
        tmp_path,
        lambda m: m["files"]["adapter_model.safetensors"].update(
            sha256=hashlib.sha256(garbage).hexdigest(), size=len(garbage)
        ),
    )
    with pytest.raises(StoreError, match=r"adapter_model.safetensors is not a safetensors file \(or is truncated\)"):
        store.pull("r1", 1, tmp_path / "out")


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({**SMALL_CONFIG, "r": 0}, r"r \(the LoRA rank\) must be a positive integer, got 0"),
        ({**SMALL_CONFIG, "lora_alpha": -1}, "lora_alpha must be a positive number, got -1"),
        ({**SMALL_CONFIG, "target_modules": []}, "target_modules must be a non-empty list"),
        ({**SMALL_CONFIG, "target_modules": "(q_proj"}, "target_modules '\\(q_proj' is not a valid regex"),
        ({**SMALL_CONFIG, "peft_type": "IA3"}, "peft_type 'IA3' is not LORA"),
        ({**SMALL_CONFIG, "target_modules": ["q_proj"]}, "which target_modules does not name"),
        ({**SMALL_CONFIG, "r": 4}, r"has shape \[2, 8\], but rank r = 4 needs dim 0 = 4"),
    ],
)
def test_publish_validates_config_and_tensors(store, config, message):
    with pytest.raises(StoreError, match=message):
        _pub(store, 1, adapter_config=config)
    assert store.versions("r1") == []


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda t: t.pop(SMALL_KEY.format(0, "q_proj", "B")), "has a lora_A without its lora_B"),
        (lambda t: t.update({"base_model.model.lm_head.weight": torch.ones(2, 2)}), "is not a LoRA weight"),
        (
            lambda t: t.update(
                {"base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector": torch.ones(8)}
            ),
            "is a DoRA magnitude vector but use_dora is not set",
        ),
        (lambda t: t.clear(), "holds no tensors"),
    ],
)
def test_publish_refuses_tensors_that_are_not_the_configured_lora(store, edit, message):
    tensors = small_lora()
    edit(tensors)
    with pytest.raises(StoreError, match=message):
        store.publish("r1", 1, tensors=tensors, adapter_config=SMALL_CONFIG, step=1, base_model=BASE)


def test_load_tensors_checks_engine_rules(store):
    _pub(store, 1)
    base = tiny_base()
    store.load_tensors("r1", 1, rules=AdapterRules.for_model(base, max_rank=8))
    with pytest.raises(StoreError, match=r"adapter_config.json: r = 2 exceeds the engine's maximum LoRA rank 1"):
        store.load_tensors("r1", 1, rules=AdapterRules.for_model(base, max_rank=1))
    rules = AdapterRules(base_module_names=("model.layers.0.mlp.up_proj",))
    with pytest.raises(
        StoreError, match=r"target_modules \['q_proj', 'v_proj'\] not found among the base model's adaptable"
    ):
        store.load_tensors("r1", 1, rules=rules)
    dora = {**SMALL_CONFIG, "use_dora": True}
    _pub(store, 2, adapter_config=dora)
    with pytest.raises(StoreError, match=r"DoRA adapters \(use_dora: true\) are not supported by this engine"):
        store.load_tensors("r1", 2, rules=AdapterRules.for_model(base))
    store.load_tensors("r1", 2, rules=AdapterRules.for_model(base, allow_dora=True))


def test_bad_version_numbers_are_refused(store):
    for bad in (-1, True, 10**12, "3"):
        with pytest.raises(StoreError, match="invalid adapter version"):
            store.manifest("r1", bad)
