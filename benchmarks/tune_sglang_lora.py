"""Tune SGLang's `csgmv` LoRA kernels for a model's layer shapes, and time its `triton` LoRA backend beside them.

SGLang 0.5.17 runs a LoRA layer as two Triton kernels: shrink, y = x @ A^T ((T, K) -> (T, S*R)), and expand,
per slice y_i @ B_i^T * scaling added into the base layer's output. Its default backend `csgmv` ("chunked SGMV",
`sglang.kernels.ops.gemm.chunked_sgmv_{shrink,expand}`) cuts the tokens into chunks of `chunk_size` (the
kernels' BLOCK_M, `ChunkedSgmvLoRABackend._determine_chunk_size_for_tokens`) and asks
`sglang.kernels.ops.gemm.lora_tuning_config` for its other block sizes, read from

    $SGLANG_LORA_CONFIG_DIR/csgmv_configs/triton_<triton version, _ for .>/
        lora_{shrink|expand},K={K},R={R},S={S},device={torch.cuda.get_device_name(), _ for space}.json

(JSON `{"<chunk size>": {"BLOCK_N", "BLOCK_K", "num_warps", "num_stages"}}`), else BLOCK_N/BLOCK_K defaults.
K is the shrink's input dim and the expand's TOTAL output dim (B's rows: q+2kv for qkv, 2 x intermediate for
gate_up), not its largest slice; R is the buffers' rank (`--max-lora-rank`), S the fused slices. For the four
LoRA layers SGLang fuses in a dense model (qkv S=3, o_proj, gate_up S=2, down_proj) at one rank, this script:

1. times every config of a search space on each kernel problem (o_proj and down_proj share their expand
   problem and file: both write `hidden` columns) at each `--tokens` count, through SGLang's own
   `chunked_sgmv_lora_*_forward` wrappers with the loader's name in their module patched to return the
   candidate (and their `cached_triton_kernel` cache emptied: it keys compiled kernels on shapes, not on
   block sizes); configs that fail to compile or launch are recorded and skipped;
2. checks the fastest against a float32 torch reference and takes the next one while it is wrong;
3. writes the winners into `--out-dir` as the loader reads them (merged into files already there), then has
   the loader read them back (`SGLANG_LORA_CONFIG_DIR=--out-dir`): a file name the server would not ask for
   shows up as a mismatch;
4. times each whole layer (shrink + expand) three ways: `csgmv` with SGLang's own configs (no
   SGLANG_LORA_CONFIG_DIR), `csgmv` with the written files, and the `triton` backend's kernels
   (`sgemm_lora_a_fwd`, then `qkv_lora_b_fwd` / `gate_up_lora_b_fwd` / `sgemm_lora_b_fwd`) on the batch
   info its decode builds (`TritonLoRABackend.compute_sgemm_routing`: one segment per adapter slot, tokens
   sorted by adapter); and a decode step's LoRA time: the four layers x `num_hidden_layers`.

Choices: times are GPU microseconds of one call: `--calls` back-to-back calls captured in one CUDA graph
(SGLang decodes in CUDA graphs, so Python launch costs are not what a decode step pays), replayed `--samples`
times, the median; inputs stay in L2 between calls. Random bf16 data, one adapter in slot 1 of
`--max-loras-per-batch` slots holding every token, rank R, scaling 1. The chunk size of T tokens is SGLang's
(16 below 64 tokens, 32 below 256, else 128) capped by `--max-chunk-size`, which must match the server's
`--max-lora-chunk-size`: SGLang 0.5.17 defaults that to 16, which makes every chunk 16 and leaves configs tuned
for 32 or 128 unused. Several `--tokens` of one chunk size share a file entry: the config with the least summed
ratio to each one's fastest. For csgmv a decode batch of T sequences and a prefill of T tokens on one adapter are
the same problem; the `triton` column is always the decode batch (a prefill runs it on per-request segments).
Left out: the server's padded CUDA-graph grids (`csgmv` launches `cuda_graph_max_bs` segment rows in decode, the
extra ones return at once), `maxnreg`, MoE and MLA layers, the embedding and lm_head LoRA, tensor parallelism.

Usage, on the GPU host (docs/SGLANG.md, "GPU host"; SGLang in /tmp/sglsite)::

    PYTHONPATH=/tmp/sglsite:$PWD:$PWD/benchmarks python3 benchmarks/tune_sglang_lora.py \\
        --model-config benchmarks/model_configs/qwen2.5-1.5b.json --rank 16 --tokens 128 \\
        --out-dir /tmp/sglang-lora-configs --json benchmarks/results/sglang_lora_tune/qwen2.5-1.5b-r16.json
    SGLANG_LORA_CONFIG_DIR=/tmp/sglang-lora-configs python3 -m sglang.launch_server ... \\
        --lora-backend csgmv --max-lora-chunk-size 128          # the server that reads them
    python benchmarks/tune_sglang_lora.py --model-config benchmarks/model_configs/qwen2.5-7b.json --dry-run  # CPU
    PYTHONPATH=TRITON:SGLANG python benchmarks/tune_sglang_lora.py --interpret --quick --tiny  # CPU smoke test

One `--tokens 128` run takes about 3 minutes on an H100, most of it Triton compiling the ~230 candidates; a
server whose decode batch also falls under 64 sequences (the end of a rollout) uses chunk 16 there too: add
`--tokens 32`. `--interpret` runs the calls under Triton's interpreter on the CPU (Triton 3.5's interpreter
needs numpy < 2.3 for the `triton` backend's kernels).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as package_version
from itertools import product
from pathlib import Path
from types import SimpleNamespace
from typing import Any, NamedTuple

import torch
from _common import MODEL_CONFIGS, RESULTS, machine_info, model_config, print_table, write_json

Space = dict[str, tuple[int, ...]]
SHRINK_SPACE: Space = {
    "BLOCK_N": (16, 32, 64),
    "BLOCK_K": (128, 256, 512),
    "num_warps": (2, 4, 8),
    "num_stages": (2, 3, 4),
}
EXPAND_SPACE: Space = {
    "BLOCK_N": (32, 64, 128, 256),
    "BLOCK_K": (16, 32, 64),
    "num_warps": (2, 4, 8),
    "num_stages": (1, 2, 3),
}
QUICK_SHRINK: Space = {"BLOCK_N": (16, 32), "BLOCK_K": (256, 512), "num_warps": (4, 8), "num_stages": (2, 3)}
QUICK_EXPAND: Space = {"BLOCK_N": (64, 128), "BLOCK_K": (16, 32), "num_warps": (4,), "num_stages": (1, 2)}
CONFIG_KEYS = ("BLOCK_N", "BLOCK_K", "num_warps", "num_stages")
TRITON_DEFAULTS = {"num_warps": 4, "num_stages": 3}
"""What Triton launches a CUDA kernel with when the call names neither (SGLang's default configs name neither)."""
SMEM_BYTES = 227 * 1024
"""Shared memory a block may use on an H100/H200; a config whose pipelined tiles surely exceed it is not compiled."""
MIN_CHUNK_SIZE = 16  # sglang.srt.lora.backend.chunked_backend.MIN_CHUNK_SIZE
ADAPTER_SLOT = 1  # the buffer slot of the one adapter (slot 0 stays rank 0)
SCALING = 1.0
WAYS = ("csgmv_default", "csgmv_tuned", "triton")
"""The three ways a layer is timed: csgmv with SGLang's own configs, csgmv with the tuned files, triton backend."""
TOLERANCE = 2e-2
"""Largest accepted max|out - ref| / max|ref| against the float32 reference: bf16 rounding stays well under it,
a wrong tile or mask is of order 1."""


@dataclass(frozen=True)
class LoraLayer:
    """One LoRA layer as SGLang fuses it: its input dim and the output slices its B stacks (qkv: q, k, v)."""

    name: str
    in_dim: int
    slices: tuple[int, ...]

    @property
    def num_slices(self) -> int:
        return len(self.slices)

    @property
    def out_dim(self) -> int:
        return sum(self.slices)

    @property
    def offsets(self) -> tuple[int, ...]:
        """The slice boundaries on the output dim, `output_offset` in SGLang: (0, q, q+kv, q+2kv) for qkv."""
        out = [0]
        for size in self.slices:
            out.append(out[-1] + size)
        return tuple(out)

    @property
    def max_slice(self) -> int:
        """The expand grid's width: `max_qkv_out_dim` (qkv), `output_dim` (gate_up), B's rows (one slice)."""
        return max(self.slices)


@dataclass(frozen=True)
class Kernel:
    """One csgmv kernel problem, as the loader names its config file: `kind` shrink or expand, K (shrink: the input
    dim; expand: the total output dim), R (the buffers' rank), S (slices)."""

    kind: str
    K: int
    R: int
    S: int

    @property
    def label(self) -> str:
        return f"{self.kind} K={self.K} R={self.R} S={self.S}"

    def file_name(self, device: str) -> str:
        """`lora_tuning_config.get_lora_config_file_name` for a device named `device`."""
        return f"lora_{self.kind},K={self.K},R={self.R},S={self.S},device={device.replace(' ', '_')}.json"


class Case(NamedTuple):
    """A token count and the chunk size the server gives it."""

    tokens: int
    chunk: int

    @property
    def label(self) -> str:
        return f"T={self.tokens} chunk={self.chunk}"


@dataclass
class LayerData:
    """Random tensors of one layer at T tokens, laid out as SGLang's LoRA memory pool holds them."""

    x: torch.Tensor  # (T, in_dim) the layer's input
    A: torch.Tensor  # (slots, S*R, in_dim) LoRA A of every adapter slot
    B: torch.Tensor  # (slots, out_dim, R) LoRA B of every adapter slot
    y: torch.Tensor  # (T, S*R) the expand's input when it is timed alone
    base: torch.Tensor  # (T, out_dim) the base layer's output the expand adds into
    offsets: torch.Tensor  # (S+1,) int32, LoraLayer.offsets


@dataclass
class Runtime:
    """Where the kernels run: `cuda` in bf16 timed with CUDA graphs, or `cpu` under Triton's interpreter
    (`--interpret`: a smoke test of the calls in float32; its times mean nothing)."""

    device: str
    dtype: torch.dtype
    calls: int
    samples: int

    def time_us(self, fn: Callable[[], object]) -> float:
        """Microseconds of one `fn()` call (see `graph_us`)."""
        if self.device == "cpu":
            start = time.perf_counter()
            fn()
            return (time.perf_counter() - start) * 1e6
        return graph_us(fn, self.calls, self.samples)


# --- shapes, chunk sizes, search spaces: pure, CPU-testable ------------------------------------------------


def config_json(path: Path) -> Path:
    """`path` itself, or `path/config.json` for a model folder."""
    return path / "config.json" if path.is_dir() else path


def lora_layers(cfg: dict[str, Any]) -> list[LoraLayer]:
    """qkv, o_proj, gate_up, down_proj of a dense HF config, with SGLang's dims (`lora.utils.get_hidden_dim`:
    head_dim from the config, else hidden_size / num_attention_heads)."""
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or hidden // heads
    q_dim = heads * head_dim
    kv_dim = (cfg.get("num_key_value_heads") or heads) * head_dim
    inter = cfg["intermediate_size"]
    return [
        LoraLayer("qkv", hidden, (q_dim, kv_dim, kv_dim)),
        LoraLayer("o_proj", q_dim, (hidden,)),
        LoraLayer("gate_up", hidden, (inter, inter)),
        LoraLayer("down_proj", inter, (hidden,)),
    ]


def layer_kernels(layer: LoraLayer, rank: int) -> tuple[Kernel, Kernel]:
    """The shrink and expand problems of `layer` (shrink K = input dim; expand K = total output dim, as
    `chunked_sgmv_lora_expand_forward` asks the loader with `K=weights.shape[1]`)."""
    shrink = Kernel("shrink", layer.in_dim, rank, layer.num_slices)
    return shrink, Kernel("expand", layer.out_dim, rank, layer.num_slices)


def kernel_problems(layers: list[LoraLayer], rank: int) -> dict[Kernel, LoraLayer]:
    """Each distinct kernel problem of the layers, with the first layer that has it (o_proj and down_proj share
    their expand problem, and so its config file: both write `hidden_size` columns at one slice)."""
    problems: dict[Kernel, LoraLayer] = {}
    for layer in layers:
        for kernel in layer_kernels(layer, rank):
            problems.setdefault(kernel, layer)
    return problems


def chunk_size_for_tokens(tokens: int, max_chunk: int) -> int:
    """`ChunkedSgmvLoRABackend._determine_chunk_size_for_tokens` (sglang 0.5.17): 16 below 64 tokens, 32 below
    256, else 128, capped at the server's `--max-lora-chunk-size` (`max_chunk`; 16 or less gives 16)."""
    if max_chunk <= MIN_CHUNK_SIZE:
        return MIN_CHUNK_SIZE
    chunk = 128 if tokens >= 256 else 32 if tokens >= 64 else 16
    return min(max_chunk, chunk)


def tuning_cases(tokens: list[int], max_chunks: list[int]) -> list[Case]:
    """Each token count with the chunk size each `--max-chunk-size` gives it, without repeats, in order."""
    cases = [Case(t, chunk_size_for_tokens(t, m)) for t in tokens for m in max_chunks]
    return list(dict.fromkeys(cases))


def segment_indptr(tokens: int, chunk: int) -> list[int]:
    """Segment boundaries of `tokens` tokens on one adapter cut into chunks (`_get_segments_info`):
    (0, chunk, 2*chunk, ..., tokens)."""
    return [*range(0, tokens, chunk), tokens]


def search_spaces(quick: bool) -> dict[str, Space]:
    """`{"shrink": space, "expand": space}`, the reduced ones for `--quick`."""
    if quick:
        return {"shrink": QUICK_SHRINK, "expand": QUICK_EXPAND}
    return {"shrink": SHRINK_SPACE, "expand": EXPAND_SPACE}


def next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def candidates(kernel: Kernel, chunk: int, space: Space, default: dict[str, int] | None) -> list[dict[str, int]]:
    """`default` (SGLang's own config) first, then the configs of `space` that can matter here: a tile no wider
    than the output (S*R for shrink, the output dim for expand) or the reduction (K for shrink, R for expand)
    rounded up to a power of two, only the first `num_stages` when the reduction is one tile, and no config whose
    `num_stages - 1` pipelined tiles of (chunk x BLOCK_K + BLOCK_K x BLOCK_N) bf16 exceed `SMEM_BYTES`."""
    shrink = kernel.kind == "shrink"
    reduction = kernel.K if shrink else kernel.R
    widest = max(16, next_pow2(kernel.S * kernel.R if shrink else kernel.K))
    out = [] if default is None else [default]
    for block_n, block_k, warps, stages in product(*(space[key] for key in CONFIG_KEYS)):
        config = dict(zip(CONFIG_KEYS, (block_n, block_k, warps, stages), strict=True))
        if block_n > widest or block_k > max(16, next_pow2(reduction)) or config in out:
            continue
        if math.ceil(reduction / block_k) == 1 and stages != space["num_stages"][0]:
            continue
        if (stages - 1) * (chunk * block_k + block_k * block_n) * 2 > SMEM_BYTES:
            continue
        out.append(config)
    return out


def config_name(config: dict[str, int]) -> str:
    """`N16-K256-w4-s3` for BLOCK_N 16, BLOCK_K 256, 4 warps, 3 stages."""
    return "N{BLOCK_N}-K{BLOCK_K}-w{num_warps}-s{num_stages}".format(**config)


def rank_configs(times: list[dict[str, float]]) -> list[str]:
    """The config names timed in every one of `times` (`{name: microseconds}`, one per token count sharing a
    chunk size), best first: least summed ratio to each token count's fastest, then by name."""
    if not times or not all(times):
        return []
    common = set.intersection(*(set(t) for t in times))
    best = [min(t.values()) for t in times]
    return sorted(common, key=lambda name: (sum(t[name] / b for t, b in zip(times, best, strict=True)), name))


def per_step_us(layer_us: dict[str, float], num_layers: int) -> float:
    """A decode step's LoRA time: the layer kinds' microseconds summed, times the model's layers."""
    return sum(layer_us.values()) * num_layers


# --- SGLang on the GPU ------------------------------------------------------------------------------------


def import_sglang(rt: Runtime) -> SimpleNamespace:
    """The parts of SGLang 0.5.17 this script calls; exits with a message when CUDA or SGLang is missing."""
    if rt.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("tune_sglang_lora: no CUDA GPU here (--dry-run shows the shapes and files without one)")
    if rt.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # read when SGLang's modules apply @triton.jit
    try:
        import triton
        from sglang.kernels.ops.gemm import chunked_sgmv_expand, chunked_sgmv_shrink, lora_tuning_config
        from sglang.kernels.ops.gemm.gate_up_lora_b import gate_up_lora_b_fwd
        from sglang.kernels.ops.gemm.qkv_lora_b import qkv_lora_b_fwd
        from sglang.kernels.ops.gemm.sgemm_lora_a import sgemm_lora_a_fwd
        from sglang.kernels.ops.gemm.sgemm_lora_b import sgemm_lora_b_fwd
        from sglang.srt.lora.utils import LoRABatchInfo
    except (ImportError, OSError) as e:
        raise SystemExit(
            f"tune_sglang_lora: SGLang 0.5.17's LoRA kernels do not import ({e}); "
            "on the GPU host put /tmp/sglsite first on PYTHONPATH"
        ) from e
    return SimpleNamespace(
        shrink=chunked_sgmv_shrink,
        expand=chunked_sgmv_expand,
        tuning=lora_tuning_config,
        LoRABatchInfo=LoRABatchInfo,
        sgemm_lora_a_fwd=sgemm_lora_a_fwd,
        sgemm_lora_b_fwd=sgemm_lora_b_fwd,
        qkv_lora_b_fwd=qkv_lora_b_fwd,
        gate_up_lora_b_fwd=gate_up_lora_b_fwd,
        version=_version("sglang"),
        triton_version=triton.__version__,
        device_name=str(lora_tuning_config.get_device_name()),
    )


def _version(package: str) -> str | None:
    try:
        return package_version(package)
    except PackageNotFoundError:
        return None


def check_chunk_sizes(cases: list[Case], max_chunks: list[int]) -> None:
    """Our `chunk_size_for_tokens` against SGLang's own method, where its backend module imports."""
    try:
        from sglang.srt.lora.backend.chunked_backend import ChunkedSgmvLoRABackend
    except Exception as e:  # a best-effort check: the server's module tree may want more than the kernels do
        print(f"note: SGLang's chunked backend does not import here ({e}); chunk sizes not cross-checked")
        return
    for tokens, m in product(sorted({c.tokens for c in cases}), max_chunks):
        theirs = ChunkedSgmvLoRABackend._determine_chunk_size_for_tokens(SimpleNamespace(max_chunk_size=m), tokens)
        if theirs != (ours := chunk_size_for_tokens(tokens, m)):
            raise SystemExit(f"chunk size of {tokens} tokens, max {m}: SGLang {theirs}, ours {ours}")


def graph_us(fn: Callable[[], object], calls: int, samples: int) -> float:
    """Median GPU microseconds of one `fn()`: one call outside (it compiles), then `calls` calls captured in
    one CUDA graph, replayed once to warm up and `samples` times between CUDA events."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(samples)]
    for start, end in events:
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events) * 1000.0 / calls


@dataclass
class Bench:
    """SGLang's modules, where they run, and the adapter every measurement uses: rank R, scaling 1, in
    ADAPTER_SLOT of `slots` buffer slots (the others rank 0)."""

    sgl: SimpleNamespace
    rt: Runtime
    rank: int
    slots: int

    def data(self, layer: LoraLayer, tokens: int, seed: int = 0) -> LayerData:
        """Normal data scaled so that every output is of order 1 (A by 1/sqrt(in_dim), B by 1/sqrt(R))."""
        device, s = self.rt.device, layer.num_slices
        gen = torch.Generator(device=device).manual_seed(seed)

        def normal(*shape: int, std: float = 1.0) -> torch.Tensor:
            return (torch.randn(*shape, generator=gen, device=device) * std).to(self.rt.dtype)

        return LayerData(
            x=normal(tokens, layer.in_dim),
            A=normal(self.slots, s * self.rank, layer.in_dim, std=layer.in_dim**-0.5),
            B=normal(self.slots, layer.out_dim, self.rank, std=self.rank**-0.5),
            y=normal(tokens, s * self.rank),
            base=torch.zeros(tokens, layer.out_dim, device=device, dtype=self.rt.dtype),
            offsets=torch.tensor(layer.offsets, dtype=torch.int32, device=device),
        )

    def ints(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32, device=self.rt.device)

    def adapters(self) -> dict[str, torch.Tensor]:
        """`lora_ranks` (int32) and `scalings` (float32) of the slots."""
        ranks = [self.rank if i == ADAPTER_SLOT else 0 for i in range(self.slots)]
        scalings = [SCALING if i == ADAPTER_SLOT else 0.0 for i in range(self.slots)]
        return {"lora_ranks": self.ints(ranks), "scalings": torch.tensor(scalings, device=self.rt.device)}

    def csgmv_batch(self, case: Case) -> Any:
        """The `LoRABatchInfo` `ChunkedSgmvLoRABackend.prepare_lora_batch` builds eagerly for T one-token
        requests on one adapter: segments of `chunk` tokens (`max_len`, the kernels' BLOCK_M), tokens in order."""
        indptr = segment_indptr(case.tokens, case.chunk)
        segments = len(indptr) - 1
        return self.sgl.LoRABatchInfo(
            use_cuda_graph=False,
            bs=case.tokens,
            num_segments=segments,
            max_len=case.chunk,
            seg_indptr=self.ints(indptr),
            weight_indices=self.ints([ADAPTER_SLOT] * segments),
            seg_lens=None,
            permutation=self.ints(list(range(case.tokens))),
            **self.adapters(),
        )

    def triton_batch(self, tokens: int) -> Any:
        """The `LoRABatchInfo` the `triton` backend's kernels run on in decode (`compute_sgemm_routing`): one
        segment per adapter slot (ADAPTER_SLOT's holds all T tokens), max_len T, tokens sorted by adapter."""
        seg_lens = [tokens if i == ADAPTER_SLOT else 0 for i in range(self.slots)]
        return self.sgl.LoRABatchInfo(
            use_cuda_graph=False,
            bs=self.slots,
            num_segments=self.slots,
            max_len=tokens,
            seg_lens=self.ints(seg_lens),
            seg_indptr=self.ints([sum(seg_lens[:i]) for i in range(self.slots + 1)]),
            weight_indices=self.ints(list(range(self.slots))),
            permutation=self.ints(list(range(tokens))),
            **self.adapters(),
        )


def clear_kernel_caches(sgl: SimpleNamespace) -> None:
    """Empty the `cached_triton_kernel` caches of the csgmv kernels (plain `triton.jit` ones have none)."""
    for kernel in (sgl.shrink._chunked_lora_shrink_kernel, sgl.expand._chunked_lora_expand_kernel):
        getattr(kernel, "_clear_cache", lambda: None)()


@contextlib.contextmanager
def forced_config(sgl: SimpleNamespace, kind: str, config: dict[str, int]) -> Iterator[None]:
    """SGLang's `chunked_sgmv_lora_{kind}_forward` launching with `config`: the loader's name in the wrapper's
    module replaced, the kernel caches emptied on the way in and out."""
    module = sgl.shrink if kind == "shrink" else sgl.expand
    name = f"get_lora_{kind}_config"
    loader = getattr(module, name)
    setattr(module, name, lambda **_: dict(config))
    clear_kernel_caches(sgl)
    try:
        yield
    finally:
        setattr(module, name, loader)
        clear_kernel_caches(sgl)


@contextlib.contextmanager
def loader_reading(sgl: SimpleNamespace, config_dir: Path | None) -> Iterator[None]:
    """SGLang's own loader reading `config_dir` as SGLANG_LORA_CONFIG_DIR (None: unset, the package's configs),
    its lru_cache and the kernel caches emptied on the way in and out."""
    saved = os.environ.pop("SGLANG_LORA_CONFIG_DIR", None)
    if config_dir is not None:
        os.environ["SGLANG_LORA_CONFIG_DIR"] = str(config_dir.resolve())
    sgl.tuning.get_lora_configs.cache_clear()
    clear_kernel_caches(sgl)
    try:
        yield
    finally:
        os.environ.pop("SGLANG_LORA_CONFIG_DIR", None)
        if saved is not None:
            os.environ["SGLANG_LORA_CONFIG_DIR"] = saved
        sgl.tuning.get_lora_configs.cache_clear()
        clear_kernel_caches(sgl)


def loader_config(sgl: SimpleNamespace, kernel: Kernel, chunk: int) -> dict[str, int]:
    """What SGLang's loader gives this kernel problem at this chunk size."""
    get = getattr(sgl.tuning, f"get_lora_{kernel.kind}_config")
    return dict(get(K=kernel.K, R=kernel.R, num_slices=kernel.S, chunk_size=chunk))


def default_config(sgl: SimpleNamespace, kind: str) -> dict[str, int]:
    """SGLang's hardcoded default (`DEFAULT_{SHRINK,EXPAND}_CONFIG`) with Triton's launch defaults filled in."""
    merged = {**TRITON_DEFAULTS, **getattr(sgl.tuning, f"DEFAULT_{kind.upper()}_CONFIG")}
    return {key: merged[key] for key in CONFIG_KEYS}


def csgmv_shrink(sgl: SimpleNamespace, layer: LoraLayer, d: LayerData, info: Any) -> torch.Tensor:
    """`chunked_sgmv_lora_shrink_forward` as `ChunkedSgmvLoRABackend` calls it: (T, in_dim) -> (T, S*R)."""
    return sgl.shrink.chunked_sgmv_lora_shrink_forward(x=d.x, weights=d.A, batch_info=info, num_slices=layer.num_slices)


def csgmv_expand(
    sgl: SimpleNamespace, layer: LoraLayer, d: LayerData, info: Any, y: torch.Tensor, base: torch.Tensor
) -> torch.Tensor:
    """`chunked_sgmv_lora_expand_forward` as `ChunkedSgmvLoRABackend` calls it: y (T, S*R) added into base."""
    return sgl.expand.chunked_sgmv_lora_expand_forward(
        x=y, weights=d.B, batch_info=info, slice_offsets=d.offsets, max_slice_size=layer.max_slice, base_output=base
    )


def csgmv_layer(sgl: SimpleNamespace, layer: LoraLayer, d: LayerData, info: Any, base: torch.Tensor) -> torch.Tensor:
    """A whole layer on `csgmv` (`run_qkv_lora`, `run_gate_up_lora` and `run_lora_a_sgemm` + `run_lora_b_sgemm`
    are all this shrink, then this expand)."""
    return csgmv_expand(sgl, layer, d, info, csgmv_shrink(sgl, layer, d, info), base)


def triton_layer(sgl: SimpleNamespace, layer: LoraLayer, d: LayerData, info: Any, base: torch.Tensor) -> torch.Tensor:
    """A whole layer on the `triton` backend (`TritonLoRABackend.run_qkv_lora`, `run_gate_up_lora`, or
    `run_lora_a_sgemm` + `run_lora_b_sgemm`)."""
    y = sgl.sgemm_lora_a_fwd(d.x, d.A, info, stack_num=layer.num_slices)
    if layer.num_slices == 3:
        return sgl.qkv_lora_b_fwd(y, d.B, info, d.offsets, layer.max_slice, base, n_slices=3)
    if layer.num_slices == 2:
        return sgl.gate_up_lora_b_fwd(y, d.B, info, layer.max_slice, base)
    return sgl.sgemm_lora_b_fwd(y, d.B, info, base)


def shrink_reference(d: LayerData) -> torch.Tensor:
    """x @ A[slot]^T in float32: (T, S*R)."""
    return d.x.float() @ d.A[ADAPTER_SLOT].float().T


def expand_reference(y: torch.Tensor, d: LayerData, layer: LoraLayer) -> torch.Tensor:
    """Per slice i: y[:, i*R:(i+1)*R] @ B[slot][offsets[i]:offsets[i+1]]^T * scaling, float32: (T, out_dim)."""
    rank = d.B.shape[-1]
    out = torch.zeros(y.shape[0], layer.out_dim, device=y.device)
    for i, (lo, hi) in enumerate(zip(layer.offsets, layer.offsets[1:], strict=False)):
        out[:, lo:hi] = y[:, i * rank : (i + 1) * rank].float() @ d.B[ADAPTER_SLOT, lo:hi].float().T * SCALING
    return out


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max|out - ref| / max|ref|."""
    return float((out.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-6))


def kernel_call(b: Bench, kind: str, layer: LoraLayer, case: Case, base: str = "data") -> tuple[Callable, Callable]:
    """(one csgmv kernel of `layer` at `case` as a call, its float32 reference as a call); the expand adds into
    the data's base output, or into zeros for `base="zeros"`."""
    d, info = b.data(layer, case.tokens), b.csgmv_batch(case)
    if kind == "shrink":
        return lambda: csgmv_shrink(b.sgl, layer, d, info), lambda: shrink_reference(d)
    out = d.base if base == "data" else torch.zeros_like(d.base)
    return lambda: csgmv_expand(b.sgl, layer, d, info, d.y, out), lambda: expand_reference(d.y, d, layer)


def short_error(e: Exception) -> str:
    """`Type: first line of the message` (at most 200 characters)."""
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0][:200] if lines else ''}"


def tune_kernel(b: Bench, kernel: Kernel, layer: LoraLayer, case: Case, space: Space) -> dict[str, Any]:
    """Every candidate config of one kernel problem at one case: `{"configs", "default", "times_us", "failed"}`
    (`default`: the name of SGLang's default config, always the first candidate)."""
    fn, _ = kernel_call(b, kernel.kind, layer, case)
    default = default_config(b.sgl, kernel.kind)
    configs = {config_name(c): c for c in candidates(kernel, case.chunk, space, default)}
    times: dict[str, float] = {}
    failed: dict[str, str] = {}
    for name, config in configs.items():
        with forced_config(b.sgl, kernel.kind, config):
            try:
                times[name] = b.rt.time_us(fn)
            except Exception as e:  # does not compile or launch (shared memory, registers): recorded, skipped
                if "CUDA error" in str(e):
                    raise  # the context is gone: every later config would fail too
                failed[name] = short_error(e)
    return {"configs": configs, "default": config_name(default), "times_us": times, "failed": failed}


def kernel_error(b: Bench, kernel: Kernel, layer: LoraLayer, case: Case, config: dict[str, int]) -> float:
    """The relative error of one kernel under `config` against its float32 reference."""
    fn, reference = kernel_call(b, kernel.kind, layer, case, base="zeros")
    with forced_config(b.sgl, kernel.kind, config):
        out = fn()
    return rel_error(out, reference())


def choose(b: Bench, kernel: Kernel, layer: LoraLayer, group: list[Case], runs: dict) -> dict[str, Any]:
    """The best config of `kernel` over the cases of one chunk size (`rank_configs`) whose output matches the
    reference in all of them; faster wrong ones are listed in `rejected` with their errors."""
    times = [runs[kernel, case]["times_us"] for case in group]
    configs = runs[kernel, group[0]]["configs"]
    rejected: dict[str, float] = {}
    for name in rank_configs(times):
        error = max(kernel_error(b, kernel, layer, case, configs[name]) for case in group)
        if error <= TOLERANCE:
            default = runs[kernel, group[0]]["default"]
            us = {case.tokens: t[name] for case, t in zip(group, times, strict=True)}
            default_us = {case.tokens: t.get(default) for case, t in zip(group, times, strict=True)}
            choice = {"config": configs[name], "name": name, "us": us, "default_us": default_us}
            return {**choice, "error": error, "rejected": rejected}
        rejected[name] = error
    failed = runs[kernel, group[0]]["failed"]
    raise SystemExit(
        f"{kernel.label} chunk {group[0].chunk}: no config ran and matched the reference: {rejected or failed}"
    )


Chosen = dict[Kernel, dict[int, dict[str, Any]]]


def tune(b: Bench, layers: list[LoraLayer], cases: list[Case], quick: bool) -> tuple[dict, Chosen]:
    """Search every kernel problem at every case, then choose per problem and chunk size."""
    spaces, problems = search_spaces(quick), kernel_problems(layers, b.rank)
    runs: dict[tuple[Kernel, Case], dict[str, Any]] = {}
    started = time.perf_counter()
    for case, (kernel, layer) in product(cases, problems.items()):
        run = runs[kernel, case] = tune_kernel(b, kernel, layer, case, spaces[kernel.kind])
        times = run["times_us"]
        best = min(times, key=times.__getitem__) if times else "-"
        print(
            f"[{time.perf_counter() - started:6.1f} s] {kernel.label:<28} {case.label:<18} "
            f"{len(run['configs'])} configs, {len(run['failed'])} failed, default {times.get(run['default'], 0.0):.2f}"
            f" us, fastest {best} {times.get(best, 0.0):.2f} us",
            flush=True,
        )
    chosen: Chosen = {}
    for kernel, layer in problems.items():
        for chunk in sorted({c.chunk for c in cases}):
            group = [c for c in cases if c.chunk == chunk]
            chosen.setdefault(kernel, {})[chunk] = choose(b, kernel, layer, group, runs)
    return runs, chosen


def show_choices(chosen: Chosen) -> None:
    """The chosen config per kernel problem and chunk size, its microseconds and SGLang's default's per `--tokens`."""
    rows = [
        [k.label, chunk, c["name"], tokens, c["default_us"][tokens], us, c["error"], len(c["rejected"])]
        for k, by_chunk in chosen.items()
        for chunk, c in by_chunk.items()
        for tokens, us in c["us"].items()
    ]
    columns = ["kernel", "chunk", "chosen", "tokens", "default us", "chosen us", "rel. error", "rejected"]
    print_table("csgmv configs chosen (GPU us per call)", columns, rows)


def write_configs(sgl: SimpleNamespace, chosen: Chosen, out_dir: Path) -> list[Path]:
    """The chosen configs as the loader reads them, merged into the files already in `out_dir`."""
    folder = out_dir / "csgmv_configs" / f"triton_{sgl.triton_version.replace('.', '_')}"
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for kernel, by_chunk in chosen.items():
        path = folder / sgl.tuning.get_lora_config_file_name(kernel.kind, kernel.K, kernel.R, kernel.S)
        table = json.loads(path.read_text()) if path.exists() else {}
        table.update({str(chunk): choice["config"] for chunk, choice in by_chunk.items()})
        path.write_text(json.dumps(dict(sorted(table.items(), key=lambda kv: int(kv[0]))), indent=4) + "\n")
        paths.append(path)
    return paths


def loader_configs(sgl: SimpleNamespace, chosen: Chosen, config_dir: Path | None) -> dict[str, dict[str, int]]:
    """`{"<kernel> chunk=<c>": config}` as SGLang's loader gives them, reading `config_dir`."""
    with loader_reading(sgl, config_dir):
        return {f"{k.label} chunk={c}": loader_config(sgl, k, c) for k, by_chunk in chosen.items() for c in by_chunk}


LayerFn = Callable[[SimpleNamespace, LoraLayer, LayerData, Any, torch.Tensor], torch.Tensor]


def measure(b: Bench, layer: LoraLayer, tokens: int, info: Any, run: LayerFn) -> dict[str, float]:
    """`{"us", "error"}` of one whole layer: checked adding into zeros, timed adding into the base output."""
    d = b.data(layer, tokens)
    out = run(b.sgl, layer, d, info, torch.zeros_like(d.base))
    error = rel_error(out, expand_reference(shrink_reference(d), d, layer))
    return {"us": b.rt.time_us(lambda: run(b.sgl, layer, d, info, d.base)), "error": error}


def time_csgmv_layers(
    b: Bench, layers: list[LoraLayer], cases: list[Case], config_dir: Path | None
) -> dict[str, dict[str, dict[str, float]]]:
    """`{case: {layer: {"us", "error"}}}` on `csgmv`, configs from SGLang's loader reading `config_dir`."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    with loader_reading(b.sgl, config_dir):
        for case, layer in product(cases, layers):
            out.setdefault(case.label, {})[layer.name] = measure(
                b, layer, case.tokens, b.csgmv_batch(case), csgmv_layer
            )
    return out


def time_triton_layers(b: Bench, layers: list[LoraLayer], cases: list[Case]) -> dict[str, dict[str, dict[str, float]]]:
    """`{case: {layer: {"us", "error"}}}` on the `triton` backend's kernels, a decode batch of T sequences."""
    by_tokens: dict[int, dict[str, dict[str, float]]] = {}
    for tokens, layer in product(sorted({c.tokens for c in cases}), layers):
        by_tokens.setdefault(tokens, {})[layer.name] = measure(b, layer, tokens, b.triton_batch(tokens), triton_layer)
    return {case.label: by_tokens[case.tokens] for case in cases}


# --- the run ---------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-config", type=Path, default=MODEL_CONFIGS / "qwen2.5-1.5b.json", help="HF folder or JSON")
    p.add_argument("--tiny", action="store_true", help="the tiny Qwen2 shape of _common.TINY_CONFIG instead")
    p.add_argument("--rank", type=int, default=16, help="the server's --max-lora-rank; the adapter has this rank")
    p.add_argument("--tokens", type=int, nargs="+", default=[128], help="tokens per step (decode: sequences)")
    p.add_argument(
        "--max-chunk-size",
        type=int,
        nargs="+",
        default=[128],
        choices=[16, 32, 64, 128],
        help="the server's --max-lora-chunk-size (SGLang's own default: 16); several: each is tuned",
    )
    p.add_argument("--max-loras-per-batch", type=int, default=8, help="adapter slots (ours: engine default 8)")
    p.add_argument("--out-dir", type=Path, default=RESULTS / "sglang_lora_configs", help="SGLANG_LORA_CONFIG_DIR")
    p.add_argument("--json", type=Path, default=None, help="default: results/sglang_lora_tune/<model>-r<rank>.json")
    p.add_argument("--quick", action="store_true", help="a reduced search space")
    p.add_argument("--calls", type=int, default=20, help="calls captured in one CUDA graph")
    p.add_argument("--samples", type=int, default=30, help="timed replays of the graph (median)")
    p.add_argument("--dry-run", action="store_true", help="print shapes, chunk sizes, search sizes, file names; exit")
    p.add_argument("--interpret", action="store_true", help="CPU smoke test under Triton's interpreter (float32)")
    args = p.parse_args(argv)
    if args.rank < 1 or args.max_loras_per_batch < 2 or min(args.tokens) < 1:
        p.error("--rank and --tokens must be >= 1, --max-loras-per-batch >= 2 (slot 0 and the adapter's)")
    return args


def model_name(args: argparse.Namespace) -> str:
    """The model's name for titles and file names: `tiny`, a config file's stem or its folder's name."""
    path = args.model_config
    if args.tiny:
        return "tiny"
    return path.parent.name if path.name == "config.json" else path.name if path.is_dir() else path.stem


def show_shapes(name: str, cfg: dict[str, Any], layers: list[LoraLayer], rank: int, cases: list[Case]) -> None:
    """The derived LoRA layer dims, their config files' K/R/S, and the chunk size of each token count."""
    rows = [
        [x.name, x.in_dim, "+".join(map(str, x.slices)), x.out_dim, str(x.offsets), x.max_slice]
        + [k.label for k in layer_kernels(x, rank)]
        for x in layers
    ]
    columns = ["layer", "in", "slices", "out", "offsets", "max slice", "shrink file", "expand file"]
    print_table(f"{name}: {cfg['num_hidden_layers']} layers, LoRA rank {rank}", columns, rows)
    print("cases: " + ", ".join(c.label for c in cases))


def show_plan(layers: list[LoraLayer], cases: list[Case], args: argparse.Namespace) -> None:
    """`--dry-run`: candidates per kernel problem and case (SGLang's default config not counted), file names."""
    spaces = search_spaces(args.quick)
    kernels = list(kernel_problems(layers, args.rank))
    rows = [[k.label, *(len(candidates(k, c.chunk, spaces[k.kind], None)) for c in cases)] for k in kernels]
    print_table("candidate configs (+ SGLang's default)", ["kernel", *(c.label for c in cases)], rows)
    for k in kernels:
        print(f"{args.out_dir}/csgmv_configs/triton_<version>/{k.file_name('<device>')}")


def compare(b: Bench, layers: list[LoraLayer], cases: list[Case], out_dir: Path) -> dict[str, Any]:
    """`{way: {case: {layer: {"us", "error"}}}}` for the WAYS: csgmv with SGLang's configs, csgmv with ours,
    the triton backend."""
    return {
        "csgmv_default": time_csgmv_layers(b, layers, cases, None),
        "csgmv_tuned": time_csgmv_layers(b, layers, cases, out_dir),
        "triton": time_triton_layers(b, layers, cases),
    }


def step_totals(ways: dict[str, Any], cases: list[Case], num_layers: int) -> dict[str, dict[str, float]]:
    """`{case: {way: microseconds of a decode step's LoRA}}` from `compare`'s `{way: {case: {layer: {"us"}}}}`."""
    return {
        c.label: {w: per_step_us({x: r["us"] for x, r in ways[w][c.label].items()}, num_layers) for w in WAYS}
        for c in cases
    }


def show_comparison(title: str, rows_by_layer: dict[str, list[float]], step: list[float], num_layers: int) -> None:
    """One case's table: per layer kind and per decode step (x `num_layers`) the WAYS' microseconds and ratios."""
    rows = [[name, d, t, x, t / d, x / t] for name, (d, t, x) in rows_by_layer.items()]
    d, t, x = step
    rows.append([f"decode step (x{num_layers})", d, t, x, t / d, x / t])
    columns = ["layer", "csgmv default us", "csgmv tuned us", "triton us", "tuned/default", "triton/tuned"]
    print_table(title, columns, rows)


def main() -> None:
    """Tune, write the config files, compare the three ways per layer and per decode step, write the JSON."""
    args = parse_args()
    cfg = model_config(None if args.tiny else config_json(args.model_config))
    name, layers = model_name(args), lora_layers(cfg)
    cases = tuning_cases(args.tokens, args.max_chunk_size)
    show_shapes(name, cfg, layers, args.rank, cases)
    if args.dry_run:
        show_plan(layers, cases, args)
        return
    rt = (
        Runtime("cpu", torch.float32, 1, 1)
        if args.interpret
        else Runtime("cuda", torch.bfloat16, args.calls, args.samples)
    )
    b = Bench(import_sglang(rt), rt, args.rank, args.max_loras_per_batch)
    if b.sgl.version != "0.5.17":
        print(f"warning: written against SGLang 0.5.17's internals; this is {b.sgl.version}")
    check_chunk_sizes(cases, args.max_chunk_size)
    started = time.perf_counter()
    out = args.json or RESULTS / "sglang_lora_tune" / f"{name}-r{args.rank}.json"
    record: dict[str, Any] = {
        "benchmark": "tune_sglang_lora",
        "command": shlex.join(["python", *sys.argv]),
        "model": name,
        "num_hidden_layers": cfg["num_hidden_layers"],
        "layers": [{"name": x.name, "in_dim": x.in_dim, "slices": list(x.slices)} for x in layers],
        "rank": args.rank,
        "cases": [c._asdict() for c in cases],
        "max_loras_per_batch": args.max_loras_per_batch,
        "quick": args.quick,
        "timing": {"unit": "GPU microseconds per call", "calls_per_graph": rt.calls, "samples": rt.samples},
        "sglang": b.sgl.version,
        "triton": b.sgl.triton_version,
        "device_name": b.sgl.device_name,
        "machine": machine_info(rt.device),
    }
    runs, chosen = tune(b, layers, cases, args.quick)
    show_choices(chosen)
    record["search"] = {
        f"{k.label} {c.label}": {key: run[key] for key in ("times_us", "failed")} for (k, c), run in runs.items()
    }
    record["chosen"] = {k.label: {str(c): choice for c, choice in by.items()} for k, by in chosen.items()}
    files = write_configs(b.sgl, chosen, args.out_dir)
    record["files"] = [str(p.relative_to(args.out_dir)) for p in files]
    record["tune_seconds"] = time.perf_counter() - started
    write_json(record, out)  # the search survives a failure in what follows

    wanted = {f"{k.label} chunk={c}": choice["config"] for k, by in chosen.items() for c, choice in by.items()}
    record["loader_default"] = loader_configs(b.sgl, chosen, None)
    record["loader_tuned"] = loaded = loader_configs(b.sgl, chosen, args.out_dir)
    record["loader_mismatch"] = {key: loaded[key] for key in wanted if loaded[key] != wanted[key]}
    if record["loader_mismatch"]:
        print(f"WARNING: SGLang's loader does not read back what was written: {record['loader_mismatch']}")
    record["layers_us"] = ways = compare(b, layers, cases, args.out_dir)
    record["decode_step_us"] = steps = step_totals(ways, cases, cfg["num_hidden_layers"])
    wrong = {f"{w} {c} {x}": r["error"] for w in WAYS for c, res in ways[w].items() for x, r in res.items()}
    if wrong := {key: e for key, e in wrong.items() if e > TOLERANCE}:
        print(f"WARNING: layers off the float32 reference by more than {TOLERANCE}: {wrong}")
    record["seconds"] = time.perf_counter() - started
    write_json(record, out)
    for c in cases:
        title = f"{name}, rank {args.rank}, {c.label}: LoRA kernels, GPU us per call"
        by_layer = {x.name: [ways[w][c.label][x.name]["us"] for w in WAYS] for x in layers}
        show_comparison(title, by_layer, [steps[c.label][w] for w in WAYS], cfg["num_hidden_layers"])
    config_dir = args.out_dir.resolve()
    print(f"{len(files)} config files under {config_dir} ({record['seconds']:.0f} s); serve with them:")
    chunk_flag = f"--max-lora-chunk-size {max(args.max_chunk_size)}"
    print(
        f"  SGLANG_LORA_CONFIG_DIR={config_dir} python3 -m sglang.launch_server ... --lora-backend csgmv {chunk_flag}"
    )


if __name__ == "__main__":
    main()
