"""The config's building blocks: `Section` (the base of every section) and the allowed values of its choice
fields, each a `Literal` checked once, by pydantic, when a config is loaded."""

from __future__ import annotations

from typing import Any, Literal, get_args

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict

EngineKind = Literal["embedded", "server", "sglang"]
"""`engine.type`: each value is one entry of the engine registry (`lora_rl_core.engines.registry.ENGINE_KINDS`)."""
RemoteEngineKind = Literal["server", "sglang"]
REMOTE_ENGINE_KINDS: tuple[str, ...] = get_args(RemoteEngineKind)
"""The kinds that are HTTP clients of running servers (what `lora-rl subscribe` follows)."""
EvictionPolicy = Literal["lru", "fifo"]
EVICTION_POLICIES: tuple[str, ...] = get_args(EvictionPolicy)
"""Which resident adapter is evicted when the pool is full (SGLang `--lora-eviction-policy`)."""
TensorTransport = Literal["auto", "ipc", "inline", "file", "disk"]
TENSOR_TRANSPORTS: tuple[str, ...] = get_args(TensorTransport)
SGLangRetire = Literal["unload", "keep"]
SGLANG_RETIRE_POLICIES: tuple[str, ...] = get_args(SGLangRetire)
SGLangAbort = Literal["detach", "forward"]
IpcLayout = Literal["per-tensor", "packed", "host"]
IPC_LAYOUTS: tuple[str, ...] = get_args(IpcLayout)
TensorDtype = Literal["bfloat16", "float16", "float32", "keep"]
TENSOR_DTYPES: tuple[str, ...] = get_args(TensorDtype)
RolloutMode = Literal["sync", "async"]
SET_IN_CONFIG = "set in the config"
"""The reason the run's plan records for a setting that was not `auto` (`lora_rl_core.plan.Choice`)."""
SGLANG_DEFAULT_PORT = 30000
"""The port SGLang and `lora-rl serve` listen on unless told otherwise (SGLang's `--port` default)."""


class FrozenDict(dict[str, Any]):
    """A read-only `dict`: the config's mappings (`engine.launch.env`, `store.storage_options`), so that a
    validated config is never changed. Unlike `types.MappingProxyType` it pickles (to Ray actors and FSDP2
    ranks) and is a `dict` wherever one is read (`**options` into fsspec, `{**os.environ, **env}`).

    Raises:
        TypeError: on any change (`d[k] = v`, `update`, `pop`, ...): make a changed copy instead.
    """

    def _read_only(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError("a validated config's mapping is read-only: change a copy (dict(mapping), model_copy)")

    __setitem__ = __delitem__ = __ior__ = _read_only
    clear = pop = popitem = setdefault = update = _read_only

    def __reduce__(self) -> tuple[type[FrozenDict], tuple[dict[str, Any]]]:
        return type(self), (dict(self),)


def frozen_mapping(value: dict[str, Any]) -> FrozenDict:
    """The validator of a config mapping field: the validated dict, made read-only."""
    return FrozenDict(value)


ReadOnlyMapping = AfterValidator(frozen_mapping)
"""`Annotated[dict[str, X], ReadOnlyMapping]`: a config mapping field, validated as a dict, kept as a `FrozenDict`."""


class Section(BaseModel):
    """Base for config sections: unknown keys are errors, and a validated section is never changed (frozen; its
    lists are tuples; its mappings, `engine.launch.env` and `store.storage_options`, are `FrozenDict`s)."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)
    """Unknown keys are errors, a field cannot be assigned once validated (a changed copy is `model_copy`), and
    each field's attribute docstring is its `description` (in the JSON schema, for tooling;
    tests/unit/test_config_docs.py requires one)."""


def keyed_by_type(default: str) -> BeforeValidator:
    """The input rule of a `type`-keyed section (a union of `Section`s told apart by their `type` field,
    `Field(discriminator="type")`): a bare string is the `type` with that kind's defaults
    (`off_policy_correction: token-mask` = `{type: token-mask}`), and a mapping without `type` is of the
    `default` kind. Each kind has only its own fields, so an option of another kind is a validation error
    that `config.load` names with the kind (`engine.launch: not an option of engine.type embedded ...`)."""

    def fill(value: Any) -> Any:
        if isinstance(value, str):
            return {"type": value}
        if isinstance(value, dict) and "type" not in value:
            return {"type": default, **value}
        return value

    return BeforeValidator(fill)


def refuse_moved_keys(data: Any, section: str, moved: dict[str, tuple[str, str, str]]) -> None:
    """Refuse keys of `section` that moved into one of its `type`-keyed sections, naming the new place:
    `moved[key] = (sub-section, kind, field)` gives `trainer.world_size moved into trainer.backend: set
    trainer.backend={type: local, world_size: 2}`.

    Raises:
        ValueError: `data` (a section's raw input) has a moved key.
    """
    for key, (target, kind, field) in moved.items():
        if isinstance(data, dict) and key in data:
            raise ValueError(
                f"{section}.{key} moved into {section}.{target}: set {section}.{target}={{type: {kind}, "
                f"{field}: {data[key]}}} (or {section}.{target}.type={kind} {section}.{target}.{field}={data[key]})"
            )
