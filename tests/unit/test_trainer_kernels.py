"""`trainer.liger_kernels`: where Liger's fused kernels go on, and the clear refusals of `true` where they cannot.

Liger's Triton kernels need a GPU: their numerics are checked in `tests/gpu/test_liger_kernels.py`. Here the
choice (`choose_kernels`) and the refusal before any worker starts (`build_trainer`)."""

from __future__ import annotations

import pytest

from lora_rl_core.config import RunConfig
from lora_rl_core.errors import ConfigError
from lora_rl_core.run import components
from lora_rl_core.trainer import kernels
from lora_rl_core.trainer.kernels import choose_kernels

LIGER_FAMILIES = frozenset({"llama", "qwen2", "mistral"})


@pytest.fixture
def liger_installed(monkeypatch):
    monkeypatch.setattr(kernels, "liger_model_types", lambda: LIGER_FAMILIES)


@pytest.fixture
def liger_missing(monkeypatch):
    monkeypatch.setattr(kernels, "liger_model_types", frozenset)


def test_auto_is_on_for_a_supported_family_on_cuda(liger_installed):
    choice = choose_kernels("auto", "cuda:0", "qwen2")
    assert choice.liger and choice.reason.startswith("auto: ")
    assert choose_kernels(True, "cuda", "llama").liger


@pytest.mark.parametrize(
    ("device", "model_type", "fixture", "names"),
    [
        ("cpu", "qwen2", "liger_installed", "the trainer is on cpu"),
        ("cuda", "qwen2", "liger_missing", "liger-kernel is not installed"),
        ("cuda", "gpt2", "liger_installed", "no kernels for model_type 'gpt2'"),
    ],
    ids=["cpu", "not-installed", "unsupported-family"],
)
def test_auto_is_off_and_true_is_refused_where_liger_cannot_run(request, device, model_type, fixture, names):
    request.getfixturevalue(fixture)
    choice = choose_kernels("auto", device, model_type)
    assert not choice.liger and names in choice.reason
    with pytest.raises(ConfigError, match="trainer.liger_kernels=true") as err:
        choose_kernels(True, device, model_type)
    assert names in str(err.value) and "trainer.liger_kernels=auto or false" in str(err.value)


def test_false_is_off_everywhere(liger_installed):
    assert not choose_kernels(False, "cuda", "qwen2").liger


def test_auto_on_a_cpu_leaves_the_model_unpatched(tiny_model_dir):
    from lora_rl_core.models import load_model

    cfg = RunConfig.model_validate({"model": {"name_or_path": str(tiny_model_dir)}})
    model, _ = load_model(cfg.model)
    before = {name: type(m).forward for name, m in model.named_modules()}
    assert kernels.apply_kernels(model, "auto", "cpu").liger is False
    assert {name: type(m).forward for name, m in model.named_modules()} == before
    assert not any("forward" in vars(m) for m in model.modules())  # no forward bound on an instance


def test_true_on_cpu_workers_is_refused_before_any_worker_starts(tiny_model_dir, monkeypatch):
    cfg = RunConfig.model_validate(
        {
            "model": {"name_or_path": str(tiny_model_dir)},
            "trainer": {"world_size": 2, "device": "cpu", "liger_kernels": True},
        }
    )
    monkeypatch.setattr(components, "TrainerWorkers", lambda *a, **k: pytest.fail("a worker was started"))
    with pytest.raises(ConfigError, match="the trainer is on cpu"):
        components.build_trainer(cfg, tokenizer=None)  # type: ignore[arg-type]


def test_off_by_default(liger_installed):
    assert RunConfig().trainer.liger_kernels is False
    assert not choose_kernels(RunConfig().trainer.liger_kernels, "cuda", "qwen2").liger
