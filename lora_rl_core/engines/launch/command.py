"""Render the `python -m sglang.launch_server --enable-lora ...` command line for a run.

The flags and their checks mirror sglang 0.5.23 `sglang/srt/arg_groups/fields/lora.py` and
`server_args.py` (see docs/SGLANG.md): `--max-loaded-loras` must be at least
`--max-loras-per-batch`, `all` stands alone in `--lora-target-modules`, at most
`max_loras_per_batch - 1` adapters are pinned (the base model needs a slot: sglang#23141),
and the eviction policy is `lru` or `fifo` (`EngineConfig` checks that). Pinned adapters are rendered as JSON objects
`{"lora_name", "lora_path", "pinned": true}`, the others as `NAME=PATH`.

`launch_flags` adds what the resolved `engine.launch` (`resolve.resolve_launch`) sets beyond LoRA (backends,
memory fraction and saver, CUDA graphs);
`sglang_server_command` is the whole argv that `lora_rl_core.engines.launch.process` starts.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from lora_rl_core.adapters import check_adapter_name
from lora_rl_core.config import ENGINE_DEFAULTS, SGLANG_DEFAULT_PORT
from lora_rl_core.errors import ConfigError

if TYPE_CHECKING:
    from lora_rl_core.config import EngineLimits, LoRAConfig, ModelConfig, SGLangEngineConfig
    from lora_rl_core.engines.launch.resolve import ResolvedLaunch


LoraPath = tuple[str, str, bool]  # (name, path, pinned)


def sglang_launch_command(
    model_path: str,
    *,
    max_lora_rank: int,
    target_modules: Sequence[str] | str,
    max_loras_per_batch: int = ENGINE_DEFAULTS.max_loras_per_batch,
    max_loaded_loras: int | None = ENGINE_DEFAULTS.max_loaded_loras,
    eviction_policy: str = ENGINE_DEFAULTS.eviction_policy,
    lora_paths: Iterable[LoraPath] = (),
    host: str = "127.0.0.1",
    port: int = SGLANG_DEFAULT_PORT,
    python: str = "python",
    extra: Sequence[str] = (),
) -> list[str]:
    """The argv that starts an SGLang server with LoRA enabled for this pool.

    Args:
        model_path: base model folder or hub id (`--model-path`).
        max_lora_rank: largest adapter rank the pool accepts (`--max-lora-rank`).
        target_modules: module suffixes, or `all` / `all-linear` (rendered as `all`).
        max_loras_per_batch: GPU adapter slots, the base model takes one.
        max_loaded_loras: CPU-resident cap (None = unlimited); >= `max_loras_per_batch`.
        eviction_policy: `lru` or `fifo` (GPU slots).
        lora_paths: `(name, path, pinned)` adapters to load at start.
        host, port: where the server listens.
        python: interpreter to run.
        extra: further arguments appended as given.

    Returns:
        The argv list; `shlex.join` it for a shell.

    Raises:
        ConfigError: a combination SGLang would refuse at start, named with its flag.
    """
    targets = _targets(target_modules)
    paths = list(lora_paths)
    _check_pool(max_lora_rank, max_loras_per_batch, max_loaded_loras, eviction_policy, paths)
    argv = [python, "-m", "sglang.launch_server", "--model-path", model_path, "--host", host, "--port", str(port)]
    argv += ["--enable-lora", "--max-lora-rank", str(max_lora_rank), "--lora-target-modules", *targets]
    argv += ["--max-loras-per-batch", str(max_loras_per_batch)]
    if max_loaded_loras is not None:
        argv += ["--max-loaded-loras", str(max_loaded_loras)]
    argv += ["--lora-eviction-policy", eviction_policy]
    if paths:
        argv += ["--lora-paths", *(_render_path(p) for p in paths)]
    return argv + list(extra)


def _targets(target_modules: Sequence[str] | str) -> list[str]:
    targets = [target_modules] if isinstance(target_modules, str) else list(target_modules)
    targets = ["all" if t == "all-linear" else t for t in targets]
    if not targets:
        raise ConfigError("--lora-target-modules: name at least one module suffix, or `all`")
    if "all" in targets and len(targets) > 1:
        raise ConfigError(f"--lora-target-modules: `all` must stand alone, got {targets}")
    return targets


def _check_pool(rank: int, per_batch: int, loaded: int | None, policy: str, paths: list[LoraPath]) -> None:
    if rank < 1:
        raise ConfigError(f"--max-lora-rank must be >= 1, got {rank}")
    if per_batch < 1:
        raise ConfigError(f"--max-loras-per-batch must be >= 1, got {per_batch}")
    if loaded is not None and loaded < per_batch:
        raise ConfigError(
            f"--max-loaded-loras ({loaded}) must be >= --max-loras-per-batch ({per_batch}): "
            "SGLang refuses a CPU cap smaller than the GPU pool"
        )
    names = [name for name, _, _ in paths]
    for name in names:
        try:
            check_adapter_name(name)
        except ValueError as exc:
            raise ConfigError(f"--lora-paths: {exc}") from None
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ConfigError(f"--lora-paths: adapter names {duplicates} appear more than once")
    pinned = [name for name, _, pin in paths if pin]
    if len(pinned) > per_batch - 1:
        raise ConfigError(
            f"--lora-paths pins {len(pinned)} adapters {pinned}, but at most --max-loras-per-batch - 1 "
            f"= {per_batch - 1} may be pinned: the base model needs a free slot (sglang#23141)"
        )
    if loaded is not None and len(paths) > loaded:
        raise ConfigError(f"--lora-paths lists {len(paths)} adapters, more than --max-loaded-loras ({loaded})")


def _render_path(path: LoraPath) -> str:
    name, location, pinned = path
    if pinned:
        return json.dumps({"lora_name": name, "lora_path": location, "pinned": True})
    return f"{name}={location}"


def sglang_launch_command_from_config(
    engine: EngineLimits,
    model: ModelConfig,
    lora: LoRAConfig,
    *,
    model_path: str | None = None,
    lora_paths: Iterable[LoraPath] = (),
    host: str = "127.0.0.1",
    port: int = SGLANG_DEFAULT_PORT,
    python: str = "python",
    extra: Sequence[str] = (),
) -> list[str]:
    """`sglang_launch_command` for a run's `engine`, `model` and `lora` sections: base model, dtype, LoRA rank
    and targets, and the engine section's pool (`max_loras_per_batch`, `max_loaded_loras`, `eviction_policy`,
    `max_lora_rank`, default `lora.rank`).

    Args:
        model_path: overrides `model.name_or_path` (an offline alias such as
            `smollm2-135m-instruct` is rendered as its hub id).

    Raises:
        ConfigError: as `sglang_launch_command`.
    """
    from lora_rl_core.models import OFFLINE_MODELS  # lazy: pulls in torch

    name = model_path or model.name_or_path
    name = OFFLINE_MODELS[name].hub_id if name in OFFLINE_MODELS else name
    targets = lora.target_modules
    if lora.exclude_modules:
        if isinstance(targets, str):
            raise ConfigError(
                "lora.exclude_modules cannot be expressed with SGLang's `--lora-target-modules all`: "
                "list lora.target_modules explicitly"
            )
        targets = tuple(t for t in targets if t not in set(lora.exclude_modules))
    model_flags = ["--dtype", model.dtype]
    if model.revision:
        model_flags += ["--revision", model.revision]
    if model.trust_remote_code:
        model_flags.append("--trust-remote-code")
    return sglang_launch_command(
        name,
        max_lora_rank=engine.max_lora_rank or lora.rank,
        target_modules=targets,
        max_loras_per_batch=engine.max_loras_per_batch,
        max_loaded_loras=engine.max_loaded_loras,
        eviction_policy=engine.eviction_policy,
        lora_paths=lora_paths,
        host=host,
        port=port,
        python=python,
        extra=[*model_flags, *extra],
    )


def launch_flags(launch: ResolvedLaunch) -> list[str]:
    """The non-LoRA flags of a resolved `engine.launch` (`resolve.resolve_launch`): backends (omitted where
    SGLang's own choice stands), memory fraction and saver, decode CUDA graphs (or none), then `extra_args`."""
    flags: list[str] = []
    for flag, value in (
        ("--attention-backend", launch.attention_backend),
        ("--sampling-backend", launch.sampling_backend),
        ("--lora-backend", launch.lora_backend),
        ("--grammar-backend", launch.grammar_backend),
    ):
        if value is not None:
            flags += [flag, value]
    if launch.mem_fraction_static is not None:
        flags += ["--mem-fraction-static", f"{launch.mem_fraction_static:.3f}"]
    if launch.memory_saver:
        flags.append("--enable-memory-saver")
    if launch.tp_size > 1:
        flags += ["--tp-size", str(launch.tp_size)]
    if launch.cuda_graph_max_bs is None:
        flags.append("--disable-cuda-graph")
    else:
        flags += [
            "--cuda-graph-max-bs-decode",
            str(launch.cuda_graph_max_bs),
            "--cuda-graph-backend-prefill",
            "disabled",
        ]
    return flags + list(launch.extra_args)


def sglang_server_command(
    engine: SGLangEngineConfig,
    model: ModelConfig,
    lora: LoRAConfig,
    model_path: str,
    resolved: ResolvedLaunch,
    port: int | None = None,
) -> list[str]:
    """The argv `engine.launch` starts: `sglang_launch_command_from_config` for the local model folder
    `model_path`, with `engine.launch`'s interpreter and address (`port`: another than `engine.launch.port`)
    and the `resolved` flags (`launch_flags`).

    Raises:
        ConfigError: as `sglang_launch_command`.
    """
    launch = engine.launch
    return sglang_launch_command_from_config(
        engine,
        model,
        lora,
        model_path=model_path,
        host=launch.host,
        port=launch.port if port is None else port,
        python=launch.interpreter(),
        extra=launch_flags(resolved),
    )


def render(argv: Sequence[str]) -> str:
    """The argv as one shell-quoted line (JSON `--lora-paths` entries stay intact)."""
    return shlex.join(argv)
