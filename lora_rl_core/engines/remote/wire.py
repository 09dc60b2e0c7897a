"""The SGLang wire format as the HTTP clients (`lora_rl_core.engines.remote.client`) write and read it.

Requests: `sampling_params` (`sglang/srt/sampling/sampling_params.py`; top_k -1 = off; stop strings and stop
token ids with `no_stop_trim`) and the grouping of requests into `/generate` batches of equal sampling params.
Answers: one `/generate` output into a `Completion` (token ids and logprobs from `output_token_logprobs`, the
finish reason from `meta_info.finish_reason`: `eos` told apart from `stop` by what it `matched`, docs/SGLANG.md,
"Stop sequences"), `/v1/models` cards into adapter infos,
error bodies into a message, and our server's Prometheus `/metrics` text back into `engine.metrics()`'s
shape (names from `serve.metrics`). Pure functions: no HTTP calls here.
"""

from __future__ import annotations

import json
from collections import defaultdict
from typing import Any

import httpx

from lora_rl_core.adapters import adapter_version, check_adapter_name, peft_folder
from lora_rl_core.engines.base import ABORT_REASONS, Completion, FinishReason, GenerationRequest, SamplingParams
from lora_rl_core.errors import EngineError, StoreError

_ADAPTER_SAMPLES = {  # `lora_rl_adapter_<sample>` of our server's /metrics -> engine.metrics() field
    "requests_total": "requests",
    "tokens_total": "tokens",
    "loads_total": "loads",
    "evictions_total": "evictions",
    "load_seconds_total": "load_seconds_total",
    "in_flight": "in_flight",
    "resident": "resident",
    "pinned": "pinned",
    "version": "version",
}
_CARD_EXTRAS = ("sha256", "in_flight", "pinned", "resident")  # our server's additions to SGLang's cards


def check_name(name: str) -> None:
    """Refuse an unsafe adapter name before any call.

    Raises:
        EngineError: the name has `/`, `..`, spaces or other characters outside `[A-Za-z0-9._-]`.
    """
    try:
        check_adapter_name(name)
    except ValueError as exc:
        raise EngineError(str(exc)) from None


def sampling_body(p: SamplingParams) -> dict[str, Any]:
    """SGLang `sampling_params` for `p`, one sample per prompt (`n: 1`); top_k 0 (off) becomes SGLang's -1.
    `stop` and `stop_token_ids` where set, then with `no_stop_trim: true` (SGLang keeps a stop's tokens and
    logprobs in `output_token_logprobs` either way; this keeps the stop string in `text` too). No seed: the
    clients add `sampling_seed` as their server wants it."""
    top_k = p.top_k if p.top_k > 0 else -1
    body: dict[str, Any] = {
        "max_new_tokens": p.max_new_tokens,
        "temperature": p.temperature,
        "top_p": p.top_p,
        "top_k": top_k,
        "n": 1,
    }
    if p.stop:
        body["stop"] = list(p.stop)
    if p.stop_token_ids:
        body["stop_token_ids"] = list(p.stop_token_ids)
    if p.stop or p.stop_token_ids:
        body["no_stop_trim"] = True
    return body


def chunks(requests: list[GenerationRequest], size: int) -> list[tuple[list[int], list[GenerationRequest]]]:
    """`/generate` batches: (indices into `requests`, those requests), equal sampling params within a batch,
    at most `size` requests each, in first-seen order."""
    groups: dict[SamplingParams, list[int]] = {}
    for i, r in enumerate(requests):
        groups.setdefault(r.sampling, []).append(i)
    out = []
    for indices in groups.values():
        for start in range(0, len(indices), size):
            part = indices[start : start + size]
            out.append((part, [requests[i] for i in part]))
    return out


def to_completion(
    request: GenerationRequest,
    out: dict[str, Any],
    url: str,
    *,
    check_version: bool = False,
    reason: str | None = None,
) -> Completion:
    """One `/generate` output -> Completion; token ids and logprobs from `output_token_logprobs`
    (`[logprob, token_id, text]` triples, a stop's tokens included), finish reason from `meta_info.finish_reason`
    (`finish_reason`: SGLang's `stop` is ours `stop` or `eos` by what it matched).

    An aborted completion's `abort_reason` is the server's `finish_reason.message` when it is one of
    `ABORT_REASONS` (our server's: it knows why it ended the request, e.g. `paused` when a pause came before
    this client's abort), else `reason` (what this client's `abort` was given; SGLang's messages are prose),
    else `aborted`.

    Raises:
        EngineError: no `output_token_logprobs`, an unknown finish reason, or, with `check_version` (our
            server), a `meta_info.weight_version` other than the version the request named (so a wrong
            version never reaches training). `url` names the server in the message.
    """
    meta = out.get("meta_info") or {}
    expected = adapter_version(request.adapter)
    reported = meta.get("weight_version")
    if check_version and reported is not None and str(reported) != str(expected):
        raise EngineError(
            f"{url}/generate served request {request.request_id} with version {reported}, "
            f"but it named {request.adapter!r} (version {expected})"
        )
    triples = meta.get("output_token_logprobs")
    if triples is None:
        raise EngineError(f"{url}/generate returned no output_token_logprobs (return_logprob was set)")
    finish = meta.get("finish_reason") or {}
    kind = finish.get("type") if isinstance(finish, dict) else finish
    if kind not in ("stop", "length", "abort"):
        raise EngineError(f"{url}/generate returned finish_reason {finish!r}; expected stop, length or abort")
    return Completion(
        request_id=request.request_id,
        prompt_ids=list(request.prompt_ids),
        completion_ids=[int(t[1]) for t in triples],
        logprobs=[float(t[0]) for t in triples],
        finish_reason=finish_reason(finish, kind, request.sampling),
        adapter=request.adapter,
        adapter_version=adapter_version(request.adapter),
        abort_reason=_abort_reason(finish, reason) if kind == "abort" else None,
    )


def finish_reason(finish: Any, kind: str, params: SamplingParams) -> FinishReason:
    """Our finish reason of SGLang's `meta_info.finish_reason` of type `kind` (`stop`, `length` or `abort`) for a
    request sampled with `params`. SGLang's `stop` covers every end but the limit and aborts, `{"type": "stop",
    "matched": M}`: `M` is the stop string for a stop string (`FINISH_MATCHED_STR`), the token id for an EOS id
    or a stop token id alike (`FINISH_MATCHED_TOKEN`; sglang/srt/managers/schedule_batch.py,
    `Req._check_str_based_finish`, `_check_token_based_finish`). So: a string, or an id listed in
    `params.stop_token_ids`, is `stop`; any other `stop` is `eos`."""
    if kind == "length":
        return "length"
    if kind == "abort":
        return "abort"
    matched = finish.get("matched") if isinstance(finish, dict) else None
    ids = matched if isinstance(matched, list) else [matched]
    if isinstance(matched, str) or any(isinstance(i, int) and i in params.stop_token_ids for i in ids):
        return "stop"
    return "eos"


def _abort_reason(finish: Any, reason: str | None) -> str:
    message = finish.get("message") if isinstance(finish, dict) else None
    if message in ABORT_REASONS:
        return str(message)
    return reason or "aborted"


def adapters_from_models(answer: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """`/v1/models` -> adapters: cards with a `parent`, name -> {path (the card's `root`), version, and any
    of sha256, in_flight, pinned, resident the server reports}. Our server's alias cards (`RUN@latest`, with
    `alias_of`) name no adapter of their own and are left out."""
    out = {}
    for card in answer.get("data") or []:
        if card.get("parent") is None or card.get("alias_of") is not None:
            continue
        extra = {k: card[k] for k in _CARD_EXTRAS if card.get(k) is not None}
        out[card["id"]] = {"path": card.get("root"), "version": adapter_version(card["id"]), **extra}
    return out


def parse_metrics(text: str) -> dict[str, Any]:
    """Our server's Prometheus `/metrics` text -> `{"adapters": {name: {field: value}}, <engine gauge or
    counter>: value, ...}`: `lora_rl_adapter_*` samples per adapter, unlabelled `lora_rl_engine_*` samples
    by name (without `_total`)."""
    from prometheus_client.parser import text_string_to_metric_families

    adapters: defaultdict[str, dict[str, float]] = defaultdict(dict)
    out: dict[str, Any] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            field = _ADAPTER_SAMPLES.get(sample.name.removeprefix("lora_rl_adapter_"))
            if field is not None and "adapter" in sample.labels:
                adapters[sample.labels["adapter"]][field] = sample.value
            elif sample.name.startswith("lora_rl_engine_") and not sample.labels:
                out[sample.name.removeprefix("lora_rl_engine_").removesuffix("_total")] = sample.value
    return {**out, "adapters": dict(adapters)}


def error_message(response: httpx.Response) -> str:
    """The message of an SGLang error answer: `{"error": {"message"}}`, `error_message`, `message`, or text."""
    body = json_or_empty(response)
    error = body.get("error")
    if isinstance(error, dict) and error.get("message"):
        return str(error["message"])
    for key in ("error_message", "message", "detail", "error"):
        if body.get(key):
            return str(body[key])
    return response.text.strip()[:500] or response.reason_phrase


def json_or_empty(response: httpx.Response) -> dict[str, Any]:
    """The answer's JSON object; `{}` for an empty body, non-JSON or a JSON value that is not an object."""
    try:
        body = response.json()
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}


def json_safe(config: dict[str, Any]) -> dict[str, Any]:
    """A PEFT config as plain JSON (sets become sorted lists, other non-JSON values strings)."""
    return json.loads(json.dumps(config, default=lambda o: sorted(o) if isinstance(o, set | frozenset) else str(o)))


def local_peft_folder(path: str, url: str) -> str:
    """A PEFT folder an SGLang server on this machine can read: `file://` URIs become local paths, a store
    version folder becomes the folder of its files (`peft_folder`).

    Raises:
        EngineError: another URI scheme (SGLang reads local folders only), or a store folder that is not a
            complete version; the message says how to get a local copy.
    """
    scheme, sep, rest = path.partition("://")
    if not sep or scheme == "file":
        try:
            return peft_folder(rest if sep else path)
        except StoreError as exc:
            raise EngineError(str(exc)) from None
    raise EngineError(
        f"{url}: SGLang reads adapters from a local folder, not {path!r}: pull the version to a folder "
        "the server can read (`lora-rl adapters pull`) or use a shared filesystem"
    )
