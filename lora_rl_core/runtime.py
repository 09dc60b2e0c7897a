"""Process-wide compute settings: which dtype the base model runs in, and how many CPU threads torch uses.

The one place for these rules; the trainer, the embedded engine, `lora-rl eval` and `lora-rl serve` all
load models through `models.load_model`, which asks `choose_dtype` here.

dtype `auto` (the default):
* CUDA: bfloat16 (every GPU this project targets computes it natively).
* CPU: bfloat16 only where the CPU computes it natively (x86 AVX512-BF16 or AMX tiles, as torch reports
  them), else float32. Measured on a 2-core AMD EPYC with AVX2 only: a 64x576 by 576x1536 matmul takes
  38 ms in bf16 and 8 ms in fp32, and a GRPO step of the default config 987 s in bf16 against ~50 s in
  fp32. An explicit `bfloat16` on such a CPU still works and warns once.

LoRA compute dtype (`trainer.lora_compute_dtype`, `choose_lora_compute_dtype`): `auto` is bfloat16 where the
trainer is on CUDA and its base weights are bfloat16, else float32; bfloat16 needs bfloat16 base weights (an
autocast to bfloat16 over float32 base weights would cast every base matmul too).

Threads: torch's intra-op pool gets one thread per core this process may run on (`os.sched_getaffinity`,
so a container or `taskset` limit is honoured; torch's own default counts the machine's cores).
`LORA_RL_NUM_THREADS`, else `OMP_NUM_THREADS`, overrides it. The trainer and the embedded engine run on
one thread and share this pool (`EmbeddedEngine.generate(inline=True)`), so they never oversubscribe it.

OpenMP waiting: the `lora-rl` command (`cli.main.main`), `tests/conftest.py` and the CPU benchmarks set
`OMP_WAIT_POLICY=PASSIVE` (unless the environment sets it) before torch loads, so threads waiting at a
barrier sleep instead of spinning; importing the library sets nothing, and OpenMP reads the variable only
when torch loads. `OMP_WAIT_POLICY=ACTIVE` keeps spinning. Measured on the 2-core AVX2 EPYC with
`yes > /dev/null` keeping one core busy, a LoRA forward/backward + decode workload took 29.4 s with
spinning threads (3.9x its idle time) and 13.7 s passive (about 1.4x), at a 0-15 % idle cost.

Memory: a process whose trainer computes on the CPU keeps the heap a train step frees for the next step
(`configure_allocator`: glibc's `mallopt`, unless the environment tunes glibc's malloc itself).
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
from dataclasses import dataclass

import torch

from lora_rl_core.errors import ConfigError

log = logging.getLogger(__name__)

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}
THREADS_ENV = "LORA_RL_NUM_THREADS"
_warned: set[str] = set()


@dataclass(frozen=True)
class DtypeChoice:
    """A dtype the run computes in (the base model's, or the LoRA branches'), and why.

    Attributes:
        name: `bfloat16`, `float32` or `float16`.
        requested: the config value (`auto` or an explicit name).
        reason: one line for the run log, `run.json` and the report.
    """

    name: str
    requested: str
    reason: str

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.name]


def cpu_has_native_bf16() -> bool:
    """True when this CPU computes bf16 matmuls natively (x86 AVX512-BF16 or AMX tiles)."""
    return _probe("_is_avx512_bf16_supported") or _probe("_is_amx_tile_supported")


def cpu_description() -> str:
    """`<model name> (<torch cpu capability>[, AVX512-BF16][, AMX])`, for logs and benchmark tables."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), model)
    except OSError:
        pass
    probes = (("AVX512-BF16", "_is_avx512_bf16_supported"), ("AMX", "_is_amx_tile_supported"))
    extras = [label for label, probe in probes if _probe(probe)]
    return f"{model} ({', '.join([torch.backends.cpu.get_cpu_capability(), *extras])})"


def _probe(name: str) -> bool:
    """A `torch.cpu._is_*_supported` probe; False where this torch build lacks it (non-x86)."""
    fn = getattr(torch.cpu, name, None)
    return bool(fn()) if fn is not None else False


def choose_dtype(requested: str, device: torch.device | str) -> DtypeChoice:
    """Resolve a config dtype (`auto`, `bfloat16`, `float32`, `float16`) for a device.

    `auto`: bfloat16 on CUDA; on CPU bfloat16 only with native support, else float32. An explicit
    `bfloat16` on a CPU without native support is kept, with a one-time warning of what it costs.

    Raises:
        ValueError: an unknown dtype name.
    """
    device = torch.device(device)
    if requested != "auto" and requested not in DTYPES:
        raise ValueError(f"model.dtype {requested!r} is not one of auto, {', '.join(DTYPES)}")
    if device.type != "cpu":
        if requested == "auto":
            return DtypeChoice("bfloat16", requested, f"auto: bfloat16 on {device.type}")
        return DtypeChoice(requested, requested, f"set in the config ({device.type})")
    native = cpu_has_native_bf16()
    cpu = cpu_description()
    if requested == "auto":
        if native:
            return DtypeChoice("bfloat16", requested, f"auto: bfloat16, the CPU computes it natively ({cpu})")
        return DtypeChoice("float32", requested, f"auto: float32, the CPU has no native bfloat16 ({cpu})")
    if requested == "bfloat16" and not native and "bf16-cpu" not in _warned:
        _warned.add("bf16-cpu")
        log.warning(
            "model.dtype=bfloat16 on a CPU without native bfloat16 (%s): matmuls are emulated, about 5x slower "
            "than float32 (a default GRPO step: ~987 s instead of ~50 s). Use model.dtype=auto or float32.",
            cpu,
        )
    return DtypeChoice(requested, requested, f"set in the config ({cpu})")


def choose_lora_compute_dtype(requested: str, device: torch.device | str, base_dtype: str) -> DtypeChoice:
    """Resolve `trainer.lora_compute_dtype` (`auto`, `float32`, `bfloat16`) for a trainer on `device` whose
    base weights are `base_dtype` (`choose_dtype(...).name`).

    Raises:
        ConfigError: `bfloat16` over base weights of another dtype (names both settings).
    """
    device = torch.device(device)
    if requested == "auto":
        if device.type == "cuda" and base_dtype == "bfloat16":
            return DtypeChoice("bfloat16", requested, "auto: bfloat16 base weights on cuda")
        return DtypeChoice("float32", requested, f"auto: {base_dtype} base weights on {device.type}")
    if requested == "bfloat16" and base_dtype != "bfloat16":
        raise ConfigError(
            f"trainer.lora_compute_dtype=bfloat16 needs bfloat16 base weights, but model.dtype resolves to "
            f"{base_dtype} on {device.type}: set model.dtype=bfloat16, or trainer.lora_compute_dtype=auto or float32"
        )
    return DtypeChoice(requested, requested, f"set in the config ({device.type})")


def cpu_threads() -> int:
    """Intra-op threads for this process: `$LORA_RL_NUM_THREADS`, else `$OMP_NUM_THREADS`, else the number
    of cores this process may run on (`os.sched_getaffinity`; `os.cpu_count()` where that is missing).

    Raises:
        ValueError: an override that is not a positive integer (names the variable).
    """
    for var in (THREADS_ENV, "OMP_NUM_THREADS"):
        raw = os.environ.get(var)
        if raw:
            try:
                value = int(raw)
            except ValueError:
                value = 0
            if value < 1:
                raise ValueError(f"{var}={raw!r} must be a positive integer (threads for torch's CPU ops)")
            return value
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # macOS, Windows
        return max(1, os.cpu_count() or 1)


def configure_threads() -> int:
    """Set torch's intra-op thread count to `cpu_threads()` (idempotent); returns it."""
    n = cpu_threads()
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
    return n


# glibc's mallopt parameters (malloc.h) and the values `configure_allocator` sets; mallopt takes a C int.
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
ALLOCATOR_SETTINGS = {_M_MMAP_THRESHOLD: 32 << 20, _M_TRIM_THRESHOLD: 1 << 30, _M_TOP_PAD: 256 << 20}
_MALLOC_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")


def configure_allocator() -> bool:
    """Make glibc's malloc keep the memory a CPU train step frees for the next one (`mallopt`, idempotent).
    Returns whether glibc now has these settings (False: left as they were, see below).

    Why: a train step on the CPU allocates and frees activations and gradients of tens of MB each. glibc
    serves a block from 128 KiB up with a fresh `mmap` (its threshold rises only as such blocks are freed)
    and gives a heap top over 128 KiB back to the kernel, so every step page-faults its working set in
    again: `aten::fill_` / `copy_` / `mul` on `[16, 96, 1536]` activations ran at about 2 GB/s. With the
    heap kept (blocks up to 32 MiB, glibc's largest mmap threshold, from the heap; up to 1 GiB of free heap
    kept; 256 MiB of headroom per growth) the default job's train step on its first batch (64 rows) took
    17.97 s against 19.41 s (-7.4 %), rollouts unchanged (2-core AMD EPYC, AVX512-BF16, two runs each,
    2026-11-29; `benchmarks/results/cpu-logprobs/`). The freed memory stays with the process until it exits.

    Left as they are: a libc other than glibc, and a process whose environment sets glibc's malloc itself
    (`GLIBC_TUNABLES` with a `glibc.malloc.` tunable, or `MALLOC_MMAP_THRESHOLD_`, `MALLOC_TRIM_THRESHOLD_`,
    `MALLOC_TOP_PAD_`).
    """
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    if "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", "") or any(v in os.environ for v in _MALLOC_ENV):
        return False
    mallopt = ctypes.CDLL(None).mallopt
    return all(mallopt(param, value) == 1 for param, value in ALLOCATOR_SETTINGS.items())
