"""The SGLang tensor payloads (`lora_rl_core.engines.sglang_tensors`)."""

from __future__ import annotations

import base64
import pickle

import pytest
import torch

from lora_rl_core.engines.sglang_tensors import inline_payload, ipc_payload, is_loopback, pick_transport
from lora_rl_core.errors import EngineError


@pytest.mark.parametrize(
    ("url", "local"),
    [
        ("http://127.0.0.1:30000", True),
        ("http://localhost:1", True),
        ("http://[::1]:8", True),
        ("http://10.0.0.5:30000", False),
        ("https://sglang.example:443", False),
    ],
)
def test_loopback_urls(url, local):
    assert is_loopback(url) is local


def test_auto_picks_ipc_only_for_a_local_server_with_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert pick_transport("auto", url="http://127.0.0.1:1", has_path=True) == "ipc"
    assert pick_transport("auto", url="http://10.0.0.5:1", has_path=True) == "disk"
    assert pick_transport("auto", url="http://10.0.0.5:1", has_path=False) == "inline"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert pick_transport("auto", url="http://127.0.0.1:1", has_path=True) == "disk"
    assert pick_transport("inline", url="http://127.0.0.1:1", has_path=True) == "inline"
    with pytest.raises(EngineError, match="tensor_transport must be one of"):
        pick_transport("shm", url="http://127.0.0.1:1", has_path=True)


def test_inline_payload_round_trips_and_sends_only_the_viewed_data():
    big = torch.randn(1000, 64)
    tensors = {"a.lora_A.weight": big[:8], "a.lora_B.weight": torch.randn(64, 8, dtype=torch.bfloat16)}
    payload = inline_payload(tensors)
    back = pickle.loads(base64.b64decode(payload))
    assert set(back) == set(tensors)
    for k, v in tensors.items():
        assert back[k].dtype == v.dtype and torch.equal(back[k], v)
    assert len(payload) < 0.1 * big.numel() * 4  # the 8-row view, not the 1000-row storage


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error")
def test_ipc_payload_needs_cuda():
    with pytest.raises(EngineError, match="needs CUDA"):
        ipc_payload({"w": torch.zeros(2)})


@pytest.mark.parametrize(("option", "value"), [("tensor_transport", "shm"), ("retire", "forget")])
def test_sglang_engine_refuses_unknown_policies_at_construction(option, value):
    from lora_rl_core.engines.http import SGLangEngine

    with pytest.raises(EngineError, match=f"{option} must be one of .*got '{value}'"):
        SGLangEngine("http://127.0.0.1:1", **{option: value})
