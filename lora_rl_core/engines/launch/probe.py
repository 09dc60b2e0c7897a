"""What the SGLang a run launches can use: which kernels its installation has, the memory saver, its GPU.

SGLang picks its own attention backend (FlashAttention-3 on Hopper, `sglang/srt/server_args.py`
`_get_default_attn_backend`), sampling backend (FlashInfer) and LoRA backend (`csgmv`), and fails at the
first request where the kernels are missing (the offline carry of docs/SGLANG.md strips FA3's 1.1 GB
`sgl_kernel/flash_ops` and FlashInfer's JIT sources). `probe_sglang` asks the interpreter that will run the
server (`engine.launch.python` with `engine.launch.env`, so also its `CUDA_VISIBLE_DEVICES`) what it has,
without starting a server; `lora_rl_core.engines.launch.resolve` turns the answer into launch flags.
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING

from lora_rl_core.engines.remote.dialect import SGLANG
from lora_rl_core.errors import EngineError

if TYPE_CHECKING:
    from lora_rl_core.config import SGLangLaunchConfig

# Runs in SGLang's interpreter. find_spec and file checks only, so nothing heavy is imported but torch.
_PROBE = r"""
import importlib.util as u, json, os, shutil
def has(name):
    try:
        return u.find_spec(name) is not None
    except (ImportError, ValueError):
        return False
def folder(name):
    spec = u.find_spec(name)
    return os.path.dirname(spec.origin) if spec and spec.origin else None
out = {"sglang": has("sglang"), "fa3": False, "flashinfer": False, "memory_saver": has("torch_memory_saver")}
k = folder("sgl_kernel") if has("sgl_kernel") else None
out["fa3"] = bool(k) and any(f.startswith("flash_ops") for f in os.listdir(k))
f = folder("flashinfer") if has("flashinfer") else None
# FlashInfer compiles its kernels on first use (sources under data/, nvcc) unless a prebuilt cache is installed.
jit = bool(f) and os.path.isdir(os.path.join(f, "data", "cutlass")) and bool(
    shutil.which("nvcc") or os.environ.get("CUDA_HOME"))
out["flashinfer"] = bool(f) and (jit or has("flashinfer_jit_cache"))
try:
    from importlib.metadata import version
    out["version"] = version("sglang")
except Exception:
    out["version"] = None
import torch
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    out["gpu"] = {"name": p.name, "total_bytes": p.total_memory, "capability": [p.major, p.minor],
                  "count": torch.cuda.device_count()}
else:
    out["gpu"] = None
print("PROBE " + json.dumps(out))
"""


@dataclass(frozen=True)
class SGLangEnvironment:
    """What an SGLang installation and the GPU it would run on offer.

    Attributes:
        version: the installed `sglang` version (None if unknown).
        fa3: `sgl_kernel` ships FlashAttention-3 (`flash_ops`), SGLang's attention default on Hopper.
        flashinfer: FlashInfer is installed and can build or load its kernels (SGLang's sampling default).
        memory_saver: `torch_memory_saver` is installed (`--enable-memory-saver`).
        gpu_name: the first visible GPU's name; None without CUDA.
        gpu_total_bytes: its memory, bytes.
        gpu_capability: its compute capability, e.g. (9, 0) for Hopper.
        gpu_count: GPUs visible to the server.
    """

    version: str | None = None
    fa3: bool = False
    flashinfer: bool = False
    memory_saver: bool = False
    gpu_name: str | None = None
    gpu_total_bytes: int | None = None
    gpu_capability: tuple[int, int] | None = None
    gpu_count: int = 0

    @property
    def hopper(self) -> bool:
        """Compute capability 9.x (H100, H200, H20)."""
        return self.gpu_capability is not None and self.gpu_capability[0] == 9

    @classmethod
    def from_json(cls, data: dict[str, object]) -> SGLangEnvironment:
        """From the probe's JSON line."""
        gpu = data.get("gpu")
        gpu = gpu if isinstance(gpu, dict) else {}
        cap = gpu.get("capability")
        version = data.get("version")
        return cls(
            version=version if isinstance(version, str) else None,
            fa3=bool(data.get("fa3")),
            flashinfer=bool(data.get("flashinfer")),
            memory_saver=bool(data.get("memory_saver")),
            gpu_name=gpu.get("name"),
            gpu_total_bytes=gpu.get("total_bytes"),
            gpu_capability=(int(cap[0]), int(cap[1])) if cap else None,
            gpu_count=int(gpu.get("count") or 0),
        )


def probe_for_launch(launch: SGLangLaunchConfig) -> SGLangEnvironment:
    """What resolving `launch`'s `auto` flags needs: `probe_sglang` when any of the flags the probe decides is
    `auto`, else an empty environment (nothing is run).

    Raises:
        EngineError: as `probe_sglang`.
    """
    autos = [launch.attention_backend, launch.sampling_backend, launch.cuda_graph_max_bs, launch.memory_saver]
    return probe_sglang(launch) if "auto" in autos else SGLangEnvironment()


def probe_sglang(launch: SGLangLaunchConfig, timeout_s: float = 180.0) -> SGLangEnvironment:
    """Ask `launch.python` (with `launch.env`) what its SGLang installation and GPU offer. Cached per
    interpreter and environment for the life of this process.

    Raises:
        EngineError: the interpreter cannot be run, or has no `sglang` (naming `engine.launch.python` and
            `engine.launch.env`, which say where SGLang lives), or an SGLang of a version the client does not
            know (`SGLANG.versions`).
    """
    return _probe(launch.interpreter(), tuple(sorted(launch.env.items())), timeout_s)


@lru_cache(maxsize=8)
def _probe(python: str, env: tuple[tuple[str, str], ...], timeout_s: float) -> SGLangEnvironment:
    where = f"engine.launch.python={python!r} with engine.launch.env={dict(env)}"
    try:
        done = subprocess.run(
            [python, "-c", _PROBE],
            env={**os.environ, **dict(env)},
            capture_output=True,
            text=True,
            timeout=timeout_s,
            stdin=subprocess.DEVNULL,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise EngineError(f"cannot run the SGLang interpreter ({where}): {exc}") from None
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith("PROBE ")), None)
    if done.returncode != 0 or line is None:
        tail = "\n".join((done.stderr or done.stdout).splitlines()[-5:])
        raise EngineError(f"probing SGLang failed ({where}, exit {done.returncode}):\n{tail}")
    data = json.loads(line[len("PROBE ") :])
    if not data.get("sglang"):
        raise EngineError(
            f"no `sglang` package for {where}: install the GPU extra (`pip install 'lora-rl[gpu]'`, docs/SGLANG.md) "
            "or point engine.launch.python / engine.launch.env at an environment that has it"
        )
    found = SGLangEnvironment.from_json(data)
    if found.version is not None:  # refused before minutes of start-up; a server that runs is asked again
        SGLANG.check_version(found.version, where)
    return found
