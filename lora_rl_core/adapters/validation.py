"""Checks of LoRA adapters before anything loads them: the store on publish and read, the engines on load.

Each check raises ``StoreError`` naming the file and the field at fault (engines re-raise it as
``EngineError`` naming the adapter):

* ``check_finite``: every tensor is a tensor, and floating-point ones hold no NaN or inf.
* ``validate_adapter_config``: ``adapter_config.json`` is a LoRA config with a
  positive rank and alpha and non-empty targets; with a base model's adaptable
  module names, every target module exists; with an engine's limits, the rank
  fits and DoRA is refused where the engine lacks it.
* ``validate_adapter_tensors``: every tensor is a ``lora_A`` / ``lora_B`` (or
  embedding / DoRA magnitude) weight of a target module, A and B come in pairs,
  and their rank dimension matches ``r`` (or ``rank_pattern``).
* ``AdapterRules``: what one engine accepts (its model's modules, its largest rank, DoRA or not),
  applying both validators.

The safetensors header check (``safetensors_shapes``) lives with the file reading in ``adapters.io``.

Module matching follows PEFT: a list of targets matches a module whose name is
a target or ends with ``.<target>``; a string target is a regex that must
match the full module name; ``"all-linear"`` matches every linear layer.
``adaptable_module_names`` is the one list of modules LoRA can adapt (``lora.py`` resolves
``target_modules`` from it too). Left out: ``layers_to_transform`` / ``layers_pattern`` and
``alpha_pattern`` are not cross-checked.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lora_rl_core.adapters.names import CONFIG_FILE, MODEL_FILE
from lora_rl_core.errors import StoreError

if TYPE_CHECKING:
    from torch import nn

_KEY_RE = re.compile(
    r"(?:base_model\.model\.)?(?P<module>.+?)\."
    r"(?P<kind>lora_A|lora_B|lora_embedding_A|lora_embedding_B|lora_magnitude_vector)(?:\.weight)?"
)
_PEFT_PREFIX_RE = re.compile(r"^base_model\.model\.")
_PEFT_SUFFIX_RE = re.compile(r"\.(base_layer|lora_[AB]\.[^.]+|lora_embedding_[AB])$")


# ----------------------------------------------------------------- model modules


def adaptable_module_names(model: nn.Module, *, linear_only: bool = False) -> list[str]:
    """Sorted dotted names of the modules of ``model`` that PEFT LoRA can adapt.

    Linear layers (``nn.Linear`` and GPT-2 style ``Conv1D``) and, unless ``linear_only``, embeddings and
    convolutions. Names are as in the base model: LoRA layers already injected (PEFT wrappers) report
    their base layer's name, so a wrapped model gives the same list. The output head is included
    (PEFT's ``all-linear`` leaves it out: ``lora.linear_suffixes`` does that).
    """
    from torch import nn  # lazy: the store and the CLI import this module without needing torch

    linear: tuple[type, ...] = (nn.Linear,)
    kinds = linear if linear_only else (*linear, nn.Embedding, nn.Conv1d, nn.Conv2d)
    names = set()
    for name, module in model.named_modules():
        if name and (isinstance(module, kinds) or type(module).__name__ == "Conv1D"):
            names.add(_PEFT_SUFFIX_RE.sub("", _PEFT_PREFIX_RE.sub("", name)))
    return sorted(names)


# ----------------------------------------------------------------- tensors


def check_finite(tensors: Mapping[str, Any], where: str = MODEL_FILE) -> None:
    """Check that every value is a tensor and that floating-point ones hold no NaN or inf.

    Args:
        tensors: name -> tensor (a PEFT state dict).
        where: file name or URI for messages.

    Raises:
        StoreError: naming the first bad tensor.
    """
    import torch

    for key, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise StoreError(f"{where}: {key!r} is a {type(t).__name__}, not a tensor")
        if not t.is_floating_point() or bool(torch.isfinite(t.sum())):
            continue  # a finite sum means no NaN or inf (fast path: no bool tensor allocated)
        if not bool(torch.isfinite(t).all()):
            raise StoreError(f"{where}: tensor {key!r} has NaN or inf values; refusing to load or publish it")


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
    base_module_names: Sequence[str] | None = None,
    max_rank: int | None = None,
    allow_dora: bool = False,
    where: str = CONFIG_FILE,
) -> None:
    """Check a PEFT LoRA ``adapter_config.json`` from an untrusted source.

    Args:
        config: the parsed JSON.
        base_module_names: the base model's adaptable modules (``adaptable_module_names``: full dotted
            names such as ``model.layers.0.self_attn.q_proj``); None skips the check that every target exists.
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
    if not isinstance(rank, int) or not _positive_int(rank):
        raise StoreError(f"{where}: r (the LoRA rank) must be a positive integer, got {rank!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha) or alpha <= 0:
        raise StoreError(f"{where}: lora_alpha must be a positive number, got {alpha!r}")
    targets = _target_modules(config, where)
    _check_ranks(config, rank, max_rank, where)
    if config.get("use_dora") and not allow_dora:
        raise StoreError(
            f"{where}: DoRA adapters (use_dora: true) are not supported by this engine; train without DoRA"
        )
    if base_module_names is not None:
        _check_targets_exist(targets, base_module_names, where)


def _check_ranks(config: Mapping[str, Any], rank: int, max_rank: int | None, where: str) -> None:
    pattern = config.get("rank_pattern") or {}
    if not isinstance(pattern, Mapping) or not all(_positive_int(r) for r in pattern.values()):
        raise StoreError(f"{where}: rank_pattern must map module patterns to positive integers, got {pattern!r}")
    if max_rank is not None:
        for name, r in [("r", rank), *((f"rank_pattern[{k!r}]", v) for k, v in pattern.items())]:
            if r > max_rank:
                raise StoreError(
                    f"{where}: {name} = {r} exceeds the engine's maximum LoRA rank {max_rank}; "
                    "start the engine with a larger max_lora_rank (SGLang: --max-lora-rank)"
                )


def _check_targets_exist(targets: list[str] | str, names: Sequence[str], where: str) -> None:
    if targets == "all-linear":
        return
    wanted = [targets] if isinstance(targets, str) else targets
    missing = [t for t in wanted if not any(module_matches(n, t if isinstance(targets, str) else [t]) for n in names)]
    if missing:
        short = sorted({n.rsplit(".", 1)[-1] for n in names})
        shown = ", ".join(short[:16]) + (", ..." if len(short) > 16 else "")
        raise StoreError(
            f"{where}: target_modules {missing} not found among the base model's adaptable modules "
            f"({shown or 'none'}); the adapter was trained for another model (SGLang: --lora-target-modules)"
        )


# ----------------------------------------------------------------- tensors vs config


def _rank_for(module: str, config: Mapping[str, Any]) -> int:
    """``r``, or the ``rank_pattern`` entry matching ``module`` (PEFT's ``(.*\\.)?(pattern)$`` rule)."""
    for pattern, rank in (config.get("rank_pattern") or {}).items():
        if re.match(rf"(.*\.)?({pattern})$", module):
            return rank
    return config["r"]


def validate_adapter_tensors(
    shapes: Mapping[str, Sequence[int]], config: Mapping[str, Any], *, where: str = MODEL_FILE
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
    targets, keep = _target_modules(config, CONFIG_FILE), config.get("modules_to_save") or []
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


@dataclass(frozen=True)
class AdapterRules:
    """What an engine accepts; ``check`` validates a config and its tensors against it.

    Args:
        base_module_names: the base model's adaptable modules (``adaptable_module_names(model)``); None: unchecked.
        max_rank: the largest rank the engine serves; None: no limit.
        allow_dora: whether the engine serves DoRA adapters.
    """

    base_module_names: tuple[str, ...] | None = None
    max_rank: int | None = None
    allow_dora: bool = False

    @classmethod
    def for_model(cls, model: nn.Module, *, max_rank: int | None = None, allow_dora: bool = False) -> AdapterRules:
        """Rules for adapters of ``model`` (a transformers model, with or without LoRA layers injected)."""
        return cls(tuple(adaptable_module_names(model)), max_rank, allow_dora)

    def check(self, config: Mapping[str, Any], shapes: Mapping[str, Sequence[int]], where: str | None = None) -> None:
        """Validate config then tensors; ``where`` (a folder URI), when given, prefixes both file names in messages.

        Raises:
            StoreError: as ``validate_adapter_config`` and ``validate_adapter_tensors``.
        """
        prefix = "" if where is None else f"{where}/"
        validate_adapter_config(
            config,
            base_module_names=self.base_module_names,
            max_rank=self.max_rank,
            allow_dora=self.allow_dora,
            where=f"{prefix}{CONFIG_FILE}",
        )
        validate_adapter_tensors(shapes, config, where=f"{prefix}{MODEL_FILE}")

    def check_tensors(self, tensors: Mapping[str, Any], config: Mapping[str, Any], where: str | None = None) -> None:
        """``check_finite`` on the tensors, then ``check`` on the config and the tensors' shapes.

        Raises:
            StoreError: as ``check_finite`` and ``check``.
        """
        check_finite(tensors, f"{'' if where is None else f'{where}/'}{MODEL_FILE}")
        self.check(config, {k: list(t.shape) for k, t in tensors.items()}, where)
