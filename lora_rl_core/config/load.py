"""Loading a `RunConfig`: a YAML file plus dotted overrides, or a plain dict; every failure is one
`ConfigError` naming the field path (or the file and line) and the reason."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from lora_rl_core.config.sections import RunConfig
from lora_rl_core.errors import ConfigError


def _format_validation_error(err: ValidationError, source: str) -> str:
    parts = []
    for e in err.errors():
        path = ".".join(str(p) for p in e["loc"]) or "<root>"
        msg = "unknown key (not a field of this section)" if e["type"] == "extra_forbidden" else e["msg"]
        shown = "" if e["type"] == "extra_forbidden" else f" (got {e.get('input')!r})"
        parts.append(f"{path}: {msg}{shown}")
    return f"invalid config {source}: " + "; ".join(parts)


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
    cfg = config_from_dict(data, source=source)
    if path is not None and cfg.reward.files_dir is None:  # reward files are found beside the config file
        cfg.reward.files_dir = str(Path(path).resolve().parent)
    return cfg


def config_from_dict(data: dict[str, Any], *, source: str = "(dict)") -> RunConfig:
    """Validate a plain dict as a `RunConfig` (ConfigError on failure)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("default")
            return RunConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_format_validation_error(exc, source)) from None
