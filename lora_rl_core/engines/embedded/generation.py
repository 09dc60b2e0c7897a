"""One forward batch of generation: HF `generate`'s decode loop with a batch that shrinks, a fast sampler and
shared prefill of repeated prompts.

The embedded engine (`embedded.py`) decides what runs together; this module runs it. Three things beyond a
plain `model.generate` call, all for CPU speed and all exact:

* **A batch that shrinks** (`generate_batch`). The loop is `generate`'s (left-padded prompts, position ids
  `cumsum(mask) - 1`, a `DynamicCache`, raw float32 logits per step), but a row that ended leaves the batch
  at once (`DynamicCache.batch_select_indices`): `generate` computes every row until the longest ends, so a
  rollout of 64 rows where one ran to the token limit decoded all 64 to the limit.

* **Sampling by inverse CDF** (`InverseCdfSampler`). HF's sampler calls `torch.multinomial`, which on a
  CPU draws one exponential variate per vocabulary entry (the exponential-race trick): 64 rows x 49,152
  tokens took 85 ms a step on a 2-core AVX2 EPYC, 17 % of generation time, and a Gumbel-max argmax costs
  the same. Inverse CDF needs one uniform per row: softmax, a float64 cumsum, `searchsorted` (8 ms). The
  processor returns scores whose argmax is the sampled token; temperature, top-k and top-p are HF's own
  warpers, applied first. The token distribution is the same as HF's sampling; the random stream differs,
  so a seed gives other (equally distributed) samples. Every row of the batch draws its uniform at every
  step, ended or not, so a row's samples do not depend on when the others end.
* **Shared prefill** (`shared_prefill`). GRPO samples each prompt `group_size` times (SGLang's `n`);
  rows with the same prompt and adapter have the same KV cache. The prompt minus its last token is run
  once per distinct (prompt, adapter), the cache is gathered out to every row, and the decode loop
  continues from it (it runs only the uncached last token). For 8 prompts x 8 samples of 47 tokens on the same CPU,
  prefill took 0.7 s instead of 6.5 s. Position ids follow HF's left-padding rule (`cumsum(mask) - 1`),
  so the cache equals the one `generate` would have built.

Stop sequences (`SamplingParams.stop`, `stop_token_ids`) end a row inside the loop, so no tokens are spent past
them: stop token ids join the EOS ids of the generation config, stop strings are checked each step
(`StopStrings`), matching them as transformers' `StopStringCriteria` does (tensor ops over a table of the
vocabulary's token strings, built once per set of strings: no per-token decoding), over each row's completion
only (HF's own `stop_strings` would also match a string begun in the prompt, e.g. `"\n\n"` after a chat
prompt's last `"\n"`), and records where each row completed one. A tokenizer whose vocabulary that table
cannot be built from (one whose decoding puts spaces between tokens) is matched by decoding each row's last
tokens instead (`DecodedStops`). Finished rows are padded; the engine cuts each row after its end
(`peft_model.finish_points`).

The cache is passed by the name the model's `forward` takes (`cache_kwarg`): `cache` since transformers 5.24,
whose old name `past_key_values` warns a FutureWarning on every call; `past_key_values` before (the GPU
hosts' SGLang pins an older transformers).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, cast

import torch
from peft import PeftModel
from transformers import (
    DynamicCache,
    LogitsProcessor,
    LogitsProcessorList,
    PreTrainedTokenizerBase,
    StopStringCriteria,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from lora_rl_core.engines.base import SamplingParams

BASE_ADAPTER = "__base__"  # PEFT's name for "no adapter" in adapter_names


class InverseCdfSampler(LogitsProcessor):
    """Sample the next token by inverse CDF and return scores whose argmax is that token.

    For greedy `generate` (`do_sample=False`): the returned `[B, V]` scores are 0 at the sampled token and
    -inf elsewhere. Draws from `softmax(warped logits)`, the warpers being HF's temperature, top-k and
    top-p (those that change anything), using torch's global CPU generator (seeded by the caller).

    Args:
        temperature: > 0. top_k: 0 = off. top_p: 1.0 = off.
    """

    def __init__(self, temperature: float, top_k: int = 0, top_p: float = 1.0) -> None:
        if temperature <= 0:
            raise ValueError(f"InverseCdfSampler needs temperature > 0, got {temperature} (use greedy decoding)")
        warpers: list[LogitsProcessor] = []
        if temperature != 1.0:
            warpers.append(TemperatureLogitsWarper(temperature))
        if top_k > 0:
            warpers.append(TopKLogitsWarper(top_k))
        if top_p < 1.0:
            warpers.append(TopPLogitsWarper(top_p))
        self._warpers = LogitsProcessorList(warpers)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        uniforms_B1 = torch.rand(scores.shape[0], 1, dtype=torch.float64, device="cpu")
        return self.with_uniforms(input_ids, scores, uniforms_B1)

    def with_uniforms(
        self, input_ids: torch.LongTensor, scores: torch.FloatTensor, uniforms_B1: torch.Tensor
    ) -> torch.FloatTensor:
        """As a call, with the rows' uniforms given: `[B, 1]` float64 in [0, 1) (any device)."""
        probs_BV = torch.softmax(self._warpers(input_ids, scores).float(), dim=-1)
        # float64 cumsum: over ~50k entries float32 rounding would shift the tail probabilities
        cdf_BV = probs_BV.to(torch.float64).cumsum(dim=-1)
        u_B1 = uniforms_B1.to(cdf_BV.device) * cdf_BV[:, -1:]
        # right=True: the first entry with cdf > u, so a zero-probability token is never chosen
        tokens_B1 = torch.searchsorted(cdf_BV, u_B1, right=True).clamp_(max=cdf_BV.shape[1] - 1)
        out = torch.full_like(scores, float("-inf"))
        return cast(torch.FloatTensor, out.scatter_(1, tokens_B1, 0.0))


def left_pad(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad prompts to `[B, P]` ids and attention mask (long); generation appends on the right."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :] = torch.tensor(r, dtype=torch.long)
        mask[i, width - len(r) :] = 1
    return ids, mask


_CACHE_KWARGS: dict[type, str] = {}
"""`cache_kwarg` by model class, each decided once (on the first generation call), not on every call."""


def cache_kwarg(model: Any) -> str:
    """The keyword by which `model` (a PeftModel's base model for a PeftModel) takes a KV cache in `forward`
    and `generate`: `cache` where its class's `forward` has that parameter (transformers >= 5.24), else
    `past_key_values`. Read from the class once (`_CACHE_KWARGS`): an engine's model does not replace its
    top-level `forward` per instance (Liger's kernels patch the trainer's copy below it)."""
    base = model.get_base_model() if isinstance(model, PeftModel) else model
    cls = type(base)
    if cls not in _CACHE_KWARGS:
        _CACHE_KWARGS[cls] = "cache" if "cache" in inspect.signature(cls.forward).parameters else "past_key_values"
    return _CACHE_KWARGS[cls]


def shared_prefill(
    model: Any, input_ids_BP: torch.Tensor, attention_mask_BP: torch.Tensor, adapters: list[str] | None
) -> DynamicCache | None:
    """KV cache of every row's prompt minus its last token, computed once per distinct (prompt, adapter).

    Args:
        model: the causal LM (a PeftModel when `adapters` is given).
        input_ids_BP / attention_mask_BP: left-padded prompts `[B, P]` (long), on the model's device.
        adapters: per-row PEFT adapter names, or None for a plain model.

    Returns:
        a `DynamicCache` of length `P - 1` for all `B` rows, or None when no two rows share a prompt and
        adapter (or prompts are one token wide): then plain `generate` is as cheap.
    """
    width = input_ids_BP.shape[1]
    if width < 2:
        return None
    keys = [(tuple(row.tolist()), adapters[i] if adapters else None) for i, row in enumerate(input_ids_BP)]
    first: dict[tuple[Any, ...], int] = {}
    for i, key in enumerate(keys):
        first.setdefault(key, i)
    if len(first) == len(keys):
        return None
    unique = list(first.values())
    slot = {key: j for j, key in enumerate(first)}
    ids = input_ids_BP[unique, :-1]
    mask = attention_mask_BP[unique, :-1]
    position_ids = (mask.cumsum(-1) - 1).masked_fill_(mask == 0, 1)  # HF generate's rule for left padding
    cache = DynamicCache()
    kwargs: dict[str, Any] = {"adapter_names": [adapters[i] for i in unique]} if adapters else {}
    kwargs[cache_kwarg(model)] = cache
    model(
        input_ids=ids,
        attention_mask=mask,
        position_ids=position_ids,
        use_cache=True,
        logits_to_keep=1,
        **kwargs,
    )
    cache.batch_select_indices(torch.tensor([slot[k] for k in keys], device=input_ids_BP.device))
    return cache


StopMatch = Callable[[torch.Tensor], torch.Tensor]
"""Which rows of completions `[B, T]` (long) end with a stop string now: `[B]` bool."""


class DecodedStops:
    """A `StopMatch` that decodes each row's last tokens (special tokens kept, as SGLang's check decodes) and looks
    for the strings there: for a tokenizer `StopStringCriteria` cannot read. Costs one decode per row and step.

    Args:
        stops: the stop strings (non-empty). The window is one token more than the longest string has
            characters (a token decodes to at least one character).
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, stops: tuple[str, ...]) -> None:
        self._tokenizer = tokenizer
        self._stops = stops
        self._window = max(len(s) for s in stops) + 1

    def __call__(self, completion_BT: torch.Tensor) -> torch.Tensor:
        tails = self._tokenizer.batch_decode(completion_BT[:, -self._window :].tolist(), skip_special_tokens=False)
        return torch.tensor([any(s in t for s in self._stops) for t in tails], device=completion_BT.device)


def stop_match(tokenizer: PreTrainedTokenizerBase, stops: tuple[str, ...]) -> StopMatch:
    """The `StopMatch` of `stops`: transformers' `StopStringCriteria` (a stop string completed by the last token,
    overhangs included: `["st", "opera"]` ends `stop`), or `DecodedStops` for a tokenizer whose vocabulary it
    cannot clean (it raises building its table). Build it once per set of strings: it reads the vocabulary."""
    try:
        criteria = StopStringCriteria(tokenizer, list(stops))
    except (ValueError, KeyError, IndexError, TypeError):
        return DecodedStops(tokenizer, stops)
    return lambda completion_BT: criteria(cast(torch.LongTensor, completion_BT), None)


class StopStrings:
    """`SamplingParams.stop` over one batch's completions: a row is done at the token that completes a stop
    string within its completion (the prompt never looked at). `first_B` records where: per row of the batch,
    the index in the completion of that token, -1 while none (long, on the completions' device once checked).

    Args:
        match: the strings' matcher (`stop_match`). rows: the batch's rows (`first_B`'s length).
    """

    def __init__(self, match: StopMatch, rows: int) -> None:
        self._match = match
        self.first_B = torch.full((rows,), -1, dtype=torch.long)

    def check(self, completion_bT: torch.Tensor, rows_b: torch.Tensor) -> torch.Tensor:
        """Which of the rows still decoding (`rows_b`: their indices in the batch) end with a stop string now,
        given their completions so far `[b, T]`: `[b]` bool (on the completions' device); a first hit is
        recorded in `first_B` at index `T - 1`."""
        hit_b = self._match(completion_bT).to(torch.bool)
        self.first_B = self.first_B.to(hit_b.device)  # stays there: no copy to the host per step
        rows = rows_b.to(hit_b.device)
        new_b = hit_b & (self.first_B[rows] < 0)
        self.first_B[rows[new_b]] = completion_bT.shape[1] - 1
        return hit_b


@torch.no_grad()
def generate_batch(
    model: Any,
    prompts: list[list[int]],
    adapters: list[str] | None,
    params: SamplingParams,
    *,
    pad_id: int,
    eos_ids: list[int],
    stops: StopStrings | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generate for prompts with equal sampling params: new tokens `[B, T]` (long, CPU) and their logprobs
    `[B, T]` (float32, CPU) under softmax(logits / temperature) of the raw logits (temperature 0, greedy:
    under temperature 1). A row ends at an EOS id or stop token id of `params`, or a stop string of `stops`;
    it keeps the token that ended it and is padded with `pad_id` after it (logprob 0 there). `T` is the step
    at which the last row ended, or `params.max_new_tokens`. Each step's logprobs are taken from its logits
    at once, so no `[B, V]` logits outlive their step (64 rows x 1,024 steps of a 152k vocabulary would be
    40 GB of float32).

    The decode loop is HF `generate`'s greedy loop (the same left-padded prompts, position ids
    `cumsum(mask) - 1`, KV cache and raw logits; `InverseCdfSampler` picks a sampled token), except that a
    row that ended leaves the batch at once: its KV cache rows go (`DynamicCache.batch_select_indices`), so
    the next steps compute only the rows still decoding, where `generate` computes every row until the
    longest ends (a step of 64 rows whose longest ran to the limit decoded 64 rows to the end).

    Args:
        model: causal LM, or a PeftModel with `adapters` (per-row adapter names; PEFT's base name for none).
        params: sampling; temperature 0 = greedy. `params.seed` seeds torch's global generator first.
        stops: the stop strings' criterion for this batch (`StopStrings(match, len(prompts))`); after the
            call its `first_B` says where each row completed a stop string.
    """
    input_ids, attention_mask = left_pad(prompts, pad_id)
    device = next(model.parameters()).device
    input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
    rows, limit = len(prompts), params.max_new_tokens
    tokens_BT = torch.full((rows, limit), pad_id, dtype=torch.long, device=device)
    logprobs_BT = torch.zeros((rows, limit), dtype=torch.float32, device=device)
    temperature = params.temperature if params.temperature > 0 else 1.0
    steps = 0
    ends = torch.tensor(sorted({*eos_ids, *params.stop_token_ids}), dtype=torch.long, device=device)
    sampler = InverseCdfSampler(params.temperature, params.top_k, params.top_p) if params.temperature > 0 else None
    with _one_adapter(model, adapters) as adapters:
        if params.seed is not None:
            torch.manual_seed(params.seed)
        position_ids = (attention_mask.cumsum(-1) - 1).masked_fill_(attention_mask == 0, 1)  # HF's left-pad rule
        cache = shared_prefill(model, input_ids, attention_mask, adapters)
        step_ids, step_positions = input_ids, position_ids
        if cache is not None:  # the prompts minus their last token are cached: run the last one
            step_ids, step_positions = input_ids[:, -1:], position_ids[:, -1:]
        cache = cache if cache is not None else DynamicCache()
        live = torch.arange(rows, device=device)  # each decoding row's index in the batch
        names, mask, last = adapters, attention_mask, position_ids[:, -1]
        for t in range(limit):
            kwargs: dict[str, Any] = {cache_kwarg(model): cache}
            if names:
                kwargs["adapter_names"] = names
            out = model(
                input_ids=step_ids,
                attention_mask=mask,
                position_ids=step_positions,
                use_cache=True,
                logits_to_keep=1,
                **kwargs,
            )
            logits_bV = out.logits[:, -1, :].float()
            steps = t + 1
            scores_bV = logits_bV
            if sampler is not None:  # one uniform per row of the batch, ended or not: a row's samples do not
                # depend on when the others end (the random stream of `generate`, which samples every row)
                uniforms_B1 = torch.rand(rows, 1, dtype=torch.float64, device="cpu").to(device)
                scores_bV = sampler.with_uniforms(
                    cast(torch.LongTensor, step_ids), cast(torch.FloatTensor, logits_bV), uniforms_B1[live]
                )
            next_b = scores_bV.argmax(dim=-1)
            tokens_BT[live, t] = next_b
            scaled_bV = logits_bV / temperature if temperature != 1.0 else logits_bV
            logprobs_BT[live, t] = scaled_bV.gather(1, next_b[:, None]).squeeze(1) - torch.logsumexp(scaled_bV, -1)
            done_b = torch.isin(next_b, ends)
            if stops is not None:
                done_b |= stops.check(tokens_BT[live, : t + 1], live)
            if bool(done_b.all()) or t + 1 == limit:
                break
            if bool(done_b.any()):  # the rows that ended leave the batch
                keep = (~done_b).nonzero().squeeze(1)
                cache.batch_select_indices(keep)
                live, mask, last, next_b = live[keep], mask[keep], last[keep], next_b[keep]
                names = [names[i] for i in keep.tolist()] if names else None
            mask = torch.cat([mask, mask.new_ones((mask.shape[0], 1))], dim=1)
            last = last + 1
            step_ids, step_positions = next_b[:, None], last[:, None]
    return tokens_BT[:, :steps].cpu(), logprobs_BT[:, :steps].cpu()


@contextmanager
def _one_adapter(model: Any, adapters: list[str] | None) -> Iterator[list[str] | None]:
    """When every row names the same adapter (a GRPO rollout), make it PEFT's active adapter (or disable
    adapters for the base model) and yield None, so the forward skips PEFT's mixed-batch path: per module
    it splits the batch by adapter, a dozen small ops that made a 64 x 48-token rollout on a 2-core CPU
    about 20 % slower. Otherwise yield `adapters` unchanged. Callers hold the engine's model lock."""
    if not adapters or len(set(adapters)) != 1:
        yield adapters
        return
    name = adapters[0]
    if name == BASE_ADAPTER:
        with model.disable_adapter():
            yield None
        return
    model.set_adapter(name)  # the engine always names adapters per batch: the active one need not be restored
    yield None
