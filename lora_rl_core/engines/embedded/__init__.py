"""The embedded engine: transformers + PEFT in this process, with SGLang's LoRA semantics (`EmbeddedEngine`).

`engine`: lifecycle, deadlines and the worker thread; `requests`: queue, admission and abort; `peft_model`: the
model and adapter injection; `generation`: batched generation; `pool`: the adapter registry and resident pool;
`scheduler`: batch formation; `build`: the engine from settings (`build_embedded_engine`, `embedded_engine`).
"""
