"""dtype `auto` (the model's and the LoRA compute's) and CPU thread rules (`lora_rl_core.runtime`), and where
the choice is reported."""

from __future__ import annotations

import json
import logging
import os
import platform
import sys
from pathlib import Path

import pytest
import torch

from lora_rl_core import runtime
from lora_rl_core.config import ModelConfig, RunConfig, load_config
from lora_rl_core.errors import ConfigError
from lora_rl_core.models import model_dtype
from lora_rl_core.plan import make_plan
from lora_rl_core.progress import format_runtime
from lora_rl_core.report import run_summary, summary_markdown
from tests.support import processes

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def native_bf16(monkeypatch: pytest.MonkeyPatch):
    def set_native(value: bool) -> None:
        monkeypatch.setattr(runtime, "cpu_has_native_bf16", lambda: value)
        monkeypatch.setattr(runtime, "_warned", set())

    return set_native


def test_auto_is_float32_on_a_cpu_without_native_bf16(native_bf16) -> None:
    native_bf16(False)
    choice = runtime.choose_dtype("auto", "cpu")
    assert (choice.name, choice.torch_dtype) == ("float32", torch.float32)
    assert "no native bfloat16" in choice.reason and torch.backends.cpu.get_cpu_capability() in choice.reason


def test_auto_is_bfloat16_on_a_cpu_with_native_bf16_and_on_cuda(native_bf16) -> None:
    native_bf16(True)
    assert runtime.choose_dtype("auto", "cpu").name == "bfloat16"
    native_bf16(False)
    cuda = runtime.choose_dtype("auto", "cuda:0")
    assert cuda.name == "bfloat16" and "cuda" in cuda.reason


def test_explicit_bf16_on_an_emulating_cpu_is_kept_and_warns_once(native_bf16, caplog) -> None:
    native_bf16(False)
    with caplog.at_level(logging.WARNING, logger="lora_rl_core.runtime"):
        first = runtime.choose_dtype("bfloat16", "cpu")
        second = runtime.choose_dtype("bfloat16", "cpu")
    assert first.name == second.name == "bfloat16"
    warnings = [r for r in caplog.records if "without native bfloat16" in r.getMessage()]
    assert len(warnings) == 1 and "float32" in warnings[0].getMessage()


def test_explicit_dtypes_pass_through_and_unknown_ones_fail(native_bf16) -> None:
    native_bf16(False)
    assert runtime.choose_dtype("float32", "cpu").name == "float32"
    assert runtime.choose_dtype("float16", "cuda").name == "float16"
    with pytest.raises(ValueError, match="model.dtype 'int8'"):
        runtime.choose_dtype("int8", "cpu")


def test_model_config_defaults_to_auto_and_model_dtype_resolves_it(native_bf16) -> None:
    native_bf16(False)
    assert ModelConfig().dtype == "auto"
    assert model_dtype(ModelConfig(device="cpu")).name == "float32"


def test_threads_come_from_affinity_unless_overridden(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(runtime.THREADS_ENV, raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(runtime.os, "sched_getaffinity", lambda pid: {0, 3, 5}, raising=False)
    assert runtime.cpu_threads() == 3
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert runtime.cpu_threads() == 2
    monkeypatch.setenv(runtime.THREADS_ENV, "1")
    assert runtime.cpu_threads() == 1  # ours wins over OpenMP's
    monkeypatch.setenv(runtime.THREADS_ENV, "zero")
    with pytest.raises(ValueError, match="LORA_RL_NUM_THREADS='zero' must be a positive integer"):
        runtime.cpu_threads()


def test_configure_threads_sets_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    before = torch.get_num_threads()
    monkeypatch.setenv(runtime.THREADS_ENV, "1")
    try:
        assert runtime.configure_threads() == 1
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


@pytest.mark.skipif(sys.platform != "linux" or platform.libc_ver()[0] != "glibc", reason="glibc's mallopt only")
def test_configure_allocator_sets_glibc_malloc_unless_the_environment_does(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("GLIBC_TUNABLES", *runtime._MALLOC_ENV):
        monkeypatch.delenv(var, raising=False)
    assert runtime.configure_allocator() is True  # mallopt accepted every setting
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.mmap_threshold=131072")
    assert runtime.configure_allocator() is False  # the user's tunables win
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.cpu.hwcaps=-AVX2")  # not malloc's: ours apply
    assert runtime.configure_allocator() is True
    monkeypatch.delenv("GLIBC_TUNABLES")
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "0")
    assert runtime.configure_allocator() is False


def _last_line_of(code: str, omp_wait_policy: str | None) -> str:
    """Run `code` in a fresh interpreter with `OMP_WAIT_POLICY` set to `omp_wait_policy` (None: unset); the last
    line it prints."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}  # conftest sets it in this process
    if omp_wait_policy is not None:
        env["OMP_WAIT_POLICY"] = omp_wait_policy
    proc = processes.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout.strip().splitlines()[-1]


@pytest.mark.slow  # a fresh interpreter
def test_importing_the_library_leaves_openmp_waiting_unset() -> None:
    code = "import os, lora_rl_core, lora_rl_core.runtime; print(os.environ.get('OMP_WAIT_POLICY'))"
    assert _last_line_of(code, None) == "None"


@pytest.mark.slow  # a fresh interpreter
@pytest.mark.parametrize(("given", "expected"), [(None, "PASSIVE"), ("ACTIVE", "ACTIVE")])
def test_the_cli_makes_openmp_threads_passive_unless_set(given: str | None, expected: str) -> None:
    # main() with its app replaced by a probe: the environment when a command starts, and torch not loaded yet
    code = (
        "import os, sys, cli.main as m\n"
        "m.app = lambda **_: print(os.environ.get('OMP_WAIT_POLICY'), 'torch' in sys.modules)\n"
        "m.main()"
    )
    assert _last_line_of(code, given) == f"{expected} False"


def test_report_names_the_dtype_and_why() -> None:
    rt = {"device": "cpu", "dtype": "float32", "dtype_reason": "auto: float32, no native bf16", "cpu_threads": 2}
    summary = run_summary("r", [], None, None, "r-v000000", 1.0, "file://x", rt)
    assert summary["runtime"] == rt
    text = summary_markdown("r", RunConfig(), summary)
    assert "- compute: cpu, float32 (auto: float32, no native bf16); 2 CPU threads" in text


def test_lora_compute_auto_is_bfloat16_only_on_cuda_over_bfloat16_weights() -> None:
    choose = runtime.choose_lora_compute_dtype
    assert choose("auto", "cuda:0", "bfloat16").name == "bfloat16"
    assert [choose("auto", d, b).name for d, b in [("cuda", "float32"), ("cpu", "bfloat16"), ("cpu", "float32")]] == [
        "float32"
    ] * 3
    assert "cpu" in choose("auto", "cpu", "float32").reason


def test_lora_compute_explicit_values_and_bf16_over_another_base_dtype() -> None:
    choose = runtime.choose_lora_compute_dtype
    assert choose("bfloat16", "cpu", "bfloat16").torch_dtype == torch.bfloat16  # CPU autocast
    assert choose("float32", "cuda", "bfloat16").name == "float32"
    with pytest.raises(ConfigError, match=r"trainer\.lora_compute_dtype=bfloat16 .* model\.dtype resolves to float16"):
        choose("bfloat16", "cuda", "float16")


def test_lora_compute_dtype_is_a_checked_trainer_field(native_bf16) -> None:
    native_bf16(False)
    assert load_config(None, ["trainer.lora_compute_dtype=bfloat16"]).trainer.lora_compute_dtype == "bfloat16"
    with pytest.raises(ConfigError, match=r"trainer\.lora_compute_dtype"):
        load_config(None, ["trainer.lora_compute_dtype=float16"])
    cfg = load_config(None, ["model.device=cpu"])
    info = make_plan(cfg).summary()
    assert (info["lora_compute_dtype"], info["lora_compute_dtype_reason"]) == (
        "float32",
        "auto: float32 base weights on cpu",
    )
    with pytest.raises(ConfigError, match=r"trainer\.lora_compute_dtype=bfloat16"):
        make_plan(load_config(None, ["model.device=cpu", "trainer.lora_compute_dtype=bfloat16"]))


def test_run_log_and_report_name_the_lora_compute_dtype() -> None:
    rt = {
        "device": "cuda",
        "dtype": "bfloat16",
        "dtype_reason": "auto: bfloat16 on cuda",
        "lora_compute_dtype": "bfloat16",
        "lora_compute_dtype_reason": "auto: why",
        "cpu_threads": 16,
    }
    line = "bfloat16 on cuda: auto: bfloat16 on cuda; LoRA compute bfloat16 (auto: why); 16 CPU threads"
    assert format_runtime(rt).endswith(line)
    text = summary_markdown("r", RunConfig(), run_summary("r", [], None, None, "r-v000000", 1.0, "file://x", rt))
    assert "- compute: cuda, bfloat16 (auto: bfloat16 on cuda); LoRA compute bfloat16 (auto: why); 16 CPU" in text


def test_the_plan_is_deeply_frozen_and_its_trainer_section_holds_resolved_values_only(native_bf16) -> None:
    """Issue 44, item 1: the trainer is built from resolved values (no `auto` anywhere in its section), the plan
    cannot be changed after it is made, and the trainer's section reaches ranks pickled as made."""
    import dataclasses
    import pickle

    import pydantic

    native_bf16(False)
    cfg = RunConfig(model=ModelConfig(device="cpu"))
    plan = make_plan(cfg)
    t = plan.trainer
    assert t is not None and "auto" not in json.dumps(dataclasses.asdict(t), default=str)
    assert (t.device, t.dtype) == ("cpu", "float32")
    assert t.loss.off_policy_correction.type == "none" and t.loss.clip_eps_high == cfg.algorithm.clip_eps_high
    assert pickle.loads(pickle.dumps(t)) == t
    with pytest.raises(dataclasses.FrozenInstanceError):
        t.micro_batch_size = 2  # type: ignore[misc]
    with pytest.raises(TypeError):
        plan.choices["model.dtype"] = None  # type: ignore[index]
    with pytest.raises(pydantic.ValidationError, match="frozen"):
        plan.config.algorithm.clip_eps_high = 0.5  # type: ignore[misc]


def test_the_plan_makes_the_train_phase_batch_rules_from_the_algorithm_section() -> None:
    """The train phase reads `RunPlan.batch`, never the `algorithm` section (issue 44's trace)."""
    from lora_rl_core.records import BatchRules

    default = make_plan(load_config(None, ["model.device=cpu"]), train=False).batch
    assert default == BatchRules(max_staleness=1, skip_uniform=True, mask_truncated=True, critic_sees_truncated=False)
    ppo = make_plan(
        load_config(
            None,
            [
                "model.device=cpu",
                "algorithm.advantage=gae",
                "algorithm.truncation=keep",
                "algorithm.skip_uniform_groups=false",
            ],
        ),
        train=False,
    ).batch
    assert ppo == BatchRules(max_staleness=1, skip_uniform=False, mask_truncated=False, critic_sees_truncated=True)
