"""Loading a `RunConfig`: a YAML file plus dotted overrides, or a plain dict; every failure is one
`ConfigError` naming the field path (or the file and line) and the reason."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, get_args, get_origin

import yaml
from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails

from lora_rl_core.config.sections import RunConfig
from lora_rl_core.errors import ConfigError


def _kinds(annotation: Any) -> dict[str, type[BaseModel]] | type[BaseModel] | None:
    """What a field holds, for walking an error's location: a section class, the kinds of a `type`-keyed
    section (tag -> class), or None (a plain value)."""
    if get_origin(annotation) is list:
        (annotation,) = get_args(annotation) or (None,)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    members = [m for m in get_args(annotation) if isinstance(m, type) and issubclass(m, BaseModel)]
    if not members or any("type" not in m.model_fields for m in members):
        return None
    return {tag: m for m in members for tag in get_args(m.model_fields["type"].annotation)}


def _describe_error(e: ErrorDetails) -> str:
    """One pydantic error as `path: reason`, the path in config keys: a `type`-keyed section's kind, which
    pydantic puts in the location (`engine.embedded.launch`), is said in words instead
    (`engine.launch: not an option of engine.type embedded (an option of engine.type sglang)`)."""
    where: Any = RunConfig
    parts: list[str] = []
    kind: tuple[str, str, dict[str, type[BaseModel]]] | None = None
    for item in e["loc"]:
        if isinstance(where, dict) and item in where:
            kind = (".".join(parts), str(item), where)
            where = where[str(item)]
            continue
        if (
            isinstance(where, type)
            and issubclass(where, BaseModel)
            and isinstance(item, str)
            and item in where.model_fields
        ):
            where = _kinds(where.model_fields[item].annotation)
        elif not (isinstance(item, int) and isinstance(where, type)):  # a list index keeps the item's class
            where = None
        parts.append(str(item))
    if not parts:  # a rule across sections (RunConfig's validators): its message names the fields
        return str(e["msg"]).removeprefix("Value error, ")
    path = ".".join(parts)
    if kind is None:
        if e["type"] == "extra_forbidden":
            return f"{path}: unknown key (not a field of this section)"
        return f"{path}: {e['msg']} (got {e.get('input')!r})"
    section, tag, kinds = kind
    if e["type"] == "extra_forbidden":
        key = parts[-1]
        others = sorted({t for t, cls in kinds.items() if key in cls.model_fields and kinds[t] is not kinds[tag]})
        where_else = f"an option of {section}.type {' / '.join(others)}" if others else "unknown key"
        return f"{path}: not an option of {section}.type {tag} ({where_else})"
    return f"{path} ({section}.type {tag}): {e['msg']} (got {e.get('input')!r})"


def _format_validation_error(err: ValidationError, source: str) -> str:
    return f"invalid config {source}: " + "; ".join(_describe_error(e) for e in err.errors())


def _describe_yaml_error(exc: yaml.YAMLError) -> str:
    """PyYAML's error as one line with its 1-based line and column, e.g. `line 3, column 10: mapping values
    are not allowed here`, and where the construct it was parsing began, if it says."""
    problem = getattr(exc, "problem", None)
    mark = getattr(exc, "problem_mark", None)
    if not problem or mark is None:  # a plain YAMLError: its first line
        return (str(exc).splitlines() or [type(exc).__name__])[0]
    text = f"line {mark.line + 1}, column {mark.column + 1}: {problem}"
    context, context_mark = getattr(exc, "context", None), getattr(exc, "context_mark", None)
    if context and context_mark is not None:
        text += f" ({context} at line {context_mark.line + 1}, column {context_mark.column + 1})"
    elif context:
        text += f" ({context})"
    return text


def apply_override(data: dict[str, Any], override: str) -> None:
    """Set `a.b.c=value` in a nested dict in place; the value is parsed as YAML.

    Raises:
        ConfigError: the override has no `=` or an empty key.
    """
    key, sep, raw = override.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"bad override {override!r}: expected key=value, e.g. lora.rank=32")
    parts = key.strip().split(".")
    node = data
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if isinstance(child, str):  # a bare kind of a `type`-keyed section, e.g. `off_policy_correction: token-mask`
            child = node[part] = {"type": child}
        if not isinstance(child, dict):
            raise ConfigError(f"bad override {override!r}: {part} is not a section")
        node = child
    node[parts[-1]] = yaml.safe_load(raw) if raw.strip() else None


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """Load a `RunConfig` from a YAML file (optional) plus dotted overrides.

    Args:
        path: YAML file; None starts from the defaults.
        overrides: `key=value` strings applied in order.

    Raises:
        ConfigError: the file is missing or not a mapping, or a key/value is invalid;
            the message names the field path and the reason.
    """
    data: dict[str, Any] = {}
    source = "(defaults)"
    if path is not None:
        source = str(path)
        p = Path(path)
        if not p.is_file():
            raise ConfigError(
                f"config file not found: {p} (pass an existing YAML file, e.g. configs/smollm2-arith-grpo.yaml)"
            )
        try:
            loaded = yaml.safe_load(p.read_text())
        except yaml.YAMLError as exc:
            raise ConfigError(f"config {p} is not valid YAML: {_describe_yaml_error(exc)}") from exc
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"config {p} must be a mapping of sections, got {type(loaded).__name__}")
        data = loaded or {}
    for override in overrides:
        apply_override(data, override)
    reward = data.get("reward") or {}
    if path is not None and isinstance(reward, dict) and reward.get("files_dir") is None:
        # reward files are found beside the config file: set before validation, never on the validated config
        data["reward"] = {**reward, "files_dir": str(Path(path).resolve().parent)}
    return config_from_dict(data, source=source)


def config_from_dict(data: dict[str, Any], *, source: str = "(dict)") -> RunConfig:
    """Validate a plain dict as a `RunConfig` (ConfigError on failure)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("default")
            return RunConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_format_validation_error(exc, source)) from None
