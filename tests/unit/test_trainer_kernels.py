"""`trainer.liger_kernels`: where Liger's fused kernels go on, and the clear refusals of `true` where they cannot.

Liger's Triton kernels need a GPU: their numerics are checked in `tests/gpu/test_liger_kernels.py`. Here the
choice (`choose_kernels`) and the refusal before any worker starts (`open_run`)."""

from __future__ import annotations

import importlib.util
import sys
import types

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
    def missing() -> frozenset[str]:
        raise ImportError("liger-kernel is not installed (`pip install 'lora-rl[gpu]'` or `pip install liger-kernel`)")

    monkeypatch.setattr(kernels, "liger_model_types", missing)


def test_auto_is_on_for_a_supported_family_on_cuda(liger_installed):
    choice = choose_kernels("auto", "cuda:0", "qwen2")
    assert choice.enabled and choice.reason.startswith("auto: ")
    assert choose_kernels(True, "cuda", "llama").enabled


@pytest.mark.parametrize(
    ("device", "model_type", "fixture", "names"),
    [
        ("cpu", "qwen2", "liger_installed", "the trainer is on cpu"),
        ("cuda", "qwen2", "liger_missing", "liger-kernel is not installed"),
        ("cuda", "gemma", "liger_installed", "not used for model_type 'gemma'"),
    ],
    ids=["cpu", "not-installed", "unsupported-family"],
)
def test_auto_is_off_and_true_is_refused_where_liger_cannot_run(request, device, model_type, fixture, names):
    request.getfixturevalue(fixture)
    choice = choose_kernels("auto", device, model_type)
    assert not choice.enabled and names in choice.reason
    with pytest.raises(ConfigError, match="trainer.liger_kernels=true") as err:
        choose_kernels(True, device, model_type)
    assert names in str(err.value) and "trainer.liger_kernels=auto or false" in str(err.value)


def test_false_is_off_everywhere(liger_installed):
    assert not choose_kernels(False, "cuda", "qwen2").enabled


def test_auto_on_a_cpu_never_imports_liger(monkeypatch):
    monkeypatch.setattr(kernels, "liger_model_types", lambda: pytest.fail("liger-kernel was imported on a CPU"))
    assert not choose_kernels("auto", "cpu", "qwen2").enabled


def test_the_real_lookup_says_why_liger_is_unusable_here():
    """CI has no liger-kernel: the real lookup raises ImportError with the fix, and `auto` says it."""
    if importlib.util.find_spec("liger_kernel") is not None:
        pytest.skip("liger-kernel is installed here")
    with pytest.raises(ImportError, match="pip install 'lora-rl\\[gpu\\]'"):
        kernels.liger_model_types()
    assert "liger-kernel is not installed" in choose_kernels("auto", "cuda", "qwen2").reason


def test_only_the_instance_is_patched(tiny_model_dir, liger_installed, monkeypatch):
    """Liger rebinds names in transformers' module of the family for the whole process; `apply_kernels` puts
    them back, so only the given model changes (a stand-in for Liger's patch function: the real one needs a GPU).
    """
    from transformers import AutoModelForCausalLM
    from transformers.models.llama import modeling_llama

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    originals = {name: getattr(modeling_llama, name) for name in ("LlamaRMSNorm", "LlamaMLP", "apply_rotary_pos_emb")}
    seen = {}

    def fake_patch(model, **kwargs):  # what Liger's apply_liger_kernel_to_llama(model=...) does, in kind
        seen.update(kwargs)
        modeling_llama.LlamaRMSNorm = type("LigerRMSNorm", (), {})
        modeling_llama.LlamaMLP = type("LigerSwiGLUMLP", (), {})
        model.model.norm.forward = lambda x: x

    fake = types.ModuleType("liger_kernel.transformers")
    fake._apply_liger_kernel_to_instance = fake_patch  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers", fake)
    kernels.apply_kernels(model, True)
    assert {name: getattr(modeling_llama, name) for name in originals} == originals
    assert "forward" in vars(model.model.norm)  # the instance keeps its patch
    assert seen == kernels.PATCHED and not seen["fused_linear_cross_entropy"]


def test_auto_on_a_cpu_leaves_the_model_unpatched(tiny_model_dir):
    from lora_rl_core.models import load_model

    cfg = RunConfig.model_validate({"model": {"name_or_path": str(tiny_model_dir)}})
    model, _ = load_model(cfg.model)
    before = {name: type(m).forward for name, m in model.named_modules()}
    assert kernels.choose_kernels("auto", "cpu", model.config.model_type).enabled is False
    kernels.apply_kernels(model, False)
    assert {name: type(m).forward for name, m in model.named_modules()} == before
    assert not any("forward" in vars(m) for m in model.modules())  # no forward bound on an instance


def test_true_on_cpu_workers_is_refused_before_the_run_builds_anything(tmp_path, tiny_model_dir, monkeypatch):
    cfg = RunConfig.model_validate(
        {
            "model": {"name_or_path": str(tiny_model_dir)},
            "trainer": {"backend": {"type": "local", "world_size": 2, "device": "cpu"}, "liger_kernels": True},
            "store": {"uri": f"file://{tmp_path}/store"},
        }
    )
    monkeypatch.setattr(components, "TrainerWorkers", lambda *a, **k: pytest.fail("a worker was started"))
    monkeypatch.setattr(components, "build_engine", lambda *a, **k: pytest.fail("an engine was built"))
    with pytest.raises(ConfigError, match="trainer.liger_kernels=true but the trainer is on cpu"):
        components.open_run(cfg, "liger-cpu")
    assert not (tmp_path / "store").exists()  # not even run.json: nothing written


def test_the_run_records_what_it_resolved_and_hands_the_trainer_a_bool(tiny_model_dir):
    cfg = RunConfig.model_validate(
        {"model": {"name_or_path": str(tiny_model_dir)}, "trainer": {"liger_kernels": "auto"}}
    )
    from lora_rl_core.plan import make_plan

    plan = make_plan(cfg)
    choice = plan.choices["trainer.liger_kernels"]
    assert choice.value is False and choice.reason.startswith("auto: off, the trainer is on cpu")
    assert plan.trainer is not None and plan.trainer.liger_kernels is False


def test_off_by_default(liger_installed):
    assert RunConfig().trainer.liger_kernels is False
    assert not choose_kernels(RunConfig().trainer.liger_kernels, "cuda", "qwen2").enabled


# ------------------------------------------------------------------ trainer.torch_compile


def test_compile_auto_is_on_only_for_an_in_process_trainer_on_cuda():
    assert kernels.choose_compile("auto", "cuda:0", 0).enabled
    assert kernels.choose_compile(True, "cuda", 0).reason.startswith("each decoder layer compiled")
    off_cpu, off_ranks = kernels.choose_compile("auto", "cpu", 0), kernels.choose_compile("auto", "cuda", 2)
    assert not off_cpu.enabled and "the trainer is on cpu" in off_cpu.reason
    assert not off_ranks.enabled and "2 FSDP2 ranks" in off_ranks.reason
    assert not kernels.choose_compile(False, "cuda", 0).enabled


@pytest.mark.parametrize(("device", "ranks", "names"), [("cpu", 0, "on cpu"), ("cuda", 4, "4 FSDP2 ranks")])
def test_compile_true_is_refused_where_it_is_not_built_for(device, ranks, names):
    with pytest.raises(ConfigError, match="trainer.torch_compile=true but") as err:
        kernels.choose_compile(True, device, ranks)
    assert names in str(err.value) and "trainer.torch_compile=auto or false" in str(err.value)


def test_compile_layers_wraps_every_decoder_layer_and_nothing_else(tiny_model_dir):
    """Each decoder layer gets its compiled call (regional compilation); the embeddings, final norm and head
    stay eager. Compilation itself happens at the first forward (checked on a GPU: tests/gpu/test_torch_compile.py)."""
    from transformers import AutoModelForCausalLM

    from lora_rl_core.config import LoRAConfig
    from lora_rl_core.lora import apply_lora

    model = apply_lora(AutoModelForCausalLM.from_pretrained(tiny_model_dir), LoRAConfig(rank=4))
    layers = model.get_base_model().model.layers
    assert kernels.compile_layers(model) == len(layers) > 0
    compiled = {name for name, m in model.named_modules() if getattr(m, "_compiled_call_impl", None) is not None}
    assert compiled == {f"base_model.model.model.layers.{i}" for i in range(len(layers))}


def test_compile_true_on_a_cpu_run_is_refused_before_anything_is_built(tmp_path, tiny_model_dir):
    cfg = RunConfig.model_validate(
        {
            "model": {"name_or_path": str(tiny_model_dir)},
            "trainer": {"torch_compile": True},
            "store": {"uri": f"file://{tmp_path}/store"},
        }
    )
    with pytest.raises(ConfigError, match="trainer.torch_compile=true but the trainer is on cpu"):
        components.open_run(cfg, "compile-cpu")
    assert not (tmp_path / "store").exists()
