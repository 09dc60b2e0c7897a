"""The `sglang` kind's builders: clients of the servers at `engine.urls`, or of servers this run launches
(`engine.launch.enabled`: one subprocess, one per GPU of the run's placement, or with `engine.ray_replicas` one
server per Ray actor)."""

from __future__ import annotations

import dataclasses
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from lora_rl_core.config import sglang_section
from lora_rl_core.engines.launch.process import SGLangServer, launch_sglang
from lora_rl_core.engines.launch.ray_sglang import start_sglang_replicas
from lora_rl_core.engines.records import BuiltEngine, EngineInputs
from lora_rl_core.engines.remote.connect import connect
from lora_rl_core.engines.remote.dialect import SGLANG
from lora_rl_core.errors import ConfigError


def sglang_engine(inputs: EngineInputs) -> BuiltEngine:
    """Clients of `engine.urls`, or (`engine.launch.enabled`) of the SGLang servers started here and owned by
    the result: one, or one per GPU of the plan's placement (`ResolvedLaunch.gpus`; ports `engine.launch.port
    + i`), started together (logs: `<log_dir>/sglang.log`, `sglang-<i>.log` for i >= 1; each stopped with its
    process group when the engine closes, or when a start or connecting fails). Several servers are one
    `MultiEngine`: a group's samples on one server, groups dealt round-robin, versions loaded into every one.

    Raises:
        ConfigError: launching without the model or lora section.
        ModelError / EngineError: the model folder cannot be had, or a server did not become healthy.
    """
    engine = sglang_section(inputs.engine, "the sglang engine")
    if not engine.launch.enabled:
        return connect(SGLANG, inputs)
    model, lora = inputs.model, inputs.lora
    if model is None or lora is None:
        raise ConfigError("engine.launch needs the model and lora sections (EngineInputs)")
    count = inputs.launch.servers if inputs.launch is not None else 1
    logs = [(inputs.log_dir or Path.cwd()) / ("sglang.log" if i == 0 else f"sglang-{i}.log") for i in range(count)]

    def start(i: int) -> SGLangServer:
        return launch_sglang(engine, model, lora, logs[i], resolved=inputs.launch, plan=inputs.launch_budget, index=i)

    with ThreadPoolExecutor(count) as pool:  # SGLang's start is minutes: the servers start side by side
        starts = [pool.submit(start, i) for i in range(count)]
    servers = [s.result() for s in starts if s.exception() is None]
    try:
        failed = next((s.exception() for s in starts if s.exception() is not None), None)
        if failed is not None:
            raise failed
        built = connect(SGLANG, inputs, [server.url for server in servers])
    except BaseException:
        for server in servers:
            server.stop()
        raise
    for server in servers:
        built.owned.append(server.stop)
        built.servers.append(server)
    return built


def sglang_replicas(inputs: EngineInputs) -> BuiltEngine:
    """`engine.ray_replicas` Ray actors that each launch and own an SGLang server
    (`launch.ray_sglang.start_sglang_replicas`), and clients of their servers here.

    Raises:
        ConfigError / EngineError: as `start_sglang_replicas`.
    """
    # a tokenizer object does not travel to actors; each replica resolves its launch flags on its own host
    travelling = dataclasses.replace(inputs, tokenizer=None, launch=None)
    return start_sglang_replicas(travelling, lambda urls: connect(SGLANG, inputs, urls))
