"""The engine server's wire format: SGLang's request bodies, error answers and `/generate` output shape.

Request bodies mirror the structs of sglang 0.5.23 `sglang/srt/managers/io_struct.py` (`GenerateReqInput`,
`LoadLoRAAdapterReqInput`, `LoadLoRAAdapterFromTensorsReqInput`, `UnloadLoRAAdapterReqInput`,
`PauseGenerationReqInput`, `AbortReq`) as pydantic models; only the sampling params are strict (an unknown
field is a 400). Errors are answered as SGLang does, `{"error": {"message": ...}}` with HTTP 400 for a
refused request, and on `/v1/` routes as OpenAI does, `{"error": {"message", "type", "param", "code"}}`
(`install_error_handlers`). `generate_output` shapes one completion as an element of
SGLang's `/generate` answer. `EngineServer` (`lora_rl_core.engines.serve.app`) and its adapter routes
(`serve.adapters`) use these; docs/SGLANG.md is the contract.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any, cast

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator
from starlette.exceptions import HTTPException as StarletteHTTPException

from lora_rl_core.engines.base import Completion, SamplingParams
from lora_rl_core.errors import LoraRLError

TOP_K_ALL = 1 << 30  # SGLang's "whole vocabulary" top_k
OPENAI_PREFIX = "/v1/"  # routes whose errors take OpenAI's shape


class SamplingIn(BaseModel):
    """The `sampling_params` subset served (sglang/srt/sampling/sampling_params.py); unknown fields are a 400."""

    model_config = ConfigDict(extra="forbid")

    max_new_tokens: int = Field(128, ge=1)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, ge=-1)
    """-1 (or 0, or >= 2**30) disables top-k."""
    n: int = Field(1, ge=1, le=1024)
    sampling_seed: int | None = None
    seed: int | None = None
    """Alias of sampling_seed."""
    skip_special_tokens: bool = True
    stop: str | list[str] | None = None
    """Stop strings: generation halts at the token that completes one (kept in `output_ids` and the logprobs)."""
    stop_token_ids: list[int] | None = None
    """Token ids that end a completion as a stop string does (the EOS ids always end one)."""
    no_stop_trim: bool = False
    """Keep the matched stop string (or stop token) in `text`; SGLang's default cuts it off."""

    @field_validator("stop")
    @classmethod
    def _stops(cls, value: str | list[str] | None) -> str | list[str] | None:
        if any(not s for s in ([value] if isinstance(value, str) else value or [])):
            raise ValueError("a stop string must not be empty")
        return value

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_ids(cls, value: list[int] | None) -> list[int] | None:
        if any(i < 0 for i in value or []):
            raise ValueError("stop token ids are token ids, >= 0")
        return value

    def stops(self) -> tuple[str, ...]:
        """`stop` as a tuple (none: ())."""
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    def to_params(self) -> SamplingParams:
        """Our `SamplingParams` (top_k 0 = off)."""
        top_k = 0 if self.top_k <= 0 or self.top_k >= TOP_K_ALL else self.top_k
        seed = self.sampling_seed if self.sampling_seed is not None else self.seed
        return SamplingParams(
            max_new_tokens=self.max_new_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=top_k,
            seed=seed,
            stop=self.stops(),
            stop_token_ids=tuple(self.stop_token_ids or ()),
        )


class GenerateIn(BaseModel):
    """`GenerateReqInput` subset: one prompt or a batch, as text or token ids; other fields are ignored."""

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: SamplingIn | list[SamplingIn] | None = None
    lora_path: str | list[str | None] | None = None
    """Adapter name per prompt (a list) or for all; null = base model."""
    return_logprob: bool = False
    return_text_in_logprobs: bool = False
    stream: bool = False
    rid: str | list[str] | None = None


class LoadIn(BaseModel):
    """`LoadLoRAAdapterReqInput`. Without `lora_path`, a server with a store resolves `lora_name` there."""

    lora_name: str
    lora_path: str | None = None
    pinned: bool = False


class LoadTensorsIn(BaseModel):
    """`LoadLoRAAdapterFromTensorsReqInput`; only `load_format: "safetensors"` is accepted here."""

    lora_name: str
    config_dict: dict[str, Any]
    serialized_named_tensors: list[str] | None = None
    load_format: str | None = None
    pinned: bool = False


class UnloadIn(BaseModel):
    """`UnloadLoRAAdapterReqInput`."""

    lora_name: str


class PauseIn(BaseModel):
    """`PauseGenerationReqInput`: `abort` (SGLang's default), `retract` or `in_place`."""

    mode: str = "abort"


class AbortIn(BaseModel):
    """`AbortReq`: one request id, or every request; `abort_message` is the reason (one of `ABORT_REASONS`)."""

    rid: str = ""
    abort_all: bool = False
    abort_message: str | None = None


class HTTPError(Exception):
    """An error answered as `{"error": {"message": ...}}` with `status` (on `/v1/` routes in OpenAI's shape,
    with `param`, the request field at fault, and `code`)."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code


def error_response(status: int, message: str, **extra: Any) -> JSONResponse:
    """SGLang's error answer: `{"error": {"message": message}, **extra}` with HTTP `status`."""
    return JSONResponse({"error": {"message": message}, **extra}, status_code=status)


def openai_error_response(
    status: int, message: str, *, param: str | None = None, code: str | None = None
) -> JSONResponse:
    """OpenAI's error answer: `{"error": {"message", "type", "param", "code"}}` with HTTP `status`."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    body = {"message": message, "type": kind, "param": param, "code": code}
    return JSONResponse({"error": body}, status_code=status)


def _answer(
    request: Request, status: int, message: str, param: str | None = None, code: str | None = None
) -> JSONResponse:
    """The error in the shape of the route asked: OpenAI's under `/v1/`, else SGLang's."""
    if request.url.path.startswith(OPENAI_PREFIX):
        return openai_error_response(status, message, param=param, code=code)
    return error_response(status, message)


def install_error_handlers(app: FastAPI) -> None:
    """Answer every error in SGLang's shape (OpenAI's on `/v1/` routes): `HTTPError` with its status,
    `LoraRLError` (an engine refusal) and request validation errors with 400, Starlette's own (404, 405)
    with theirs."""
    handlers: dict[type[Exception], Callable[[Request, Any], Awaitable[JSONResponse]]] = {
        HTTPError: _on_http_error,
        LoraRLError: _on_engine_error,
        RequestValidationError: _on_validation_error,
        StarletteHTTPException: _on_starlette_error,
    }
    for error, handler in handlers.items():
        app.add_exception_handler(error, handler)


async def run_blocking(timeout_s: float, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
    """Run a blocking engine call in a worker thread and return its result.

    Raises:
        HTTPError: 504 when it did not finish within `timeout_s` seconds (the call is abandoned, not
            killed: a torch call in a thread cannot be interrupted).
    """
    try:
        with anyio.fail_after(timeout_s):
            return await anyio.to_thread.run_sync(partial(fn, *args, **kwargs), abandon_on_cancel=True)
    except TimeoutError:
        name = getattr(fn, "__name__", "engine call")
        raise HTTPError(504, f"{name} did not finish within {timeout_s:g} s") from None


# ----------------------------------------------------------------- /generate


def prompt_ids(body: GenerateIn, tokenizer: Any) -> tuple[list[list[int]], bool]:
    """The token ids of each prompt of `body` (`text` is encoded with `tokenizer`), and whether the body
    was a batch (lists) rather than one prompt.

    Raises:
        HTTPError: 400 for both or neither of `text` and `input_ids`, `text` without a tokenizer, or an
            empty prompt.
    """
    if (body.text is None) == (body.input_ids is None):
        raise HTTPError(400, "give exactly one of `text` or `input_ids`")
    if body.input_ids is not None:
        batch = bool(body.input_ids) and isinstance(body.input_ids[0], list)
        prompts = cast(list[list[int]], body.input_ids if batch else [body.input_ids])
    else:
        if tokenizer is None:
            raise HTTPError(400, "this server has no tokenizer: send `input_ids` instead of `text`")
        batch = isinstance(body.text, list)
        texts = cast(list[str], body.text if batch else [body.text])
        prompts = [tokenizer(t)["input_ids"] for t in texts]
    if not prompts or any(not p for p in prompts):
        raise HTTPError(400, "every prompt needs at least one token")
    return prompts, batch


def per_prompt(value: Any, n: int, field: str) -> list[Any]:
    """One value per prompt: a scalar is repeated `n` times; a list must have `n` values.

    Raises:
        HTTPError: 400 when the list `field` has another length.
    """
    if not isinstance(value, list):
        return [value] * n
    if len(value) != n:
        raise HTTPError(400, f"`{field}` lists {len(value)} values for {n} prompts")
    return value


def expand_samples(sampling: list[SamplingIn]) -> list[SamplingIn]:
    """Each prompt's sampling params repeated `n` times: one per completion, in SGLang's prompt-major order."""
    return [s for s in sampling for _ in range(s.n)]


def generate_output(c: Completion, sampling: SamplingIn, body: GenerateIn, tokenizer: Any) -> dict[str, Any]:
    """One element of SGLang's `/generate` answer: `text` (decoded with `tokenizer`; "" without one; the matched
    stop cut off unless `no_stop_trim`), `output_ids` (a stop's tokens included) and `meta_info` (`id`,
    `finish_reason`, token counts, `weight_version` = the adapter version that produced it, `lora_path`, and
    `output_token_logprobs` triples `[logprob, token_id, text]` when `body.return_logprob`)."""
    finish = finish_reason(c, sampling, tokenizer)
    meta: dict[str, Any] = {
        "id": c.request_id,
        "finish_reason": finish,
        "prompt_tokens": len(c.prompt_ids),
        "completion_tokens": len(c.completion_ids),
        "cached_tokens": 0,
        "weight_version": c.adapter_version,
        "lora_path": c.adapter,
    }
    if body.return_logprob:
        with_text = body.return_text_in_logprobs
        texts = [_decode(tokenizer, [t], True) if with_text else None for t in c.completion_ids]
        meta["output_token_logprobs"] = [
            [lp, tid, txt] for lp, tid, txt in zip(c.logprobs, c.completion_ids, texts, strict=True)
        ]
    text = output_text(c.completion_ids, finish.get("matched"), sampling, tokenizer)
    return {"text": text, "output_ids": c.completion_ids, "meta_info": meta}


def finish_reason(c: Completion, sampling: SamplingIn, tokenizer: Any) -> dict[str, Any]:
    """SGLang's `meta_info.finish_reason`: `{"type": "stop", "matched": M}` for an EOS (`M` its token id), a stop
    token id (the id) and a stop string (the string: the first of `sampling.stop` in the completion's text, the
    first of them without a tokenizer), so that a client tells `stop` from `eos` as with SGLang
    (`remote.wire.finish_reason`); `length`; or `abort` whose `message` is the completion's `abort_reason`
    (one of `ABORT_REASONS`)."""
    if c.finish_reason in ("stop", "eos"):
        last = c.completion_ids[-1] if c.completion_ids else None
        stops = sampling.stops()
        if c.finish_reason == "eos" or not stops or last in (sampling.stop_token_ids or ()):
            return {"type": "stop", "matched": last}
        text = _decode(tokenizer, c.completion_ids, False)
        return {"type": "stop", "matched": next((s for s in stops if s in text), stops[0])}
    if c.finish_reason == "length":
        return {"type": "length", "length": len(c.completion_ids)}
    return {"type": "abort", "message": c.abort_reason or "aborted"}


def output_text(ids: list[int], matched: Any, sampling: SamplingIn, tokenizer: Any) -> str:
    """`text` as SGLang answers it (`DetokenizerManager.trim_matched_stop`): a matched stop string is cut off
    with what follows it (kept, up to its end, with `no_stop_trim`), a matched token (EOS or stop token id) is
    left out of the decoding (kept with `no_stop_trim`)."""
    skip = sampling.skip_special_tokens
    if isinstance(matched, str):
        text = _decode(tokenizer, ids, skip)
        at = text.find(matched)
        return text if at < 0 else text[: at + len(matched)] if sampling.no_stop_trim else text[:at]
    if isinstance(matched, int) and ids and not sampling.no_stop_trim:
        return _decode(tokenizer, ids[:-1], skip)
    return _decode(tokenizer, ids, skip)


def _decode(tokenizer: Any, ids: list[int], skip_special: bool) -> str:
    return "" if tokenizer is None else tokenizer.decode(ids, skip_special_tokens=skip_special)


async def _on_http_error(request: Request, exc: HTTPError) -> JSONResponse:
    return _answer(request, exc.status, exc.message, exc.param, exc.code)


async def _on_engine_error(request: Request, exc: LoraRLError) -> JSONResponse:
    return _answer(request, 400, str(exc))


async def _on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    fields = [".".join(str(p) for p in e["loc"][1:] if p is not None) for e in errors]  # loc[0] is "body"
    parts = [f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in errors]
    return _answer(request, 400, "invalid request: " + "; ".join(parts), next((f for f in fields if f), None))


async def _on_starlette_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    return _answer(request, exc.status_code, str(exc.detail))
