"""LoRA target resolution, adapter wrapping and adapter state export on the tiny Llama."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from lora_rl_core.config import LoRAConfig
from lora_rl_core.errors import ConfigError
from lora_rl_core.lora import adapter_state, apply_lora, linear_suffixes, resolve_target_modules

LLAMA_LINEARS = ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]


@pytest.fixture
def base(tiny_model_dir):
    """A fresh tiny model per test: `apply_lora` modifies the model it wraps."""
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)


def test_linear_suffixes_are_the_llama_projections(base):
    assert linear_suffixes(base) == LLAMA_LINEARS
    assert "lm_head" not in linear_suffixes(base)


def test_resolve_all_linear(base):
    assert sorted(resolve_target_modules(base, LoRAConfig())) == LLAMA_LINEARS


def test_resolve_list(base):
    assert resolve_target_modules(base, LoRAConfig(target_modules=["q_proj", "v_proj"])) == ["q_proj", "v_proj"]


def test_resolve_exclude(base):
    chosen = resolve_target_modules(base, LoRAConfig(exclude_modules=["gate_proj", "up_proj", "down_proj"]))
    assert sorted(chosen) == ["k_proj", "o_proj", "q_proj", "v_proj"]


def test_unknown_target_lists_existing_names(base):
    with pytest.raises(ConfigError) as err:
        resolve_target_modules(base, LoRAConfig(target_modules=["q_proj", "qkv_proj"]))
    msg = str(err.value)
    assert "lora.target_modules" in msg and "qkv_proj" in msg
    assert all(name in msg for name in LLAMA_LINEARS)


def test_unknown_exclude_is_an_error(base):
    with pytest.raises(ConfigError, match="lora.exclude_modules.*lm_head"):
        resolve_target_modules(base, LoRAConfig(exclude_modules=["lm_head"]))


def test_excluding_everything_is_an_error(base):
    with pytest.raises(ConfigError, match="nothing left to adapt"):
        resolve_target_modules(base, LoRAConfig(target_modules=["q_proj"], exclude_modules=["q_proj"]))


def test_apply_lora_trains_only_lora_and_starts_as_noop(base):
    ids = torch.randint(0, base.config.vocab_size, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = base(input_ids=ids).logits
    model = apply_lora(base, LoRAConfig(rank=4))
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    assert len(trainable) == 2 * 7 * base.config.num_hidden_layers  # A and B per adapted module
    with torch.no_grad():
        after = model(input_ids=ids).logits
    torch.testing.assert_close(after, before)


def test_lora_weights_are_float32_on_bf16_base(tiny_model_dir):
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16)
    model = apply_lora(base, LoRAConfig(rank=4))
    dtypes = {p.dtype for n, p in model.named_parameters() if "lora_" in n}
    assert dtypes == {torch.float32}
    assert model.base_model.model.model.layers[0].self_attn.q_proj.base_layer.weight.dtype == torch.bfloat16


def test_rslora_and_gaussian_init_reach_peft(base):
    model = apply_lora(base, LoRAConfig(rank=4, alpha=8, use_rslora=True, init="gaussian"))
    peft_cfg = model.peft_config["default"]
    assert peft_cfg.use_rslora is True
    assert peft_cfg.init_lora_weights == "gaussian"
    q_proj = model.base_model.model.model.layers[0].self_attn.q_proj
    assert q_proj.scaling["default"] == pytest.approx(8 / math.sqrt(4))


def test_adapter_state_matches_peft_save_format(base, tmp_path):
    model = apply_lora(base, LoRAConfig(rank=4, target_modules=["q_proj", "v_proj"]))
    tensors, config = adapter_state(model)
    assert all(k.endswith((".lora_A.weight", ".lora_B.weight")) for k in tensors)
    assert not any(".default." in k for k in tensors)
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in tensors
    assert len(tensors) == 2 * 2 * base.config.num_hidden_layers
    model.save_pretrained(tmp_path)
    assert set(load_file(tmp_path / "adapter_model.safetensors")) == set(tensors)
    assert json.loads(json.dumps(config)) == config
    assert config["r"] == 4 and sorted(config["target_modules"]) == ["q_proj", "v_proj"]


def test_adapter_state_is_a_detached_copy(base):
    model = apply_lora(base, LoRAConfig(rank=4, target_modules=["q_proj"]))
    tensors, _ = adapter_state(model)
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    tensors[key].zero_()
    assert model.base_model.model.model.layers[0].self_attn.q_proj.lora_A["default"].weight.abs().sum() > 0
    assert not tensors[key].requires_grad
