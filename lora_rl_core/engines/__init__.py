"""Inference engines behind two protocols, split by who uses them (`RolloutEngine`: what a training step
needs; `ServingEngine`: that and what serving needs), with SGLang's LoRA semantics.

A folder per subsystem, each touching only `base`, `records` and the rooms below it:

* `base`: the protocol and its records (`GenerationRequest`, `Completion`, `FinishReason`, `SamplingParams`);
  `records`: what an engine builder reads (`EngineInputs`) and returns (`BuiltEngine`: the engine and what it owns).
* `embedded/`: the in-process transformers + PEFT engine (`engine`: lifecycle, deadlines, worker thread;
  `requests`: queue, admission, abort; `peft_model`: model and adapter injection; `generation`: batched
  generation; `pool`: adapter registry and resident pool; `scheduler`: batch formation; `build`).
* `remote/`: the HTTP client of SGLang-API servers (`client.HTTPEngine`), their `dialect` (a real SGLang or
  our server), tensor `transport` and `ipc` payloads, the `wire` format, requests in flight (`tracking`),
  and the clients of `engine.urls` (`connect`).
* `serve/`: our SGLang-compatible server, `lora-rl serve` (`app`: routes; `api`: bodies and answers;
  `adapters`: load/unload routes; `metrics`: Prometheus).
* `launch/`: what a run starts: the SGLang command line (`command`) and process (`process`), the `sglang`
  kind's builders (`sglang`), replicas as Ray actors (`ray_replicas`: any engine kind; `ray_sglang`: actors
  that own SGLang servers).
* `multi`: several engines behind one (`MultiEngine`); `registry`: `engine.type` -> its builder
  (`ENGINE_KINDS`, `build_engine`), the one place an engine is built from settings.

Adapter names, files and checks: `lora_rl_core.adapters`.
"""

from lora_rl_core.engines.base import (
    ABORT_REASONS,
    PAUSE_MODES,
    Completion,
    FinishReason,
    GenerationRequest,
    RolloutEngine,
    SamplingParams,
    ServingEngine,
    aborted_completion,
    unknown_adapter_message,
)
from lora_rl_core.engines.embedded.engine import EmbeddedEngine
from lora_rl_core.engines.multi import MultiEngine
from lora_rl_core.engines.records import BuiltEngine, EngineInputs
from lora_rl_core.errors import EngineUnavailable

__all__ = [
    "ABORT_REASONS",
    "PAUSE_MODES",
    "BuiltEngine",
    "Completion",
    "EmbeddedEngine",
    "EngineInputs",
    "EngineUnavailable",
    "FinishReason",
    "GenerationRequest",
    "RolloutEngine",
    "ServingEngine",
    "MultiEngine",
    "SamplingParams",
    "aborted_completion",
    "unknown_adapter_message",
]
