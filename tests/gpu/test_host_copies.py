"""The adapter's way off the GPU and back (issue 34, item 4: publish and sync off the step's critical path):
`lora.cpu_copies` copies CUDA tensors into page-locked host memory with one wait, and `ipc.pack` joins host
tensors bound for a GPU on the GPU. Both must give exactly what the old paths gave: independent copies that
the next step cannot change, files the store can write, and the same packed bytes. Needs CUDA."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load, save_file

from lora_rl_core.engines.remote.ipc import pack
from lora_rl_core.lora import cpu_copies

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]


def _lora_like() -> dict[str, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(0)
    tensors = {}
    for layer in range(3):
        for module, (rows, cols) in {"q_proj": (1536, 1536), "k_proj": (256, 1536), "down_proj": (1536, 8960)}.items():
            tensors[f"layers.{layer}.{module}.lora_A.weight"] = torch.randn(16, cols, device="cuda", generator=g)
            tensors[f"layers.{layer}.{module}.lora_B.weight"] = torch.randn(rows, 16, device="cuda", generator=g)
    tensors["layers.0.transposed"] = torch.randn(64, 32, device="cuda", generator=g).t()  # not contiguous
    return tensors


def test_cpu_copies_are_pinned_independent_and_writable(tmp_path):
    source = _lora_like()
    copies = cpu_copies(source)
    assert list(copies) == list(source)
    for name, copy in copies.items():
        assert copy.device.type == "cpu" and copy.is_pinned() and copy.is_contiguous(), name
        assert torch.equal(copy, source[name].cpu()), name
    pointers = {c.untyped_storage().data_ptr() for c in copies.values()}
    assert len(pointers) == len(copies)  # each its own storage: safetensors refuses shared ones
    expected = {k: v.clone() for k, v in copies.items()}
    for tensor in source.values():  # the next optimizer step
        tensor.add_(1.0)
    torch.cuda.synchronize()
    assert all(torch.equal(copies[k], expected[k]) for k in copies)
    save_file(copies, tmp_path / "adapter.safetensors")
    loaded = load((tmp_path / "adapter.safetensors").read_bytes())
    assert all(torch.equal(loaded[k], expected[k]) for k in copies)


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_pack_joins_host_tensors_on_the_gpu_as_before(dtype):
    host = cpu_copies(_lora_like())  # pinned, as a published version's tensors are
    packed = pack(host, device="cuda", dtype=dtype)
    assert list(packed) == list(host)
    for name, tensor in packed.items():
        assert tensor.device.type == "cuda" and tensor.dtype == (dtype or torch.float32), name
        assert torch.equal(tensor.cpu(), host[name].to(tensor.dtype)), name
    storages = {t.untyped_storage().data_ptr() for t in packed.values()}
    assert len(storages) == 1  # one buffer (views into it), as the `packed` and `host` layouts need
