"""The SGLang tensor payloads (`lora_rl_core.engines.remote.ipc`)."""

from __future__ import annotations

import base64
import io
import pickle

import pytest
import torch

from lora_rl_core.engines.remote.ipc import (
    _dumps,
    _host_views,
    _pack,
    inline_payload,
    ipc_payload,
    is_loopback,
    pack,
    pick_transport,
    server_transport,
)
from lora_rl_core.engines.remote.transport import SGLangTensorLoad, tensor_loader
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


def test_auto_is_ipc_only_for_a_local_server_with_cuda_and_is_resolved_once_per_server(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert server_transport("auto", "http://127.0.0.1:1") == "ipc"
    assert server_transport("auto", "http://10.0.0.5:1") == "auto"  # the folder where a load gives one
    assert server_transport("inline", "http://127.0.0.1:1") == "inline"
    local = tensor_loader("sglang", url="http://127.0.0.1:1", transport="auto")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert isinstance(local, SGLangTensorLoad) and local.transport == "ipc"  # decided when the client was made
    assert server_transport("auto", "http://127.0.0.1:1") == "auto"
    assert pick_transport("auto", has_path=True) == "disk"
    assert pick_transport("auto", has_path=False) == "inline"
    assert pick_transport("ipc", has_path=True) == "ipc"


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


@pytest.mark.parametrize(
    ("option", "value"),
    [("tensor_transport", "shm"), ("sglang_retire", "forget"), ("tensor_layout", "striped"), ("tensor_dtype", "int8")],
)
def test_the_engine_config_refuses_unknown_policies(option, value):
    """Each allowed value is checked once, by `EngineConfig`; the client and the payload builders trust it."""
    from lora_rl_core.config import config_from_dict
    from lora_rl_core.errors import ConfigError

    with pytest.raises(ConfigError, match=f"engine.{option}"):
        config_from_dict({"engine": {option: value}})


# ----------------------------------------------------------------------------- packed layouts (docs/SGLANG.md)
class _SGLangUnpickler(pickle.Unpickler):
    """SGLang 0.5.17's `SafeUnpickler` rule (`sglang/srt/utils/common.py`): a global loads only from an allowed
    module prefix and is not denied. The prefixes a LoRA payload may touch, and a recorder of what it loaded."""

    ALLOWED = ("builtins.", "collections.", "copyreg.", "functools.", "operator.", "types.", "torch.")
    DENIED = {("builtins", "eval"), ("builtins", "exec"), ("builtins", "compile")}

    def __init__(self, data: bytes) -> None:
        super().__init__(io.BytesIO(data))
        self.loaded: list[str] = []

    def find_class(self, module, name):
        if not (module + ".").startswith(self.ALLOWED) or (module, name) in self.DENIED:
            raise pickle.UnpicklingError(f"blocked {module}.{name}")
        self.loaded.append(f"{module}.{name}")
        return super().find_class(module, name)


def _adapter(dtype=torch.float32) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    shapes = {"l.0.q.lora_A.weight": (4, 6), "l.0.q.lora_B.weight": (6, 4), "l.0.down.lora_A.weight": (4, 10)}
    shapes |= {"scalar": (), "empty": (0, 3), "l.0.down.lora_B.weight": (6, 4)}
    return {k: torch.randn(s, generator=gen).to(dtype) for k, s in shapes.items()}


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_pack_gives_views_that_cover_one_buffer_in_order(dtype):
    tensors = _adapter()
    packed = pack(tensors, dtype=dtype)
    assert list(packed) == list(tensors)
    storages = {v.untyped_storage().data_ptr() for v in packed.values()}
    assert len(storages) == 1
    offset = 0
    for name, view in packed.items():
        assert view.shape == tensors[name].shape and view.is_contiguous()
        assert view.dtype == (dtype or torch.float32) and view.storage_offset() == offset
        assert torch.equal(view, tensors[name].to(view.dtype))
        offset += view.numel()
    assert offset * packed["scalar"].element_size() == packed["scalar"].untyped_storage().nbytes()
    before = packed["l.0.q.lora_A.weight"].clone()
    tensors["l.0.q.lora_A.weight"].add_(1.0)  # a copy, not the trainer's memory
    assert torch.equal(packed["l.0.q.lora_A.weight"], before)


def test_pack_keeps_one_buffer_per_dtype_and_strided_inputs():
    big = torch.randn(8, 8)
    tensors = {"t": big.t(), "h": torch.ones(3, dtype=torch.float16), "s": big[::2, 1:3], "x": torch.zeros(2)}
    packed = pack(tensors)
    assert list(packed) == ["t", "h", "s", "x"]
    assert packed["h"].dtype == torch.float16 and packed["h"].untyped_storage().nbytes() == 6
    assert packed["t"].untyped_storage().data_ptr() == packed["x"].untyped_storage().data_ptr()
    for name, tensor in tensors.items():
        assert torch.equal(packed[name], tensor)
    cast = pack(tensors, device="cpu", dtype=torch.bfloat16)  # mixed inputs, one dtype out: one buffer
    assert len({v.untyped_storage().data_ptr() for v in cast.values()}) == 1
    for name, tensor in tensors.items():
        assert cast[name].dtype == torch.bfloat16 and torch.equal(cast[name], tensor.to(torch.bfloat16))
    assert pack({}) == {}


def test_host_views_unpickle_under_sglangs_allow_list_as_views_of_one_host_copy():
    """The `host` layout's object graph, pickled with the data inline (no CUDA here): the server sees only
    `torch.*` globals (no `builtins.getattr`), one copy per buffer, and views equal to the inputs."""
    tensors = _adapter()
    tensors["half"] = torch.full((2, 2), 0.5, dtype=torch.float16)
    buffers = _pack(tensors, "cpu", None)
    data = _dumps(_host_views(buffers, {k: v.shape for k, v in tensors.items()}), share_cuda=False)
    unpickler = _SGLangUnpickler(data)
    back = unpickler.load()
    assert list(back) == list(tensors)
    assert {"torch.as_strided", "torch._utils._rebuild_device_tensor_from_cpu_tensor"} <= set(unpickler.loaded)
    assert not any(g.startswith("builtins.") for g in unpickler.loaded)
    for name, tensor in tensors.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor) and back[name].is_contiguous()
    float_storages = {v.untyped_storage().data_ptr() for k, v in back.items() if v.dtype == torch.float32}
    assert len(float_storages) == 1 and back["half"].untyped_storage().data_ptr() not in float_storages


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_inline_payload_casts_when_asked_and_passes_the_allow_list(dtype):
    tensors = _adapter()
    unpickler = _SGLangUnpickler(base64.b64decode(inline_payload(tensors, dtype=dtype)))
    back = unpickler.load()
    for name, tensor in tensors.items():
        assert torch.equal(back[name], tensor.to(dtype or tensor.dtype))
    assert len({v.untyped_storage().data_ptr() for v in back.values() if v.numel()}) == len(tensors) - 1
