"""The `sglang` kind's builders: clients of the servers at `engine.urls`, or of servers this run launches
(`engine.launch.enabled`: one subprocess, or with `engine.ray_replicas` one server per Ray actor)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from lora_rl_core.config import sglang_section
from lora_rl_core.engines.launch.process import launch_sglang
from lora_rl_core.engines.launch.ray_sglang import start_sglang_replicas
from lora_rl_core.engines.remote.connect import connect
from lora_rl_core.engines.remote.dialect import SGLANG
from lora_rl_core.engines.spec import BuiltEngine, EngineInputs
from lora_rl_core.errors import ConfigError


def sglang_engine(inputs: EngineInputs) -> BuiltEngine:
    """Clients of `engine.urls`, or (`engine.launch.enabled`) of an SGLang server started here and owned by
    the result (log: `<log_dir>/sglang.log`; stopped with its process group when the engine closes, or when
    connecting fails).

    Raises:
        ConfigError: launching without the model or lora section.
        ModelError / EngineError: the model folder cannot be had, or the server did not become healthy.
    """
    engine = sglang_section(inputs.engine, "the sglang engine")
    if not engine.launch.enabled:
        return connect(SGLANG, inputs)
    if inputs.model is None or inputs.lora is None:
        raise ConfigError("engine.launch needs the model and lora sections (EngineInputs)")
    log = (inputs.log_dir or Path.cwd()) / "sglang.log"
    server = launch_sglang(engine, inputs.model, inputs.lora, log, resolved=inputs.launch, plan=inputs.launch_plan)
    try:
        built = connect(SGLANG, inputs, [server.url])
    except BaseException:
        server.stop()
        raise
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
