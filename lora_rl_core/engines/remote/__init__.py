"""HTTP engines: one client (`HTTPEngine`) of an SGLang-API server, in the dialect of a real SGLang (`SGLANG`)
or of our engine server (`SERVER`).

`client`: the client; `dialect`: what differs between the two servers; `transport`: how adapter tensors travel
(`ipc`: SGLang's torch-multiprocessing payloads); `wire`: the wire format; `tracking`: requests in flight and
retired names; `connect`: the `server` and `sglang` kinds' builder (clients of `engine.urls`).
"""

from lora_rl_core.engines.remote.client import HTTPEngine
from lora_rl_core.engines.remote.dialect import SERVER, SGLANG, Dialect

__all__ = ["SERVER", "SGLANG", "Dialect", "HTTPEngine"]
