"""dtype `auto` and CPU thread rules (`lora_rl_core.runtime`), and where the choice is reported."""

from __future__ import annotations

import logging

import pytest
import torch

from lora_rl_core import runtime
from lora_rl_core.config import ModelConfig, RunConfig
from lora_rl_core.models import model_dtype
from lora_rl_core.report import run_summary, summary_markdown


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


def test_importing_the_package_makes_openmp_threads_passive_unless_set(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib
    import os

    import lora_rl_core

    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    importlib.reload(lora_rl_core)
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    importlib.reload(lora_rl_core)
    assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE"  # the user's choice stays


def test_report_names_the_dtype_and_why() -> None:
    rt = {"device": "cpu", "dtype": "float32", "dtype_reason": "auto: float32, no native bf16", "cpu_threads": 2}
    summary = run_summary("r", [], None, None, "r-v000000", 1.0, "file://x", rt)
    assert summary["runtime"] == rt
    text = summary_markdown("r", RunConfig(), summary)
    assert "- compute: cpu, float32 (auto: float32, no native bf16); 2 CPU threads" in text
