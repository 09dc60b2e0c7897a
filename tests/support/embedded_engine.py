"""The embedded engine's test harness: a tiny model's engines (fixtures `make_engine`, `engine`), random LoRA
adapters for it, prompts, and ways to hold a batch mid-flight (`gated`) and watch adapter usage."""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
import torch
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
from transformers import AutoModelForCausalLM, AutoTokenizer

from lora_rl_core.engines import EmbeddedEngine, SamplingParams
from lora_rl_core.lora import peft_config_dict

GREEDY = SamplingParams(max_new_tokens=8, temperature=0.0)
A1, A2, A3 = "run-v000001", "run-v000002", "run-v000003"


@functools.cache
def _lora_template(model_dir, targets: tuple[str, ...], rank: int) -> tuple[dict, dict]:
    """Key -> shape of a LoRA state dict for the tiny model, and its PEFT config dict."""
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    peft_model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=16, target_modules=list(targets)))
    shapes = {k: v.shape for k, v in get_peft_model_state_dict(peft_model).items()}
    return shapes, peft_config_dict(peft_model.peft_config["default"])


@functools.cache
def random_adapter(model_dir, seed: int, targets=("q_proj", "v_proj", "down_proj"), rank: int = 4):
    """A LoRA adapter with random normal A and B, large enough to change greedy tokens. Cached: don't modify."""
    shapes, config = _lora_template(model_dir, tuple(targets), rank)
    gen = torch.Generator().manual_seed(seed)
    return {k: torch.randn(shape, generator=gen) for k, shape in shapes.items()}, config


def load(engine: EmbeddedEngine, name: str, model_dir, seed: int, **kw) -> None:
    tensors, config = random_adapter(model_dir, seed)
    engine.load_adapter(name, tensors=tensors, config=config, **kw)


@functools.cache
def tiny_tokenizer(model_dir):
    """The tiny model's tokenizer, cached: shared, so never modify it (load a fresh one to change it)."""
    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture()
def make_engine(tiny_model_dir) -> Iterator[Callable[..., EmbeddedEngine]]:
    engines = []

    def make(**kw) -> EmbeddedEngine:
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
        engines.append(EmbeddedEngine(model, tiny_tokenizer(tiny_model_dir), **kw))
        return engines[-1]

    yield make
    for e in engines:
        e.close()


@pytest.fixture()
def engine(make_engine):
    return make_engine(max_batch_size=64)


def prompts(tiny_model_dir, n: int) -> list[list[int]]:
    tok = tiny_tokenizer(tiny_model_dir)
    return [tok(f"What is {i} + {2 * i}?")["input_ids"][: 3 + i % 5] for i in range(n)]


def wait_until(predicate: Callable[[], bool], timeout_s: float = 3.0) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.005)
    return predicate()


@contextmanager
def gated(engine: EmbeddedEngine) -> Iterator[tuple[threading.Event, threading.Event]]:
    """Hold each forward batch after its forward pass (model lock free, adapter usage still held) until
    `gate` is set; `entered` is set when a batch reaches the gate."""
    gate, entered = threading.Event(), threading.Event()
    original = engine._model.completions

    def held(*args):
        entered.set()
        gate.wait(5.0)
        return original(*args)

    engine._model.completions = held
    try:
        yield gate, entered
    finally:
        gate.set()
        del engine._model.completions


def in_flight(engine: EmbeddedEngine, name: str) -> int:
    return engine.list_adapters()[name]["in_flight"]
