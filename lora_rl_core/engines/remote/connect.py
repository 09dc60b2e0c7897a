"""The `server` and `sglang` kinds' clients: `connect(dialect, inputs)` gives one `HTTPEngine` per URL of
`engine.urls` (a `MultiEngine` over several), with every client setting of the `engine` section."""

from __future__ import annotations

import os

from lora_rl_core.config import SGLANG_DEFAULTS, RemoteEngine, SGLangEngineConfig
from lora_rl_core.engines.base import ServingEngine
from lora_rl_core.engines.multi import MultiEngine
from lora_rl_core.engines.records import BuiltEngine, EngineInputs
from lora_rl_core.engines.remote.client import HTTPEngine
from lora_rl_core.engines.remote.dialect import SGLANG, Dialect
from lora_rl_core.errors import ConfigError, EngineError, EngineUnavailable


def connect(dialect: Dialect, inputs: EngineInputs, urls: list[str] | None = None) -> BuiltEngine:
    """HTTP clients of `urls` (default `inputs.engine.urls`; the servers launched for the engine) in `dialect`,
    with the Bearer key (`inputs.api_key`, else the environment variable `engine.api_key_env`), the generation
    deadline `engine.timeout_s` and the tensor settings (`tensor_transport` as the run's plan resolved it,
    `tensor_layout`, `tensor_dtype`); SGLang clients also retire as `engine.sglang_retire` and
    `engine.sglang_abort` say (our server unloads without hanging).

    Raises:
        EngineError: no URLs, or a malformed URL; a server of a version the dialect does not know
            (`Dialect.versions`: asked here, once per URL; a server unreachable now is asked before its
            client's first call).
    """
    cfg = inputs.engine
    if not isinstance(cfg, RemoteEngine):
        raise ConfigError(f"engine.type {cfg.type} has no engine URLs to connect to")
    sglang = cfg if isinstance(cfg, SGLangEngineConfig) else SGLANG_DEFAULTS  # our server: no tensor options
    urls = list(urls if urls is not None else cfg.urls)
    if not urls:
        raise EngineError("give at least one engine URL, e.g. http://127.0.0.1:30000")
    clients = [
        HTTPEngine(
            dialect,
            url,
            api_key=inputs.api_key or os.environ.get(cfg.api_key_env),
            timeout_s=cfg.timeout_s,
            tensor_transport=inputs.tensor_transport or sglang.tensor_transport,
            retire=sglang.sglang_retire if dialect is SGLANG else "unload",
            tensor_layout=sglang.tensor_layout,
            tensor_dtype=sglang.tensor_dtype,
            abort=sglang.sglang_abort,
        )
        for url in urls
    ]
    try:
        for client in clients:  # a server of a version this client does not speak fails here, not mid-run
            try:
                client.check_version()
            except EngineUnavailable:  # not up (yet): a subscriber's engines may come later; asked then
                pass
    except BaseException:
        for client in clients:
            client.close()
        raise
    members: list[ServingEngine] = [*clients]
    return BuiltEngine(clients[0] if len(clients) == 1 else MultiEngine(members))
