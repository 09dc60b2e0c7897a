"""In-process engine: transformers generation with PEFT multi-adapter batches.

Requests naming different adapters share one batch: PEFT routes each row
through its own LoRA weights (`adapter_names=`, base rows through
`__base__`). Adapters load from tensors (the colocated trainer) or from a
PEFT folder / fsspec URI (the store), always under a new versioned name.
`retire_stale` unloads a run's old versions beyond the keep window once no
request uses them.

Left out here (see the hot-swap issue): the bounded adapter pool with
eviction and pinning, pause modes, and continuous batching.
"""

from __future__ import annotations

import json
import threading
import time
import warnings
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import fsspec
import torch
from peft import LoraConfig, PeftModel, get_peft_model, set_peft_model_state_dict
from safetensors.torch import load as load_safetensors
from transformers import GenerationConfig, PreTrainedModel, PreTrainedTokenizerBase

from lora_rl_core.engines.base import (
    Completion,
    GenerationRequest,
    SamplingParams,
    adapter_run,
    adapter_version,
    check_adapter_name,
)
from lora_rl_core.errors import EngineError

BASE_ADAPTER = "__base__"  # PEFT's name for "no adapter" in adapter_names


class EmbeddedEngine:
    """Batched sampling with per-request adapters on one in-process model.

    Args:
        model: the base causal LM (not a PeftModel); the engine wraps it.
        tokenizer: its tokenizer (pad and EOS ids are read from it).
        max_batch_size: sequences per `generate` call.
        keep_versions: versions of a run kept loaded (`max_staleness + 1`).
    """

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        *,
        max_batch_size: int = 64,
        keep_versions: int = 2,
    ) -> None:
        self._model: PreTrainedModel | PeftModel = model
        self._tokenizer = tokenizer
        self._max_batch_size = max_batch_size
        self._keep = keep_versions
        self._adapters: dict[str, dict[str, Any]] = {}
        self._in_flight: Counter[str] = Counter()
        self._counters: Counter[str] = Counter()
        self._lock = threading.RLock()
        self._paused = False
        self._eos_ids = _eos_ids(model, tokenizer)

    # ----------------------------------------------------------------- adapters
    def load_adapter(
        self,
        name: str,
        *,
        path: str | None = None,
        tensors: dict[str, torch.Tensor] | None = None,
        config: dict[str, Any] | None = None,
    ) -> None:
        """Load a LoRA adapter under a new `name`.

        Args:
            name: adapter name, usually `<run>-v<NNNNNN>`; must not be loaded already.
            path: a local PEFT folder or fsspec URI holding `adapter_config.json` and
                `adapter_model.safetensors`; or else
            tensors, config: PEFT state dict (as `get_peft_model_state_dict` gives) and config dict.

        Raises:
            EngineError: bad or duplicate name, missing files, shape/key mismatch, non-finite weights.
                Nothing already loaded is touched.
        """
        try:
            check_adapter_name(name)
        except ValueError as exc:
            raise EngineError(str(exc)) from None
        if path is not None:
            tensors, config = read_adapter_folder(path)
        if tensors is None or config is None:
            raise EngineError(f"load_adapter({name!r}) needs path=, or tensors= and config=")
        _check_finite(name, tensors)
        with self._lock:
            if name in self._adapters:
                raise EngineError(f"adapter {name!r} is already loaded; load new weights under a new versioned name")
            self._inject(name, tensors, config)
            self._adapters[name] = {
                "version": adapter_version(name),
                "source": path or "tensors",
                "loaded_at": time.time(),
            }
            self._counters["loads"] += 1

    def _inject(self, name: str, tensors: dict[str, torch.Tensor], config: dict[str, Any]) -> None:
        lora_config = _lora_config(name, config)
        if isinstance(self._model, PeftModel):
            self._model.add_adapter(name, lora_config)
        else:
            self._model = get_peft_model(self._model, lora_config, adapter_name=name)
        try:
            result = set_peft_model_state_dict(self._model, tensors, adapter_name=name)
            missing = [k for k in result.missing_keys if f".{name}." in k or k.endswith(f".{name}")]
            if result.unexpected_keys or missing:
                raise EngineError(
                    f"adapter {name!r} does not fit the model: "
                    f"unexpected {result.unexpected_keys[:3]}, missing {missing[:3]}"
                )
        except (RuntimeError, EngineError) as exc:
            self._model.delete_adapter(name)
            raise EngineError(f"adapter {name!r} rejected: {str(exc).splitlines()[0]}") from None
        self._model.eval()

    def unload_adapter(self, name: str) -> None:
        """Unload `name`. Raises EngineError if unknown or still used by in-flight requests."""
        with self._lock:
            if name not in self._adapters:
                raise EngineError(f"adapter {name!r} is not loaded (loaded: {sorted(self._adapters)})")
            if self._in_flight[name]:
                raise EngineError(f"adapter {name!r} is used by {self._in_flight[name]} in-flight requests")
            if len(self._adapters) == 1:
                # PEFT keeps at least one adapter; unwrap back to the base model instead.
                self._model = self._model.unload()
            else:
                with warnings.catch_warnings():  # PEFT warns when the "active" adapter goes; we never rely on it
                    warnings.simplefilter("ignore", UserWarning)
                    self._model.delete_adapter(name)
            del self._adapters[name]
            self._counters["unloads"] += 1

    def retire_stale(self, run_id: str, *, active: str) -> list[str]:
        """Unload `run_id`'s versions older than the newest `keep_versions`, except `active`
        and any with in-flight requests. Returns the names unloaded."""
        with self._lock:
            mine = sorted((n for n in self._adapters if adapter_run(n) == run_id), key=adapter_version)
            stale = [n for n in mine[: max(0, len(mine) - self._keep)] if n != active and not self._in_flight[n]]
            for name in stale:
                self.unload_adapter(name)
            return stale

    def list_adapters(self) -> dict[str, dict[str, Any]]:
        """Loaded adapters: name -> {version, source, loaded_at (unix s), in_flight}."""
        with self._lock:
            return {n: {**info, "in_flight": self._in_flight[n]} for n, info in self._adapters.items()}

    # --------------------------------------------------------------- generation
    def generate(self, requests: list[GenerationRequest]) -> list[Completion]:
        """Complete every request with its named adapter; order is preserved.

        Requests with equal sampling params share batches of up to `max_batch_size`,
        adapters mixed freely within a batch.

        Raises:
            EngineError: a request names an adapter that is not loaded (never falls back to
                the base model), or the engine is paused.
        """
        if self._paused:
            raise EngineError("engine is paused: call resume() before generating")
        out: dict[str, Completion] = {}
        with self._lock, self._hold(requests):
            for batch in _batches(requests, self._max_batch_size):
                for completion in self._generate_batch(batch):
                    out[completion.request_id] = completion
        return [out[r.request_id] for r in requests]

    @contextmanager
    def _hold(self, requests: list[GenerationRequest]) -> Iterator[None]:
        unknown = sorted({r.adapter for r in requests if r.adapter is not None and r.adapter not in self._adapters})
        if unknown:
            raise EngineError(f"adapter(s) {unknown} not loaded; loaded: {sorted(self._adapters)}")
        held = Counter(r.adapter for r in requests if r.adapter is not None)
        self._in_flight.update(held)
        try:
            yield
        finally:
            self._in_flight.subtract(held)  # released exactly once per request, errors included

    @torch.no_grad()
    def _generate_batch(self, batch: list[GenerationRequest]) -> list[Completion]:
        params = batch[0].sampling
        input_ids, attention_mask = _left_pad([r.prompt_ids for r in batch], self._tokenizer.pad_token_id)
        device = next(self._model.parameters()).device
        kwargs: dict[str, Any] = {}
        if isinstance(self._model, PeftModel):
            kwargs["adapter_names"] = [r.adapter or BASE_ADAPTER for r in batch]
        if params.seed is not None:
            torch.manual_seed(params.seed)
        out = self._model.generate(
            input_ids=input_ids.to(device),
            attention_mask=attention_mask.to(device),
            generation_config=self._generation_config(params),
            **kwargs,
        )
        new_tokens = out.sequences[:, input_ids.shape[1] :].cpu()  # [B, T]
        logprobs = _token_logprobs(out.logits, new_tokens, params.temperature)  # [B, T]
        return [self._completion(r, new_tokens[i], logprobs[i]) for i, r in enumerate(batch)]

    def _completion(self, req: GenerationRequest, tokens: torch.Tensor, logprobs: torch.Tensor) -> Completion:
        is_eos = torch.isin(tokens, torch.tensor(self._eos_ids))
        stop = int(is_eos.nonzero()[0, 0]) + 1 if bool(is_eos.any()) else None
        n = stop if stop is not None else len(tokens)
        self._counters[f"requests:{req.adapter or BASE_ADAPTER}"] += 1
        self._counters[f"tokens:{req.adapter or BASE_ADAPTER}"] += n
        return Completion(
            request_id=req.request_id,
            prompt_ids=list(req.prompt_ids),
            completion_ids=tokens[:n].tolist(),
            logprobs=logprobs[:n].tolist(),
            finish_reason="stop" if stop is not None else "length",
            adapter=req.adapter,
            adapter_version=adapter_version(req.adapter),
        )

    def _generation_config(self, p: SamplingParams) -> GenerationConfig:
        greedy = p.temperature == 0
        return GenerationConfig(
            max_new_tokens=p.max_new_tokens,
            do_sample=not greedy,
            temperature=None if greedy else p.temperature,
            top_p=None if greedy else p.top_p,
            top_k=None if greedy else p.top_k,
            pad_token_id=self._tokenizer.pad_token_id,
            eos_token_id=self._eos_ids,
            bos_token_id=None,
            return_dict_in_generate=True,
            output_logits=True,
        )

    # -------------------------------------------------------------- control
    def pause(self, mode: str = "in_place") -> None:
        """Refuse new generate calls until `resume` (calls already running finish)."""
        self._paused = True

    def resume(self) -> None:
        """Accept generate calls again."""
        self._paused = False

    def flush_cache(self) -> None:
        """No-op: this engine keeps no KV cache between calls."""

    def health(self) -> dict[str, Any]:
        """`{"ok": True, "paused": bool, "adapters": int}`."""
        return {"ok": True, "paused": self._paused, "adapters": len(self._adapters)}

    def metrics(self) -> dict[str, Any]:
        """Counters: loads, unloads, `requests:<adapter>`, `tokens:<adapter>`, and in-flight per adapter."""
        with self._lock:
            return {**self._counters, "in_flight": {k: v for k, v in self._in_flight.items() if v}}


def read_adapter_folder(path: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Read a PEFT adapter folder (local path or fsspec URI): safetensors weights + config.

    Raises:
        EngineError: a file is missing, the config is not JSON, or a pickle checkpoint is offered.
    """
    fs, root = fsspec.core.url_to_fs(path)
    if fs.exists(f"{root}/adapter_model.bin") and not fs.exists(f"{root}/adapter_model.safetensors"):
        raise EngineError(f"{path}: adapter_model.bin is a pickle checkpoint; only safetensors is accepted")
    try:
        config = json.loads(fs.cat_file(f"{root}/adapter_config.json"))
        tensors = load_safetensors(fs.cat_file(f"{root}/adapter_model.safetensors"))
    except FileNotFoundError as exc:
        raise EngineError(
            f"{path}: missing {exc.filename or exc}: "
            "an adapter folder needs adapter_config.json and adapter_model.safetensors"
        ) from None
    except (json.JSONDecodeError, Exception) as exc:  # safetensors raises its own error types
        raise EngineError(f"{path}: unreadable adapter: {str(exc).splitlines()[0]}") from None
    return tensors, config


def _lora_config(name: str, config: dict[str, Any]) -> LoraConfig:
    if config.get("peft_type", "LORA") != "LORA":
        raise EngineError(f"adapter {name!r}: peft_type {config.get('peft_type')!r} is not LORA")
    if config.get("use_dora"):
        raise EngineError(f"adapter {name!r}: DoRA adapters are not supported by mixed-adapter batches")
    fields = set(LoraConfig.__dataclass_fields__)
    clean = {
        k: v for k, v in config.items() if k in fields and k not in {"peft_type", "base_model_name_or_path", "revision"}
    }
    clean.update(inference_mode=True, lora_dropout=0.0)
    try:
        return LoraConfig(**clean)
    except (TypeError, ValueError) as exc:
        raise EngineError(f"adapter {name!r}: bad adapter_config: {exc}") from None


def _check_finite(name: str, tensors: dict[str, torch.Tensor]) -> None:
    for key, t in tensors.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise EngineError(f"adapter {name!r}: tensor {key} has NaN or Inf values")


def _eos_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    ids = {tokenizer.eos_token_id}
    gen_eos = getattr(model.generation_config, "eos_token_id", None)
    ids.update(gen_eos if isinstance(gen_eos, list) else [gen_eos])
    return sorted(i for i in ids if i is not None)


def _batches(requests: list[GenerationRequest], size: int) -> Iterator[list[GenerationRequest]]:
    by_params: dict[SamplingParams, list[GenerationRequest]] = {}
    for r in requests:
        by_params.setdefault(r.sampling, []).append(r)
    for group in by_params.values():
        for i in range(0, len(group), size):
            yield group[i : i + size]


def _left_pad(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad prompts to `[B, P]` ids and attention mask (generation appends on the right)."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :] = torch.tensor(r, dtype=torch.long)
        mask[i, width - len(r) :] = 1
    return ids, mask


def _token_logprobs(step_logits: tuple[torch.Tensor, ...], tokens_BT: torch.Tensor, temperature: float) -> torch.Tensor:
    """Log-probs `[B, T]` of the sampled tokens under softmax(logits / temperature); one step at a time
    so the `[B, T, V]` tensor is never built."""
    temp = temperature if temperature > 0 else 1.0
    out = torch.empty(tokens_BT.shape, dtype=torch.float32)
    for t, logits_BV in enumerate(step_logits):
        scaled = logits_BV.float().cpu() / temp
        picked = scaled.gather(1, tokens_BT[:, t : t + 1]).squeeze(1)
        out[:, t] = picked - torch.logsumexp(scaled, dim=-1)
    return out
