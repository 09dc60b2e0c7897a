"""The embedded engine's model: one transformers model with PEFT LoRA adapters injected and deleted at run time.

`PeftAdapterModel` owns the model and its lock: it validates adapters (`adapters.AdapterRules`: finite
weights, LoRA config, rank, target modules, shapes) before any model change, injects them (the first
one wraps the base model in a `PeftModel`, deleting the last one unwraps it), keeps the resident set
within the `AdapterPool`'s cap (evicting by its policy, re-reading evicted adapters from their source
when a batch needs them), and runs forward batches through `generation.generate_batch` with one
adapter per row (`adapter_names=`). Completions carry per-token logprobs under the sampling
temperature, computed one step at a time (never a `[B, T, V]` tensor), and end where generation halted for
them (`finish_points`: EOS `eos`, a stop string or stop token id `stop`, else `length`).

An adapter is held in the base weights' dtype (PEFT's `autocast_adapter_dtype=False`), as
SGLang holds its adapters, not in PEFT's default float32 over a bfloat16 model: there PEFT casts every adapted
layer's input to float32 and the result back, 210 times a decode step for SmolLM2's 30 layers x 7 modules. On a
2-core AVX512-BF16 EPYC, 64 rows x 48 sampled tokens of SmolLM2-135M with a rank-16 all-linear adapter took
20.2 s with the float32 adapter and 16.4 s in bfloat16 (the base model alone: 12.9 s). The trainer keeps its
float32 master weights; its logprobs and the engine's differ by the rounding of the adapter to bfloat16, which
the step line's logprob mismatch shows.

The request lifecycle (queue, admission, usage counts, deadlines, the worker) is `embedded.py`'s; the
pool's registry decides *which* adapters exist, this module only what the model holds.
"""

from __future__ import annotations

import functools
import threading
import time
import warnings
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from peft import LoraConfig, PeftModel, get_peft_model, set_peft_model_state_dict
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from lora_rl_core.adapters import STORE_URI_PREFIX, AdapterRules, TensorsAndConfig
from lora_rl_core.engines.base import Completion, FinishReason, GenerationRequest
from lora_rl_core.engines.embedded.generation import BASE_ADAPTER, StopMatch, StopStrings, generate_batch, stop_match
from lora_rl_core.engines.embedded.pool import AdapterPool
from lora_rl_core.errors import EngineError, StoreError
from lora_rl_core.store.sources import read_adapter_folder, read_store_uri

_CONFIG_DROP = {"peft_type", "base_model_name_or_path", "revision"}  # not LoraConfig arguments
_STOP_MATCHES_KEPT = 16  # sets of stop strings whose matcher is kept (each holds a table of the vocabulary)


class PeftAdapterModel:
    """A causal LM with LoRA adapters injected on demand, within the pool's residency cap.

    Model changes and forward passes need the model lock (`locked`); methods named `*_locked` and
    `add`, `make_resident`, `drop`, `generate` expect it held.

    Args:
        model: the base causal LM (not a PeftModel); it is wrapped when the first adapter comes.
        tokenizer: its tokenizer (pad and EOS ids are read from it; stop strings are matched with it).
        pool: the engine's adapter pool (residency, eviction policy, loaders of evicted adapters).
        max_lora_rank: reject adapters of a larger rank (SGLang `--max-lora-rank`); None = any.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        pool: AdapterPool,
        *,
        max_lora_rank: int | None = None,
    ) -> None:
        self._model: PreTrainedModel | PeftModel = model
        self.eos_ids = eos_ids(model, tokenizer)
        # padding is masked out, so any id does; a tokenizer without a pad token pads with EOS, as HF generate
        pad_id = tokenizer.pad_token_id
        self._pad_id: int = pad_id if pad_id is not None else (self.eos_ids[0] if self.eos_ids else 0)
        self._rules = AdapterRules.for_model(model, max_rank=max_lora_rank)  # DoRA: no mixed-adapter batches
        self._pool = pool
        self._lock = threading.Lock()
        self._tokenizer = tokenizer
        self._stop_matches: dict[tuple[str, ...], StopMatch] = {}  # built under the model lock

    @contextmanager
    def locked(self, timeout_s: float, what: str) -> Iterator[None]:
        """Hold the model lock; waits at most `timeout_s` seconds (for the running batch).

        Raises:
            EngineError: `what` timed out.
        """
        if not self._lock.acquire(timeout=max(0.0, timeout_s)):
            raise EngineError(f"{what}: timed out after {timeout_s:g} s waiting for the running batch")
        try:
            yield
        finally:
            self._lock.release()

    def validate(self, name: str, tensors: dict[str, torch.Tensor], config: dict[str, Any]) -> None:
        """Checks that need no model change: finite weights, LoRA config, rank, target modules, shapes.

        Raises:
            EngineError: naming the adapter, the file and the field at fault.
        """
        try:
            self._rules.check_tensors(tensors, config)
        except StoreError as exc:
            raise EngineError(f"adapter {name!r}: {exc}") from None

    # ----------------------------------------------------------- residency
    def add(self, name: str, tensors: dict, config: dict, *, keep: Collection[str] = ()) -> float:
        """Evict what the pool policy chooses (never `keep`), inject `name`; returns the injection time (s).

        Raises:
            EngineError: the pool is full, or PEFT rejects the weights (the model is left without `name`).
        """
        self.drop(self._pool.evict_for(1, keep=keep))
        start = time.perf_counter()
        self._inject(name, tensors, config)
        return time.perf_counter() - start

    def make_resident(self, names: set[str]) -> dict[str, EngineError]:
        """Inject the batch's non-resident adapters, re-read from their loaders; returns those that failed."""
        failed: dict[str, EngineError] = {}
        for name in sorted(names):
            entry = self._pool.entry(name)
            if entry is None or entry.resident or entry.loader is None:
                continue
            try:
                tensors, config = entry.loader()
                self.validate(name, tensors, config)
                self._pool.mark_resident(name, self.add(name, tensors, config, keep=names))
            except EngineError as exc:
                failed[name] = EngineError(f"adapter {name!r} could not be made resident: {exc}")
        return failed

    def _inject(self, name: str, tensors: dict[str, torch.Tensor], config: dict[str, Any]) -> None:
        lora_config = _lora_config(name, config)
        try:
            # the adapter in the base weights' dtype, as SGLang holds it: PEFT's default float32 copy of a
            # bfloat16 model's adapter cast every adapted layer's input up and back at every decode step
            # (module docstring)
            if isinstance(self._model, PeftModel):
                self._model.add_adapter(name, lora_config, autocast_adapter_dtype=False)
            else:
                self._model = get_peft_model(self._model, lora_config, adapter_name=name, autocast_adapter_dtype=False)
            _set_weights(self._model, name, tensors)
        except (RuntimeError, ValueError, KeyError, EngineError) as exc:
            self.drop([name])
            reason = " ".join(line.strip() for line in str(exc).splitlines()[:2])  # torch puts the cause on line 2
            raise EngineError(f"adapter {name!r} rejected: {reason}") from None
        self._model.eval()

    def drop(self, names: list[str]) -> None:
        """Delete adapters from the model and forget those that are fully unloaded."""
        for name in names:
            if isinstance(self._model, PeftModel) and name in self._model.peft_config:
                self._delete_adapter(name)
            self._pool.forget(name)

    def _delete_adapter(self, name: str) -> None:
        assert isinstance(self._model, PeftModel)
        if len(self._model.peft_config) == 1:
            self._model = self._model.unload()  # PEFT keeps at least one adapter: unwrap to the base model
            return
        with warnings.catch_warnings():  # PEFT warns when the "active" adapter goes; we never rely on it
            warnings.simplefilter("ignore", UserWarning)
            self._model.delete_adapter(name)

    def reap(self, timeout_s: float) -> None:
        """Free unloaded adapters that no request holds, if the model lock comes within `timeout_s`
        (otherwise the worker does it before its next batch)."""
        if self._lock.acquire(timeout=max(0.0, timeout_s)):
            try:
                self.reap_locked()
            finally:
                self._lock.release()

    def reap_locked(self) -> None:
        """`reap` with the model lock held."""
        names = self._pool.reapable()
        if names:
            self.drop(names)

    # ----------------------------------------------------------- generation
    @torch.no_grad()
    def run(
        self, requests: list[GenerationRequest], versions: list[int | None], timeout_s: float
    ) -> list[Completion | EngineError]:
        """One forward batch: free unloaded adapters, make the batch's adapters resident and generate (model
        lock held, waiting at most `timeout_s`), then build completions (no lock).

        Args:
            requests: admitted requests with equal sampling params.
            versions: the adapter version each was admitted with (recorded in its completion).

        Returns:
            Per request, in order: its Completion, or the EngineError of an adapter that could not be made
            resident (the other rows still run).

        Raises:
            EngineError: the lock timed out; any other error of the forward pass propagates.
        """
        with self.locked(timeout_s, "forward batch"):
            self.reap_locked()
            failed = self.make_resident({r.adapter for r in requests if r.adapter is not None})
            rows = [i for i, r in enumerate(requests) if r.adapter not in failed]
            raw = self.generate([requests[i] for i in rows]) if rows else None
        out: dict[int, Completion | EngineError] = {
            i: failed[r.adapter] for i, r in enumerate(requests) if r.adapter in failed
        }
        if raw is not None:
            done = self.completions([requests[i] for i in rows], [versions[i] for i in rows], *raw)
            out.update(zip(rows, done, strict=True))
        return [out[i] for i in range(len(requests))]

    def generate(self, requests: list[GenerationRequest]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """One generate call over requests with equal sampling params: new tokens `[B, T]`, their logprobs
        `[B, T]` (`generation.generate_batch`: inverse-CDF sampling, shared prefill of repeated prompts) and,
        with stop strings, where each row completed one (`[B]` long, CPU: index in the completion, -1 none)."""
        adapters = [r.adapter or BASE_ADAPTER for r in requests] if isinstance(self._model, PeftModel) else None
        params = requests[0].sampling
        prompts = [r.prompt_ids for r in requests]
        stops = StopStrings(self._stop_match(params.stop), len(prompts)) if params.stop else None
        tokens_BT, logprobs_BT = generate_batch(
            self._model, prompts, adapters, params, pad_id=self._pad_id, eos_ids=self.eos_ids, stops=stops
        )
        first_B = stops.first_B.cpu() if stops is not None else None
        return tokens_BT, logprobs_BT, first_B

    def _stop_match(self, stops: tuple[str, ...]) -> StopMatch:
        """The matcher of `stops`, built once (it reads the vocabulary) and kept for the last few sets."""
        match = self._stop_matches.pop(stops, None) or stop_match(self._tokenizer, stops)
        self._stop_matches[stops] = match  # most recently used last
        if len(self._stop_matches) > _STOP_MATCHES_KEPT:
            del self._stop_matches[next(iter(self._stop_matches))]
        return match

    def completions(
        self,
        requests: list[GenerationRequest],
        versions: list[int | None],
        tokens_BT: torch.Tensor,
        logprobs_BT: torch.Tensor,
        stop_at_B: torch.Tensor | None = None,
    ) -> list[Completion]:
        """Completions of one batch from its new tokens `[B, T]`, their logprobs `[B, T]` and where rows
        completed a stop string (`stop_at_B`, from `generate`; no lock needed).

        Each row is cut after the token that ended it, which is kept (`finish_points`); one logprob per kept token.
        """
        params = requests[0].sampling
        ends = finish_points(tokens_BT, self.eos_ids, params.stop_token_ids, stop_at_B)
        return [
            _completion(r, v, tokens_BT[i, :n].tolist(), logprobs_BT[i, :n].tolist(), finish)
            for i, (r, v, (n, finish)) in enumerate(zip(requests, versions, ends, strict=True))
        ]


# ---------------------------------------------------------------------- adapter sources
def adapter_loader(
    name: str, path: str | None, tensors: dict | None, config: dict | None, store: Any
) -> tuple[Callable[[], TensorsAndConfig], str]:
    """A function that (re)reads an adapter's weights and config, and a description of its source.

    Sources: `tensors` with `config` (kept as given: the caller must not modify them), else `store://SPEC`
    (from `store`), a PEFT folder or store version folder (`path`). The loader raises `EngineError`.

    Raises:
        EngineError: neither `path` nor both `tensors` and `config`.
    """
    if tensors is not None and config is not None:
        return (lambda: (tensors, config)), "tensors"
    if path is not None and path.startswith(STORE_URI_PREFIX):
        return functools.partial(_read, name, functools.partial(read_store_uri, store, path)), path
    if path is not None:
        return functools.partial(_read, name, functools.partial(read_adapter_folder, path)), path
    raise EngineError(f"load_adapter({name!r}) needs path=, or tensors= and config=")


def _read(name: str, read: Callable[[], TensorsAndConfig]) -> TensorsAndConfig:
    try:
        return read()
    except StoreError as exc:
        raise EngineError(f"adapter {name!r}: {exc}") from None


# ---------------------------------------------------------------------- PEFT
def _lora_config(name: str, config: dict[str, Any]) -> LoraConfig:
    """A PEFT `LoraConfig` for inference from a validated `adapter_config.json` dict (unknown keys dropped)."""
    fields = set(LoraConfig.__dataclass_fields__)
    clean = {k: v for k, v in config.items() if k in fields and k not in _CONFIG_DROP}
    clean.update(inference_mode=True, lora_dropout=0.0)
    try:
        return LoraConfig(**clean)
    except (TypeError, ValueError) as exc:
        raise EngineError(f"adapter {name!r}: bad adapter_config: {exc}") from None


def _set_weights(model: PeftModel, name: str, tensors: dict[str, torch.Tensor]) -> None:
    """Load the adapter's state dict; every key must be used and every LoRA weight of `name` set."""
    result: Any = set_peft_model_state_dict(model, tensors, adapter_name=name)  # torch's _IncompatibleKeys
    missing = [k for k in result.missing_keys if f".{name}." in k or k.endswith(f".{name}")]
    if result.unexpected_keys or missing:
        raise EngineError(
            f"adapter {name!r} does not fit the model: unexpected {result.unexpected_keys[:3]}, missing {missing[:3]}"
        )


def eos_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """Sorted token ids that end a completion: the tokenizer's EOS and the model's generation-config EOS ids."""
    ids = {tokenizer.eos_token_id}
    gen_eos = getattr(model.generation_config, "eos_token_id", None)
    ids.update(gen_eos if isinstance(gen_eos, list) else [gen_eos])
    return sorted(i for i in ids if i is not None)


# ---------------------------------------------------------------------- completions
def finish_points(
    tokens_BT: torch.Tensor, eos_ids: list[int], stop_token_ids: tuple[int, ...], stop_at_B: torch.Tensor | None
) -> list[tuple[int, FinishReason]]:
    """How many tokens each row of new tokens `[B, T]` keeps, and why it ended: after the first of the token that
    completed a stop string (`stop_at_B`: index per row, -1 none; `stop`) and the first EOS id (`eos`) or stop
    token id (`stop`; an id that is both counts as a stop), the ending token kept; else all `T` (`length`). A stop
    string completed by an EOS or stop token id counts as the string (SGLang checks strings first)."""
    T = tokens_BT.shape[1]
    ended_BT = torch.isin(tokens_BT, torch.tensor(sorted({*eos_ids, *stop_token_ids}), dtype=tokens_BT.dtype))
    first_end_B = torch.where(ended_BT.any(dim=1), ended_BT.to(torch.int8).argmax(dim=1), T).tolist()
    first_stop_B = stop_at_B.tolist() if stop_at_B is not None else [-1] * tokens_BT.shape[0]
    out: list[tuple[int, FinishReason]] = []
    for i, (end, stop) in enumerate(zip(first_end_B, first_stop_B, strict=True)):
        if 0 <= stop < T and stop <= end:
            out.append((stop + 1, "stop"))
        elif end < T:
            out.append((end + 1, "stop" if int(tokens_BT[i, end]) in stop_token_ids else "eos"))
        else:
            out.append((T, "length"))
    return out


def _completion(
    request: GenerationRequest, version: int | None, tokens: list[int], logprobs: list[float], finish: FinishReason
) -> Completion:
    return Completion(
        request_id=request.request_id,
        prompt_ids=list(request.prompt_ids),
        completion_ids=tokens,
        logprobs=logprobs,
        finish_reason=finish,
        adapter=request.adapter,
        adapter_version=version,
    )
