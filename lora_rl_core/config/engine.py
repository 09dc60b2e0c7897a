"""The `engine` section: which inference engine makes the rollouts, its limits, and the SGLang server a run
may launch (`engine.launch`).

The section is keyed by `engine.type`: `embedded` (`EmbeddedEngineConfig`), `server`
(`ServerEngineConfig`) and `sglang` (`SGLangEngineConfig`) each carry the shared limits
(`EngineLimits`) and only their own options, so `engine.launch` with `type: embedded` is a config error
naming the kind (`config.base.keyed_by_type`)."""

from __future__ import annotations

import sys
from typing import Annotated, Literal

from pydantic import Field, model_validator

from lora_rl_core.config.base import (
    SGLANG_DEFAULT_PORT,
    EvictionPolicy,
    FrozenDict,
    IpcLayout,
    ReadOnlyMapping,
    Section,
    SGLangAbort,
    SGLangRetire,
    TensorDtype,
    TensorTransport,
    keyed_by_type,
)


class SGLangLaunchConfig(Section):
    """Start an SGLang server as a subprocess of the run (`engine.type: sglang`), with the flags that work
    for LoRA on one GPU (docs/SGLANG.md, "Launch"), and stop it with its process group when the run ends."""

    enabled: bool = False
    """Launch the server; `engine.urls` must then be empty (the run talks to the server it started)."""
    python: str | None = None
    """Interpreter that runs `-m sglang.launch_server`; None = the one running lora-rl (`make install-gpu` puts
    SGLang beside it). SGLang may live in another environment than ours: name its interpreter here."""

    env: Annotated[dict[str, str], ReadOnlyMapping] = FrozenDict()
    """Extra environment of the server process, e.g. `{PYTHONPATH: /opt/sglang-site}`."""
    host: str = "127.0.0.1"
    """Bind address of the server (loopback: only this machine's run talks to it)."""
    port: int = Field(SGLANG_DEFAULT_PORT, ge=1, le=65535)
    """Port of the server (SGLang's `--port`)."""
    mem_fraction_static: float | Literal["auto"] | None = "auto"
    """Fraction of GPU memory SGLang takes for weights and KV cache (`--mem-fraction-static`). `auto`: sized by
    the run's memory plan (`lora_rl_core.memory`) from the model, the rollout batch and what a trainer on the
    same GPU needs; SGLang's own default where no trainer shares the GPU (`lora-rl serve`, split GPUs).
    None = SGLang's own default (about 0.84 on an 80 GB GPU); refused where a trainer shares SGLang's GPU (it
    leaves the trainer too little). A number beside a trainer is checked by the plan: its KV cache must hold the
    rollout batch and fit beside both models' weights."""
    memory_saver: bool | Literal["auto"] = "auto"
    """`--enable-memory-saver`: SGLang frees its KV cache during each train phase and takes it back before the
    next rollout (`/release_memory_occupation`, tag `kv_cache`; base weights and LoRA buffers stay). `auto`:
    on where a trainer in this process shares the GPU, rollouts are synchronous (the server is idle while
    training), the installed SGLang has `torch_memory_saver`, and the memory plan finds that releasing the KV
    cache buys the trainer a larger micro-batch (or no recomputation) than keeping both side by side."""
    cuda_graph_max_bs: int | Literal["auto"] | None = "auto"
    """Largest decode batch captured as a CUDA graph (`--cuda-graph-max-bs-decode`, prefill graphs off). `auto`:
    the rollout batch (prompts x group size, times the rollouts in flight) or SGLang's own default for the GPU
    (256 on an 80 GB GPU), whichever is larger; None = `--disable-cuda-graph` (starts faster, decodes ~10x
    slower)."""
    attention_backend: str = "auto"
    """`--attention-backend`. `auto`: SGLang's own choice (FlashAttention-3 on Hopper) where the installed
    SGLang has its kernels; else `flashinfer` where usable, else `triton` (the offline carry brings FA3 only in
    parts: docs/SGLANG.md, "GPU host"). On one H100 the 1.5B rollout took 1.72 s with FA3 and 1.64 s with
    `triton` (LoRA-bound decoding; `benchmarks/results/gpu_scale/README.md`, "One GPU, A/B")."""
    sampling_backend: str = "auto"
    """`--sampling-backend`. `auto`: SGLang's own choice (`flashinfer`) where usable, else `pytorch`."""
    lora_backend: str = "auto"
    """`--lora-backend`. `auto`: `triton` (SGLang's default, `csgmv`, decodes a rollout batch of 128 about 1.4x
    slower on an H100: benchmarks/results/gpu_scale/lora-backend/rollout-*.json; tuned for the 1.5B and 7B
    shapes its kernels still take 2x the `triton` kernels' time: benchmarks/results/sglang_lora_tune/)."""
    grammar_backend: str = "none"
    """`--grammar-backend`; `none`: rollouts use no constrained decoding."""
    extra_args: tuple[str, ...] = ()
    """Further `sglang.launch_server` arguments, appended as given."""
    startup_timeout_s: float = Field(900.0, gt=0)
    """How long to wait for `/health` after the start, seconds (a cold start with CUDA graphs takes ~3 min)."""

    @model_validator(mode="after")
    def _in_range(self) -> SGLangLaunchConfig:
        fraction, graphs = self.mem_fraction_static, self.cuda_graph_max_bs
        if isinstance(fraction, float) and not 0 < fraction < 1:
            raise ValueError(f"engine.launch.mem_fraction_static must be in (0, 1), `auto` or null, got {fraction}")
        if isinstance(graphs, int) and graphs < 1:
            raise ValueError(f"engine.launch.cuda_graph_max_bs must be >= 1, `auto` or null, got {graphs}")
        return self

    def interpreter(self) -> str:
        """`python`, or this process's interpreter."""
        return self.python or sys.executable


class EngineLimits(Section):
    """What every engine kind has: the generation deadline, the adapter limits (SGLang's names) and how a new
    version reaches the engines."""

    timeout_s: float = Field(600.0, gt=0)
    """Deadline of one generate call, seconds."""
    max_loras_per_batch: int = Field(8, ge=1)
    """Distinct adapters in one forward batch, the base model counted (SGLang `--max-loras-per-batch`)."""
    max_loaded_loras: int | None = Field(None, ge=1)
    """Resident adapter cap; None = unlimited (SGLang `--max-loaded-loras`)."""
    eviction_policy: EvictionPolicy = "lru"
    """Which resident adapter is evicted when `max_loaded_loras` are resident and another is needed: `lru`
    the least recently loaded or used by an admitted request, `fifo` the one resident longest. Pinned
    adapters are never evicted; no effect while `max_loaded_loras` is None (SGLang `--lora-eviction-policy`)."""
    max_lora_rank: int | None = Field(None, ge=1)
    """Reject adapters of a higher rank (SGLang `--max-lora-rank`)."""
    sync: Literal["tensor", "store"] = "tensor"
    """How a new adapter version reaches the engines: in-memory tensors, or read back from the store."""

    @model_validator(mode="after")
    def _caps(self) -> EngineLimits:
        if self.max_loaded_loras is not None and self.max_loaded_loras < self.max_loras_per_batch:
            raise ValueError("engine.max_loaded_loras must be >= engine.max_loras_per_batch")
        return self


class RayReplicas(Section):
    """The kinds that can run as Ray engine replicas (`embedded`, and `sglang` with `launch.enabled`)."""

    ray_replicas: int = Field(0, ge=0)
    """0 runs the engine in this process (or talks to `urls`); N >= 1 runs N engine replicas as Ray actors,
    joining the cluster of `RAY_ADDRESS` or starting a local one: `embedded` replicas (one CPU each,
    `lora_rl_core/engines/launch/ray_replicas.py`), or with `type: sglang` and `launch.enabled` actors that each
    launch and own an SGLang server (`lora_rl_core/engines/launch/ray_sglang.py`). The samples of a prompt stay
    on one replica; adapter versions load into every replica."""
    ray_gpus_per_replica: float = Field(1.0, ge=0, le=1)
    """GPUs each Ray engine replica reserves when it uses CUDA (an SGLang replica always; an embedded one when
    `model.device` is cuda); a fraction shares a GPU, e.g. 0.5 beside a trainer rank of 0.5."""
    ray_replace_dead: bool = True
    """With `ray_replicas`: a replica whose actor died is replaced by a new actor, which reloads the adapters
    the dead one held (same names, same weights), and the failed call is retried there once; False = the
    call fails with `EngineUnavailable` naming the replica (the step fails; resume the run)."""


class EmbeddedEngineConfig(EngineLimits, RayReplicas):
    """`engine.type: embedded` (the default): transformers + PEFT in this process, or in Ray replicas."""

    type: Literal["embedded"] = "embedded"
    """The kind: in-process transformers + PEFT (`lora_rl_core/engines/embedded`)."""
    max_batch_size: int = Field(64, ge=1)
    """Sequences per forward batch."""


class RemoteEngine(EngineLimits):
    """What the HTTP kinds share: the servers' URLs and their Bearer key."""

    urls: tuple[str, ...] = ()
    """Engine URLs; requests are spread across them."""
    api_key_env: str = "LORA_RL_API_KEY"
    """Environment variable holding the engines' Bearer key (never stored in the config snapshot)."""


class ServerEngineConfig(RemoteEngine):
    """`engine.type: server`: clients of running lora-rl engine servers (`lora-rl serve`) at `urls`."""

    type: Literal["server"] = "server"
    """The kind: HTTP clients of our engine servers (`lora_rl_core/engines/serve`)."""

    @model_validator(mode="after")
    def _has_urls(self) -> ServerEngineConfig:
        if not self.urls:
            raise ValueError("engine.type server needs engine.urls, e.g. [http://127.0.0.1:8000]")
        return self


class SGLangEngineConfig(RemoteEngine, RayReplicas):
    """`engine.type: sglang`: clients of real SGLang servers, at `urls` or launched by the run (`launch`)."""

    type: Literal["sglang"] = "sglang"
    """The kind: HTTP clients of SGLang servers (docs/SGLANG.md)."""
    tensor_transport: TensorTransport = "auto"
    """`sglang` with `sync: tensor`: how the tensors reach SGLang's `/load_lora_adapter_from_tensors`. `ipc`:
    CUDA IPC handles (the server on this host, CUDA here); `inline`: the data in the request (any host);
    `file`: a PEFT folder written for the load into this host's temporary directory and removed once the server
    has read it (a server on this host; no wait for the store); `disk`: the published version's folder
    (`/load_lora_adapter`, once written to the store); `auto`: `ipc` for a server on a loopback address when
    CUDA is available, else `disk`, and `file` for a server this run launches on another GPU than the
    trainer's (`build_run`). A refused tensor load falls back to the published folder (docs/SGLANG.md, "Tensor
    path")."""
    tensor_layout: IpcLayout = "host"
    """`tensor_transport` `ipc`: how the adapter's CUDA tensors are shared (`engines.remote.ipc`). `per-tensor`: one
    CUDA IPC handle per tensor (SGLang opens each, then copies each to its CPU pool); `packed`: views into one
    CUDA buffer (one handle); `host`: that buffer, copied to host memory once by the server while it reads
    the request, so SGLang's per-tensor copies to its CPU pool copy nothing (about 1.7x an adapter's CPU
    memory per resident version). Measured on an H100, rank 8 on Qwen2.5-0.5B shapes: publish -> first
    completion 113 / 100 / 55 ms (benchmarks/results/sglang-real/README.md, 5a)."""
    tensor_dtype: TensorDtype = "bfloat16"
    """`sglang` tensor loads: the dtype the adapter tensors are sent in. SGLang keeps them as sent and casts to
    its LoRA pool's dtype (the served model's, `--dtype`; bfloat16 for SmolLM2 and Qwen2.5 with `auto`) at
    each first use, so sending that dtype halves the bytes and skips the cast; `keep` sends the trainer's
    (float32). Set `float16` for a float16 server."""
    sglang_retire: SGLangRetire = "unload"
    """`sglang`: how a stale version is retired. `unload`: retired in our client (refused from then on), then,
    once none of our requests uses it, `/unload_lora_adapter` (frees SGLang's memory); `keep`: retired in our
    client only, the weights stay in SGLang's CPU pool, one adapter's size per version (docs/HOTSWAP.md,
    "Bounded residency on SGLang"). Safe only while every request reaches SGLang through this client (a
    training run, or `lora-rl serve` in front of SGLang): SGLang 0.5.17's unload waits forever after other
    clients' requests with n > 1 or aborted ones."""
    sglang_abort: SGLangAbort = "detach"
    """`sglang`: what aborting a request does. `detach`: it ends at once for the caller and SGLang finishes it
    (its tokens are wasted, bounded by `max_new_tokens`); an `abort` pause pauses SGLang in `retract` mode.
    `forward`: `/abort_request` to SGLang, whose 0.5.17 never releases the adapter reference of a request
    aborted in its queue (sglang#34205), so a later unload of that adapter hangs."""
    launch: SGLangLaunchConfig = SGLangLaunchConfig()
    """Start a local SGLang server for this run (`engine.type: sglang`)."""

    @model_validator(mode="after")
    def _one_source(self) -> SGLangEngineConfig:
        if self.launch.enabled == bool(self.urls):
            raise ValueError(
                "engine.type sglang needs engine.urls (servers already running) or engine.launch.enabled: true "
                "(the run starts one), not both"
            )
        if self.ray_replicas and not self.launch.enabled:
            raise ValueError(
                "engine.ray_replicas with engine.type sglang needs engine.launch.enabled (each "
                "replica launches its own server)"
            )
        return self


EngineConfig = Annotated[
    EmbeddedEngineConfig | ServerEngineConfig | SGLangEngineConfig,
    Field(discriminator="type"),
    keyed_by_type("embedded"),
]
"""The `engine` section, keyed by `engine.type` (a mapping without `type` is `embedded`)."""

ENGINE_DEFAULTS = EmbeddedEngineConfig()
"""The shared engine options' defaults, for the engine classes' own keyword defaults (one source: this file)."""
SGLANG_DEFAULTS = SGLangEngineConfig.model_construct()
"""The `sglang` kind's defaults (tensor transport, layout, dtype, retire, abort) for the HTTP client's keyword
defaults; built without validation (it has neither `urls` nor `launch`)."""


def ray_replicas(engine: EngineConfig) -> int:
    """`engine.ray_replicas`, 0 for a kind without replicas (`server`)."""
    return engine.ray_replicas if isinstance(engine, RayReplicas) else 0


def sglang_section(engine: EngineConfig, needed_by: str) -> SGLangEngineConfig:
    """`engine` as the `sglang` kind, for code that only an SGLang engine reaches.

    Raises:
        ConfigError: `engine.type` is another kind (naming `needed_by`, what asked).
    """
    if not isinstance(engine, SGLangEngineConfig):
        from lora_rl_core.errors import ConfigError  # lazy: errors is not a config module

        raise ConfigError(f"{needed_by} needs engine.type: sglang, not {engine.type}")
    return engine
