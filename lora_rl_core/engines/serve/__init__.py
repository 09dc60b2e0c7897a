"""Our SGLang-compatible engine server, `lora-rl serve`: the SGLang HTTP API subset over any `ServingEngine`.

`app`: the routes (`EngineServer`, `create_app`, `serve`); `api`: request bodies, error answers and output
shape; `adapters`: the adapter load/unload routes; `names`: adapter references (`RUN@latest`, `RUN@N`,
`RUN@TAG`); `openai_api`: OpenAI-compatible `/v1/completions` and `/v1/chat/completions`; `metrics`: the
Prometheus collector.
"""
