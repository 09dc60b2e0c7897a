"""OpenAI-compatible `POST /v1/completions` and `POST /v1/chat/completions`, so that an OpenAI client or an
evaluation harness can point at `lora-rl serve` with `model` naming what serves the request.

`model` is the base model (the server's `--served-model-name`, or the model path) or an adapter: a loaded
name (`RUN-v000007`), `RUN@latest`, `RUN@N` or `RUN@TAG`, resolved at admission as `/generate`'s `lora_path`
is (`serve.names`). Bodies follow OpenAI's API reference (the `CreateCompletionRequest` and
`CreateChatCompletionRequest` schemas); answers carry OpenAI's fields (`id`, `object`, `created`, `model`
as requested, `choices`, `usage`, `system_fingerprint`) and two of ours: `adapter` and `adapter_version`,
the concrete version that served every choice (null for the base model).

Choices made here:

* The request bodies are strict: a field this server does not know is a 400 naming it, and a known one it
  cannot honour (`stream`, penalties, `logit_bias`, `echo`, `suffix`, `best_of > 1`, top logprobs, tools)
  is refused unless it has its neutral value. Errors are OpenAI's `{"error": {"message", "type", "param",
  "code"}}`; an unknown `model` is 404 `model_not_found`.
* `stop` strings go to the engine (`SamplingParams.stop`), which halts at the token that completes the first
  one: the text ends before the stop string (OpenAI's), `finish_reason` is `stop` (as for the end-of-sequence
  token; `length` at `max_tokens`), and `usage.completion_tokens` counts the tokens up to the one that
  completed it.
* `max_tokens` defaults to 16 on `/v1/completions` (OpenAI's) and to 128 on chat (SGLang's
  `max_new_tokens`; OpenAI's "the rest of the context" is not known here); `max_completion_tokens` wins.
* `logprobs` are the engine's (`inference_logprobs`: under the sampling temperature) of the sampled tokens
  only: `/v1/completions` takes `logprobs: 0` (`tokens`, `token_logprobs`, `text_offset` within the
  completion, `top_logprobs` null), chat takes `logprobs: true` with `top_logprobs` 0 or unset.
* `top_k` (-1 = off) is accepted as vLLM and SGLang do. `seed` seeds the call's batch.
* Chat messages are rendered with the tokenizer's chat template (`add_generation_prompt=True`); a text part
  list is joined into one string. The assistant's answer is the decoded completion.
* A completion that ends aborted (timeout, pause, closed engine) fails the call: HTTP 504 for a timeout,
  503 otherwise, `code` the abort reason.

Left out: streaming (`stream: true` is a 400), `echo`, top logprobs, tool calls, penalties, `/v1/embeddings`.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from lora_rl_core.engines.base import Completion
from lora_rl_core.engines.serve.api import HTTPError, SamplingIn
from lora_rl_core.engines.serve.names import BAD_NAME, NOT_FOUND

COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
CHAT_MAX_TOKENS = 128  # SGLang's max_new_tokens default
MAX_STOPS = 4  # OpenAI's limit

Complete = Callable[[list[list[int]], list[SamplingIn], list[str | None], list[str]], Awaitable[list[Completion]]]
"""`EngineServer.complete_named`: prompts, sampling per prompt, adapter per prompt, request ids -> completions."""


class OpenAIBody(BaseModel):
    """The fields both endpoints share. Unknown fields are a 400 naming them."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1)
    """The base model or an adapter: `RUN-v000007`, `RUN@latest`, `RUN@N`, `RUN@TAG`."""
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, ge=-1)
    """vLLM's and SGLang's extension; -1 or 0 = off."""
    n: int = Field(1, ge=1, le=128)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    user: str | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None

    @field_validator("stream", "stream_options", "presence_penalty", "frequency_penalty", "logit_bias")
    @classmethod
    def _unserved(cls, value: Any, info: ValidationInfo) -> Any:
        if value:
            raise ValueError(f"{info.field_name}={value!r} is not supported by this server: leave it out")
        return value

    @field_validator("stop")
    @classmethod
    def _stops(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else list(value or [])
        if len(stops) > MAX_STOPS or any(not s for s in stops):
            raise ValueError(f"give at most {MAX_STOPS} non-empty stop strings")
        return value

    def sampling(self, max_tokens: int) -> SamplingIn:
        """The engine's sampling params for this body."""
        return SamplingIn(
            max_new_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            n=self.n,
            seed=self.seed,
            stop=self.stop_strings() or None,
        )

    def stop_strings(self) -> list[str]:
        """`stop` as a list (none: [])."""
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class CompletionIn(OpenAIBody):
    """`CreateCompletionRequest`: one prompt or a batch, as text or token ids."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(None, ge=1)
    logprobs: int | None = Field(None, ge=0, le=5)
    """0: the sampled tokens' logprobs; top logprobs (> 0) are not served."""
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1)

    @field_validator("echo", "suffix")
    @classmethod
    def _unserved_completion(cls, value: Any, info: ValidationInfo) -> Any:
        if value:
            raise ValueError(f"{info.field_name}={value!r} is not supported by this server: leave it out")
        return value

    @field_validator("logprobs")
    @classmethod
    def _sampled_only(cls, value: int | None) -> int | None:
        if value:
            raise ValueError("top logprobs are not served: send logprobs=0 for the sampled tokens' logprobs")
        return value

    @field_validator("best_of")
    @classmethod
    def _one_best(cls, value: int | None) -> int | None:
        if value is not None and value > 1:
            raise ValueError("best_of > 1 is not supported by this server: use n")
        return value


class TextPart(BaseModel):
    """A text part of a message's content."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One chat message; content is a string or a list of text parts."""

    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def as_template_input(self) -> dict[str, Any]:
        """The message as a chat template reads it: `{"role", "content"}` (text parts joined)."""
        content = self.content
        text = "".join(p.text for p in content) if isinstance(content, list) else content or ""
        return {"role": self.role, "content": text, **({"name": self.name} if self.name else {})}


class ChatIn(OpenAIBody):
    """`CreateChatCompletionRequest`."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None

    @field_validator("top_logprobs")
    @classmethod
    def _sampled_only(cls, value: int | None) -> int | None:
        if value:
            raise ValueError("top logprobs are not served: leave top_logprobs out (or 0) with logprobs=true")
        return value

    @field_validator("tools")
    @classmethod
    def _no_tools(cls, value: list | None) -> list | None:
        if value:
            raise ValueError("tool calls are not supported by this server: leave tools out")
        return value

    @field_validator("tool_choice")
    @classmethod
    def _no_tool_choice(cls, value: Any) -> Any:
        if value not in (None, "none"):
            raise ValueError("tool calls are not supported by this server: leave tool_choice out")
        return value

    @field_validator("response_format")
    @classmethod
    def _text_only(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None and value.get("type") != "text":
            raise ValueError('only response_format {"type": "text"} is served')
        return value


class OpenAIRoutes:
    """The route handlers of `/v1/completions` and `/v1/chat/completions`.

    Args:
        complete: resolves each prompt's adapter and completes it (`EngineServer.complete_named`).
        tokenizer: encodes text prompts, renders chat messages, decodes completions; None serves token-id
            prompts to `/v1/completions` only (texts are then empty).
        base_names: the names `model` may give for the base model.
    """

    def __init__(self, complete: Complete, *, tokenizer: Any, base_names: Sequence[str]) -> None:
        self.complete = complete
        self.tokenizer = tokenizer
        self.base_names = tuple(base_names)

    async def completions(self, body: CompletionIn) -> JSONResponse:
        """`POST /v1/completions`."""
        prompts = completion_prompts(body.prompt, self.tokenizer)
        completions = await self._run(body, prompts, body.max_tokens or COMPLETION_MAX_TOKENS)
        stops = body.stop_strings()
        choices = []
        for index, c in enumerate(completions):
            text, kept, finish = apply_stops(c, self.tokenizer, stops)
            choice = {"index": index, "text": text, "logprobs": None, "finish_reason": finish}
            if body.logprobs is not None:
                choice["logprobs"] = completion_logprobs(c, kept, self.tokenizer)
            choices.append((choice, kept))
        return JSONResponse(answer("text_completion", "cmpl", body.model, prompts, completions, choices))

    async def chat_completions(self, body: ChatIn) -> JSONResponse:
        """`POST /v1/chat/completions`."""
        prompt = chat_prompt(self.tokenizer, body.messages)
        max_tokens = body.max_completion_tokens or body.max_tokens or CHAT_MAX_TOKENS
        completions = await self._run(body, [prompt], max_tokens)
        stops = body.stop_strings()
        choices = []
        for index, c in enumerate(completions):
            text, kept, finish = apply_stops(c, self.tokenizer, stops)
            message = {"role": "assistant", "content": text, "refusal": None}
            choice = {"index": index, "message": message, "logprobs": None, "finish_reason": finish}
            if body.logprobs:
                choice["logprobs"] = chat_logprobs(c, kept, self.tokenizer)
            choices.append((choice, kept))
        return JSONResponse(answer("chat.completion", "chatcmpl", body.model, [prompt], completions, choices))

    async def _run(self, body: OpenAIBody, prompts: list[list[int]], max_tokens: int) -> list[Completion]:
        """Complete every prompt `n` times with the adapter `body.model` names; aborted ones fail the call."""
        adapter = None if body.model in self.base_names else body.model
        sampling = body.sampling(max_tokens)
        rids = [os.urandom(8).hex() for _ in prompts]
        try:
            completions = await self.complete(prompts, [sampling] * len(prompts), [adapter] * len(prompts), rids)
        except HTTPError as exc:
            if exc.code == BAD_NAME:
                raise HTTPError(400, exc.message, param="model", code=BAD_NAME) from None
            if exc.code != NOT_FOUND:
                raise
            message = f"{exc.message}\nThe models served: GET /v1/models (the base model is {self.base_names[0]!r})"
            raise HTTPError(404, message, param="model", code=NOT_FOUND) from None
        aborted = next((c for c in completions if c.finish_reason == "abort"), None)
        if aborted is not None:
            reason = aborted.abort_reason or "aborted"
            status = 504 if reason == "timeout" else 503
            raise HTTPError(status, f"generation ended early ({reason}): nothing was returned", code=reason)
        return completions


# ----------------------------------------------------------------- prompts


def completion_prompts(prompt: str | list[str] | list[int] | list[list[int]], tokenizer: Any) -> list[list[int]]:
    """The token ids of each prompt of `/v1/completions` (text is encoded with `tokenizer`).

    Raises:
        HTTPError: 400 (`param` prompt) for no prompt, an empty one, or text without a tokenizer.
    """
    items: list[Any] = [prompt] if isinstance(prompt, str) else list(prompt)
    if items and isinstance(items[0], int):
        items = [items]
    if not items or any(not p for p in items):
        raise HTTPError(400, "every prompt needs at least one token", param="prompt")
    if any(isinstance(p, str) for p in items):
        if tokenizer is None:
            raise HTTPError(400, "this server has no tokenizer: send prompts as token ids", param="prompt")
        return [tokenizer(p)["input_ids"] if isinstance(p, str) else list(p) for p in items]
    return [list(p) for p in items]


def chat_prompt(tokenizer: Any, messages: list[ChatMessage]) -> list[int]:
    """The messages rendered by the tokenizer's chat template, ending where the assistant's answer starts.

    Raises:
        HTTPError: 400 (`param` messages) without a chat template, or when the template refuses them.
    """
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise HTTPError(400, "this server's tokenizer has no chat template: use /v1/completions", param="messages")
    turns = [m.as_template_input() for m in messages]
    try:
        encoded = tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=True, return_dict=True)
    except Exception as exc:  # jinja2's TemplateError and whatever a template raises (raise_exception)
        raise HTTPError(400, f"the chat template refused the messages: {exc}", param="messages") from None
    ids = encoded["input_ids"]
    return [int(i) for i in (ids.tolist() if hasattr(ids, "tolist") else ids)]


# ----------------------------------------------------------------- answers


def apply_stops(c: Completion, tokenizer: Any, stops: list[str]) -> tuple[str, int, str]:
    """The completion's text cut before the first of `stops` (the engine halted at the token that completed it),
    the tokens kept (up to that token), and OpenAI's `finish_reason`: `stop` for a stop string and the
    end-of-sequence token alike (our `stop` and `eos`), else `length`."""
    ids = c.completion_ids
    text = _decode(tokenizer, ids)
    finish = "stop" if c.finish_reason in ("stop", "eos") else "length"
    cuts = [i for i in (text.find(s) for s in stops) if i >= 0]
    if not cuts:
        return text, len(ids), finish
    lo, hi = 1, len(ids)  # the fewest tokens whose text holds a stop string (prefix texts only grow)
    while lo < hi:
        mid = (lo + hi) // 2
        if any(s in _decode(tokenizer, ids[:mid]) for s in stops):
            hi = mid
        else:
            lo = mid + 1
    return text[: min(cuts)], lo, "stop"


def completion_logprobs(c: Completion, kept: int, tokenizer: Any) -> dict[str, Any]:
    """`/v1/completions` `logprobs` of the kept sampled tokens (offsets within the completion's text)."""
    tokens = [_decode(tokenizer, [t]) for t in c.completion_ids[:kept]]
    offsets = [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
    return {"tokens": tokens, "token_logprobs": c.logprobs[:kept], "top_logprobs": None, "text_offset": offsets}


def chat_logprobs(c: Completion, kept: int, tokenizer: Any) -> dict[str, Any]:
    """Chat `logprobs` of the kept sampled tokens (no alternatives)."""
    content = []
    for token_id, logprob in zip(c.completion_ids[:kept], c.logprobs[:kept], strict=True):
        token = _decode(tokenizer, [token_id])
        content.append({"token": token, "logprob": logprob, "bytes": list(token.encode()), "top_logprobs": []})
    return {"content": content, "refusal": None}


def answer(
    kind: str, prefix: str, model: str, prompts: list[list[int]], completions: list[Completion], choices: list
) -> dict[str, Any]:
    """OpenAI's answer body with `choices` (each with its kept token count), `usage` (the prompt tokens once
    per prompt, the kept completion tokens of every choice) and the adapter and version that served them."""
    prompt_tokens = sum(len(p) for p in prompts)
    completion_tokens = sum(kept for _, kept in choices)
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens}
    served = completions[0]
    return {
        "id": f"{prefix}-{uuid.uuid4().hex}",
        "object": kind,
        "created": int(time.time()),
        "model": model,
        "choices": [choice for choice, _ in choices],
        "usage": {**usage, "total_tokens": prompt_tokens + completion_tokens},
        "system_fingerprint": None,
        "adapter": served.adapter,
        "adapter_version": served.adapter_version,
    }


def _decode(tokenizer: Any, ids: list[int]) -> str:
    return "" if tokenizer is None else tokenizer.decode(ids, skip_special_tokens=True)
