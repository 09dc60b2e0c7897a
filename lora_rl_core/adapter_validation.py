"""Checks of LoRA adapters taken from an untrusted store, before anything loads them.

Three layers, each raising ``StoreError`` with the file and the field at fault:

* ``safetensors_shapes``: the weights file is a well-formed safetensors file
  (header inside the file, known dtypes, offsets inside the data); parses the
  header only, so it costs microseconds and never unpickles anything.
* ``validate_adapter_config``: ``adapter_config.json`` is a LoRA config with a
  positive rank and alpha and non-empty targets; with a base model's linear
  layer names, every target module exists; with an engine's limits, the rank
  fits and DoRA is refused where the engine lacks it.
* ``validate_adapter_tensors``: every tensor is a ``lora_A`` / ``lora_B`` (or
  embedding / DoRA magnitude) weight of a target module, A and B come in pairs,
  and their rank dimension matches ``r`` (or ``rank_pattern``).

Module matching follows PEFT: a list of targets matches a module whose name is
a target or ends with ``.<target>``; a string target is a regex that must
match the full module name; ``"all-linear"`` matches every linear layer.
Left out: ``layers_to_transform`` / ``layers_pattern`` and ``alpha_pattern``
are not cross-checked.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from lora_rl_core.errors import StoreError

CONFIG_WHERE = "adapter_config.json"
WEIGHTS_WHERE = "adapter_model.safetensors"
MAX_HEADER_BYTES = 100 * 2**20
_DTYPE_BYTES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1,
    "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1,
}  # fmt: skip
_KEY_RE = re.compile(
    r"(?:base_model\.model\.)?(?P<module>.+?)\."
    r"(?P<kind>lora_A|lora_B|lora_embedding_A|lora_embedding_B|lora_magnitude_vector)(?:\.weight)?"
)


# ----------------------------------------------------------------- safetensors


def safetensors_shapes(data: bytes, where: str = WEIGHTS_WHERE) -> dict[str, list[int]]:
    """Parse and check a safetensors header without loading any tensor.

    Args:
        data: the whole file.
        where: file name or URI for messages.

    Returns:
        tensor name -> shape.

    Raises:
        StoreError: truncated file, header not JSON, unknown dtype, or a tensor's bytes outside the file.
    """
    if len(data) < 8:
        raise StoreError(f"{where} is not a safetensors file: {len(data)} bytes, shorter than the 8-byte header length")
    n = int.from_bytes(data[:8], "little")
    if n > min(len(data) - 8, MAX_HEADER_BYTES):
        raise StoreError(
            f"{where} is not a safetensors file (or is truncated): header length {n} > file size {len(data)}"
        )
    try:
        header = json.loads(data[8 : 8 + n])
    except ValueError as e:
        raise StoreError(f"{where} is not a safetensors file: its header is not JSON ({e})") from e
    if not isinstance(header, dict):
        raise StoreError(f"{where} is not a safetensors file: its header is not a JSON object")
    body = len(data) - 8 - n
    return {name: _tensor_shape(name, info, body, where) for name, info in header.items() if name != "__metadata__"}


def _tensor_shape(name: str, info: Any, body: int, where: str) -> list[int]:
    """Check one header entry: known dtype, integer shape, offsets inside the data and matching the shape."""
    ok = isinstance(info, dict) and info.get("dtype") in _DTYPE_BYTES
    shape, offsets = (info.get("shape"), info.get("data_offsets")) if ok else (None, None)
    ok = ok and isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)
    ok = ok and isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)
    if not ok:
        raise StoreError(f"{where}: tensor {name!r} has a malformed header entry (dtype, shape or data_offsets)")
    begin, end = offsets
    if not 0 <= begin <= end <= body:
        raise StoreError(f"{where}: tensor {name!r} lies outside the file (truncated?): bytes {begin}-{end} of {body}")
    if end - begin != math.prod(shape) * _DTYPE_BYTES[info["dtype"]]:
        raise StoreError(f"{where}: tensor {name!r} has {end - begin} bytes, which does not match shape {shape}")
    return shape


# ----------------------------------------------------------------- config


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _target_modules(config: Mapping[str, Any], where: str) -> list[str] | str:
    targets = config.get("target_modules")
    if isinstance(targets, (set, frozenset, tuple)):  # LoraConfig.to_dict() holds a set
        targets = sorted(targets)
    if isinstance(targets, str) and targets:
        if targets != "all-linear":
            try:
                re.compile(targets)
            except re.error as e:
                raise StoreError(f"{where}: target_modules {targets!r} is not a valid regex ({e})") from e
        return targets
    if isinstance(targets, list) and targets and all(isinstance(t, str) and t for t in targets):
        return targets
    raise StoreError(f"{where}: target_modules must be a non-empty list of module names or a regex, got {targets!r}")


def module_matches(module: str, targets: list[str] | str) -> bool:
    """PEFT's rule: a regex must match the full name; a list entry must equal the name or its dotted suffix."""
    if isinstance(targets, str):
        return targets == "all-linear" or re.fullmatch(targets, module) is not None
    return any(module == t or module.endswith(f".{t}") for t in targets)


def validate_adapter_config(
    config: Mapping[str, Any],
    *,
    base_linear_names: Sequence[str] | None = None,
    max_rank: int | None = None,
    allow_dora: bool = False,
    where: str = CONFIG_WHERE,
) -> None:
    """Check a PEFT LoRA ``adapter_config.json`` from an untrusted source.

    Args:
        config: the parsed JSON.
        base_linear_names: names of the base model's linear layers (full dotted
            names such as ``model.layers.0.self_attn.q_proj``, or short names);
            None skips the check that every target exists.
        max_rank: the engine's largest supported rank (SGLang ``--max-lora-rank``); None: no limit.
        allow_dora: whether the engine can serve DoRA (``use_dora: true``) adapters.
        where: file name or URI for messages.

    Raises:
        StoreError: not a dict or not LoRA, bad rank or alpha, empty or unknown
            target modules, rank over ``max_rank``, DoRA where not allowed.
    """
    if not isinstance(config, Mapping):
        raise StoreError(f"{where}: must be a JSON object, got {type(config).__name__}")
    if config.get("peft_type", "LORA") != "LORA":
        raise StoreError(f"{where}: peft_type {config.get('peft_type')!r} is not LORA; only LoRA adapters are accepted")
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if not _positive_int(rank):
        raise StoreError(f"{where}: r (the LoRA rank) must be a positive integer, got {rank!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha) or alpha <= 0:
        raise StoreError(f"{where}: lora_alpha must be a positive number, got {alpha!r}")
    targets = _target_modules(config, where)
    _check_ranks(config, rank, max_rank, where)
    if config.get("use_dora") and not allow_dora:
        raise StoreError(
            f"{where}: DoRA adapters (use_dora: true) are not supported by this engine; train without DoRA"
        )
    if base_linear_names is not None:
        _check_targets_exist(targets, base_linear_names, where)


def _check_ranks(config: Mapping[str, Any], rank: int, max_rank: int | None, where: str) -> None:
    pattern = config.get("rank_pattern") or {}
    if not isinstance(pattern, Mapping) or not all(_positive_int(r) for r in pattern.values()):
        raise StoreError(f"{where}: rank_pattern must map module patterns to positive integers, got {pattern!r}")
    if max_rank is not None:
        for name, r in [("r", rank), *((f"rank_pattern[{k!r}]", v) for k, v in pattern.items())]:
            if r > max_rank:
                raise StoreError(f"{where}: {name} = {r} exceeds the engine's maximum LoRA rank {max_rank}")


def _check_targets_exist(targets: list[str] | str, names: Sequence[str], where: str) -> None:
    if targets == "all-linear":
        return
    wanted = [targets] if isinstance(targets, str) else targets
    missing = [t for t in wanted if not any(module_matches(n, t if isinstance(targets, str) else [t]) for n in names)]
    if missing:
        short = sorted({n.rsplit(".", 1)[-1] for n in names})
        shown = ", ".join(short[:16]) + (", ..." if len(short) > 16 else "")
        raise StoreError(
            f"{where}: target_modules {missing} not found among the base model's linear layers ({shown or 'none'})"
        )


# ----------------------------------------------------------------- tensors


def _rank_for(module: str, config: Mapping[str, Any]) -> int:
    """``r``, or the ``rank_pattern`` entry matching ``module`` (PEFT's ``(.*\\.)?(pattern)$`` rule)."""
    for pattern, rank in (config.get("rank_pattern") or {}).items():
        if re.match(rf"(.*\.)?({pattern})$", module):
            return rank
    return config["r"]


def validate_adapter_tensors(
    shapes: Mapping[str, Sequence[int]], config: Mapping[str, Any], *, where: str = WEIGHTS_WHERE
) -> None:
    """Check that the weights are the LoRA weights ``config`` describes.

    Call ``validate_adapter_config`` first. Keys are as PEFT saves them
    (``base_model.model.<module>.lora_A.weight``).

    Args:
        shapes: tensor name -> shape (from ``safetensors_shapes`` or ``{k: t.shape}``).
        config: a config that passed ``validate_adapter_config``.
        where: file name or URI for messages.

    Raises:
        StoreError: no tensors, a tensor that is not a LoRA weight of a target
            module, a DoRA vector without ``use_dora``, a rank dimension that is
            not ``r``, or an A without its B (or the reverse).
    """
    if not shapes:
        raise StoreError(f"{where} holds no tensors; expected lora_A / lora_B weights")
    targets, keep = _target_modules(config, CONFIG_WHERE), config.get("modules_to_save") or []
    pairs: dict[tuple[str, str], set[str]] = {}
    for key, shape in shapes.items():
        match = _KEY_RE.fullmatch(key)
        if match is None:
            if any(f".{m}." in f".{key}" for m in keep):
                continue  # a full copy of a modules_to_save module
            raise StoreError(f"{where}: tensor {key!r} is not a LoRA weight (lora_A / lora_B of a target module)")
        module, kind = match["module"], match["kind"]
        _check_tensor(key, module, kind, list(shape), targets, config, where)
        if kind != "lora_magnitude_vector":
            pairs.setdefault((module, kind[:-1]), set()).add(kind[-1])
    unpaired = sorted(m for m, kinds in pairs.items() if kinds != {"A", "B"})
    if unpaired:
        module, kind = unpaired[0]
        raise StoreError(f"{where}: module {module!r} has a {kind}A without its {kind}B or the reverse")


def _check_tensor(
    key: str, module: str, kind: str, shape: list[int], targets: list[str] | str, config: Mapping[str, Any], where: str
) -> None:
    if not module_matches(module, targets) and targets != "all-linear":
        raise StoreError(f"{where}: tensor {key!r} belongs to {module!r}, which target_modules does not name")
    if kind == "lora_magnitude_vector":
        if not config.get("use_dora"):
            raise StoreError(f"{where}: tensor {key!r} is a DoRA magnitude vector but use_dora is not set")
        return
    rank, axis = _rank_for(module, config), (0 if kind.endswith("A") else 1)
    if len(shape) < 2 or shape[axis] != rank:
        raise StoreError(f"{where}: tensor {key!r} has shape {shape}, but rank r = {rank} needs dim {axis} = {rank}")


# ----------------------------------------------------------------- engine rules


def linear_module_names(model: Any) -> list[str]:
    """Dotted names of the linear layers of a torch model (``nn.Linear`` and GPT-2 style ``Conv1D``).

    LoRA layers already injected (PEFT wrappers) report their base layer's name.
    """
    import torch

    names = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) or type(module).__name__ == "Conv1D":
            name = re.sub(r"^base_model\.model\.", "", name)
            name = re.sub(r"\.(base_layer|lora_[AB]\.[^.]+|lora_embedding_[AB])$", "", name)
            names.append(name)
    return sorted(set(names))


@dataclass(frozen=True)
class AdapterRules:
    """What an engine accepts; ``check`` validates a config and its tensors against it.

    Args:
        base_linear_names: the base model's linear layer names (``linear_module_names(model)``); None: unchecked.
        max_rank: the largest rank the engine serves; None: no limit.
        allow_dora: whether the engine serves DoRA adapters.
    """

    base_linear_names: tuple[str, ...] | None = None
    max_rank: int | None = None
    allow_dora: bool = False

    @classmethod
    def for_model(cls, model: Any, *, max_rank: int | None = None, allow_dora: bool = False) -> AdapterRules:
        """Rules for adapters of ``model`` (a transformers model, with or without LoRA layers injected)."""
        return cls(tuple(linear_module_names(model)), max_rank, allow_dora)

    def check(self, config: Mapping[str, Any], shapes: Mapping[str, Sequence[int]], where: str = "adapter") -> None:
        """Validate config then tensors; ``where`` (a URI) prefixes both file names in messages.

        Raises:
            StoreError: as ``validate_adapter_config`` and ``validate_adapter_tensors``.
        """
        validate_adapter_config(
            config,
            base_linear_names=self.base_linear_names,
            max_rank=self.max_rank,
            allow_dora=self.allow_dora,
            where=f"{where}/{CONFIG_WHERE}",
        )
        validate_adapter_tensors(shapes, config, where=f"{where}/{WEIGHTS_WHERE}")
