"""Shared fixtures: a tiny random Llama model with a character-level chat tokenizer, saved to disk.

And the check that no test leaves a process behind (`tests.support.processes`): every fixture wider than a
test owns the processes it started until its teardown; after each test any other live descendant of pytest,
member of a process group a test started, or orphan marked with this run in its environment is ended and
fails that test's teardown; the same check runs once more when the session ends.
"""

from __future__ import annotations

import os

# Before torch loads OpenMP, as the `lora-rl` command does (`lora_rl_core.runtime`, "OpenMP waiting").
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import string
from pathlib import Path

import pytest
import torch

from tests.support import processes

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tiny_model_dir(path: Path, *, seed: int = 0, layers: int = 2) -> Path:
    """Write a tiny random LlamaForCausalLM (fp32) and a character-level tokenizer with a chat template."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    specials = ["<pad>", "<|im_start|>", "<|im_end|>", "<unk>"]
    chars = sorted(set(string.digits + string.ascii_letters + " +-*/=#?.,:\n"))
    vocab = {tok: i for i, tok in enumerate(specials + chars)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"<\|im_start\|>|<\|im_end\|>|."), behavior="isolated")
    backend.add_special_tokens(specials)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token="<|im_end|>", unk_token="<unk>"
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        pad_token_id=0,
        bos_token_id=None,
        eos_token_id=vocab["<|im_end|>"],
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(config)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Folder of a tiny random Llama + tokenizer, built once per test session."""
    return build_tiny_model_dir(tmp_path_factory.mktemp("tiny-model"))


# ----------------------------------------------------------------------------- no process outlives its test
def pytest_configure(config: pytest.Config) -> None:
    # A plugin, not hooks of this conftest: conftest hooks skip session-scoped fixtures (their node is the
    # session, above tests/), and the processes those start must be seen.
    config.pluginmanager.register(processes.LeakCheckPlugin(), "no-leftover-processes")
