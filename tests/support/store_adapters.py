"""Adapters for the store tests: a tiny Llama base, small PEFT-named LoRA state dicts made without PEFT,
publishing them, where a version's files lie, and the racing-writers harness that the file, memory and S3
store tests share."""

from __future__ import annotations

import threading
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from lora_rl_core.errors import StoreError
from lora_rl_core.store import AdapterRef, AdapterStore

BASE = "tiny-llama"


def tiny_base() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    return LlamaForCausalLM(config)


SMALL_CONFIG = {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["q_proj", "v_proj"]}
SMALL_KEY = "base_model.model.model.layers.{}.self_attn.{}.lora_{}.weight"


def small_lora(seed: int = 0, rank: int = 2, hidden: int = 8) -> dict[str, torch.Tensor]:
    """A LoRA state dict for 2 layers x (q_proj, v_proj), PEFT key names, shapes A (r, h) and B (h, r)."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for layer in range(2):
        for module in ("q_proj", "v_proj"):
            out[SMALL_KEY.format(layer, module, "A")] = torch.randn(rank, hidden, generator=gen)
            out[SMALL_KEY.format(layer, module, "B")] = torch.randn(hidden, rank, generator=gen)
    return out


def publish_small(store: AdapterStore, version: int, seed: int | None = None, run_id: str = "r1", **kw) -> AdapterRef:
    return store.publish(
        run_id,
        version,
        tensors=kw.pop("tensors", None) or small_lora(version if seed is None else seed),
        adapter_config=kw.pop("adapter_config", SMALL_CONFIG),
        step=version,
        base_model=BASE,
        **kw,
    )


def version_files(tmp_path: Path, store: AdapterStore, version: int, run_id: str = "r1") -> Path:
    """The local folder holding a version's files (its manifest's data_dir)."""
    return tmp_path / f"runs/{run_id}/adapters/v{version:06d}" / store.manifest(run_id, version).data_dir


def race(stores: list[AdapterStore], tensors: list[dict], monkeypatch) -> tuple[list, list]:
    """Publish r1@3 from two threads that both finish their files before either creates the manifest."""
    barrier = threading.Barrier(len(stores), timeout=20)
    commit = AdapterStore._commit_manifest

    def synced_commit(self, manifest):
        barrier.wait()
        return commit(self, manifest)

    monkeypatch.setattr(AdapterStore, "_commit_manifest", synced_commit)
    results: list = [None] * len(stores)

    def run(i: int) -> None:
        try:
            results[i] = publish_small(stores[i], 3, tensors=tensors[i])
        except StoreError as e:
            results[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(stores))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return [r for r in results if isinstance(r, AdapterRef)], [r for r in results if isinstance(r, StoreError)]


def check_race_outcome(store: AdapterStore, tensors: list[dict], wins: list, losses: list) -> None:
    """One winner, one clear error, and the stored version is exactly the winner's weights."""
    assert len(wins) == 1 and len(losses) == 1, (wins, losses)
    assert "lost the race to publish r1-v000003" in str(losses[0]) and "publish under a new version" in str(losses[0])
    assert store.versions("r1") == [3] and store.ref("r1", 3) == wins[0]
    loaded, _ = store.load_tensors("r1", 3)
    winner = next(
        t
        for t in tensors
        if torch.equal(t[SMALL_KEY.format(0, "q_proj", "A")], loaded[SMALL_KEY.format(0, "q_proj", "A")])
    )
    assert all(torch.equal(loaded[k], winner[k]) for k in winner)
