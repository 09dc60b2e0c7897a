"""A small SGLang server for the protocol benchmarks (`hotswap_stress.py`, `sglang_soak.py`,
`sglang_hazards.py`): launched by our launcher (`launch_sglang`) on a model folder, eager (no CUDA graph capture:
these measure the protocol, not speed), with a small static memory fraction so that several fit one GPU, and
LoRA on q_proj/v_proj; plus what the benchmarks read from a running server (its adapters, its memory).
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
from _common import ROOT


def launch_small_sglang(
    model_dir: Path,
    log_path: Path,
    *,
    rank: int,
    port: int,
    python: str | None = None,
    pythonpath: str | None = None,
    mem_fraction: float = 0.15,
    max_loras_per_batch: int = 4,
    extra_args: Sequence[str] = (),
) -> Any:
    """Start SGLang on `model_dir` (bfloat16) at 127.0.0.1:`port` and wait until it is healthy; returns the
    `SGLangServer` (stop it with `.stop()`). `python`/`pythonpath`: SGLang's interpreter and its PYTHONPATH
    (None: this interpreter, inherited path); `extra_args` go to `sglang.launch_server` as given.

    Raises:
        EngineError: the server did not become healthy (the log's tail is in the message).
    """
    from lora_rl_core.config import config_from_dict, sglang_section
    from lora_rl_core.engines.launch.process import launch_sglang

    launch: dict[str, Any] = {"enabled": True, "port": port, "python": python, "mem_fraction_static": mem_fraction}
    launch["cuda_graph_max_bs"] = None  # eager: no capture time
    # the backends every protocol run on the GPU host used (docs/SGLANG.md, "GPU host"): the carry's SGLang has
    # no FA3 kernels and no FlashInfer JIT; a start with `auto` on SmolLM2 shapes died in its warm-up there
    launch.update(attention_backend="triton", sampling_backend="pytorch", lora_backend="triton")
    launch["extra_args"] = list(extra_args)
    if pythonpath:
        launch["env"] = {"PYTHONPATH": pythonpath}
    cfg = config_from_dict(
        {
            "model": {"name_or_path": str(model_dir), "dtype": "bfloat16"},
            "lora": {"rank": rank, "target_modules": ["q_proj", "v_proj"]},
            "engine": {"type": "sglang", "max_loras_per_batch": max_loras_per_batch, "launch": launch},
        }
    )
    return launch_sglang(sglang_section(cfg.engine, "this benchmark"), cfg.model, cfg.lora, log_path)


@contextlib.contextmanager
def front_door(
    sglang_url: str, model_dir: Path, log_path: Path, *, port: int, overrides: Sequence[str] = (),
    start_timeout_s: float = 120.0,
) -> Iterator[str]:  # fmt: skip
    """`lora-rl serve engine.type=sglang engine.urls=[sglang_url]` in a process of its own (as users run it, and
    with its own interpreter lock: the benchmark's client threads do not slow its control calls), on
    127.0.0.1:`port`, started and stopped as `launch_sglang`'s servers are (`SGLangServer`: own process group,
    healthy within `start_timeout_s`, SIGTERM then SIGKILL); yields its URL. `overrides` are more config
    overrides (`engine.timeout_s=60`).

    Raises:
        EngineError: it exited or was not healthy in time (the log's tail is in the message).
    """
    from lora_rl_core.engines.launch.process import SGLangServer

    store = log_path.parent / "front-door-store"
    args = [sys.executable, "-m", "cli.main", "serve", f"model.name_or_path={model_dir}", "engine.type=sglang"]
    args += [f"engine.urls=[{sglang_url}]", f"store.uri=file://{store}", "--port", str(port), *overrides]
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    server = SGLangServer(
        args, url=f"http://127.0.0.1:{port}", log_path=log_path, env={"PYTHONPATH": path},
        startup_timeout_s=start_timeout_s, label="lora-rl serve (front door)",
    )  # fmt: skip
    with server:
        yield server.url


def listed_adapters(url: str, timeout_s: float = 10.0) -> list[str] | None:
    """The adapters a server lists (`/v1/models` cards with a `parent`); None when it does not answer."""
    try:
        cards = httpx.get(f"{url}/v1/models", timeout=timeout_s).json()["data"]
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return None
    return [card["id"] for card in cards if card.get("parent") and not card.get("alias_of")]


def server_facts(url: str, pgid: int | None) -> dict[str, Any]:
    """Adapters the server lists and the resident memory of its process group (MB); None where unknown."""
    listed = listed_adapters(url)
    return {"adapters_listed": None if listed is None else len(listed), "rss_mb": group_rss_mb(pgid)}


def group_rss_mb(pgid: int | None) -> float | None:
    """Sum of VmRSS of the processes in group `pgid` (Linux `/proc`), MB."""
    if pgid is None:
        return None
    total_kb, seen = 0, False
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) != pgid:  # fields after the name: state, ppid, pgrp
                continue
            for line in (stat.parent / "status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total_kb += int(line.split()[1])
                    seen = True
        except (OSError, IndexError, ValueError):
            continue
    return round(total_kb / 1024, 1) if seen else None
