"""What the adapter a request names is on this server: `RUN@latest`, `RUN@N` and `RUN@TAG` references.

A request (`/generate`'s `lora_path`, the OpenAI endpoints' `model`) names an adapter as today (`RUN-v000007`,
any loaded name, `store://RUN@VERSION`) or by a reference `RUN@SELECTOR`, parsed by the store's one parser
(`parse_adapter_spec`, as `lora-rl adapters pull RUN@latest`):

* `RUN@latest`: the newest version of RUN that the engine lists (registered and serving). With a subscriber
  following the run (`lora-rl subscribe`), that is its active version: a version is listed from its load
  and leaves only when retired. Never the store's newest: what this server does not serve, it does not name.
* `RUN@N`: version N, `RUN-v<N:06d>`; when it is not loaded and the server has a store that holds it,
  `store://RUN@N`, which the engine loads on first use (as any `store://` name).
* `RUN@TAG` (`RUN@best`): the version the store's tag points to now (read at each request), then as `RUN@N`.

The resolution is made once per HTTP call, just before its requests are submitted; the engine counts a
version in flight from then, and the subscriber never retires a version in flight (docs/HOTSWAP.md). An
unknown run, version or tag is HTTP 404 naming the reference and what is loaded; a malformed reference 400.
A plain name that is not loaded stays SGLang's 400 ("has never been loaded").
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from lora_rl_core.adapters import STORE_URI_PREFIX, adapter_name, parse_adapter_name, parse_adapter_spec
from lora_rl_core.engines.base import ServingEngine, unknown_adapter_message
from lora_rl_core.engines.serve.api import HTTPError
from lora_rl_core.errors import StoreError

LATEST = "latest"
NOT_FOUND = "model_not_found"
"""The `code` of a resolution error for a name that is not served (OpenAI's code for an unknown `model`)."""
BAD_NAME = "invalid_model"
"""The `code` of a resolution error for a malformed reference or one this server cannot resolve."""


def is_reference(name: str | None) -> bool:
    """Whether `name` is a reference `RUN@SELECTOR` (resolved by `AdapterNames`), not an adapter name."""
    return name is not None and "@" in name and not name.startswith(STORE_URI_PREFIX)


def loaded_versions(listed: Iterable[str]) -> dict[str, dict[int, str]]:
    """Run -> {version: adapter name} of the versioned names in `listed`."""
    runs: dict[str, dict[int, str]] = {}
    for name in listed:
        parsed = parse_adapter_name(name)
        if parsed is not None:
            runs.setdefault(parsed[0], {})[parsed[1]] = name
    return runs


def latest_aliases(listed: Iterable[str]) -> dict[str, str]:
    """`RUN@latest` -> the newest loaded version's name, for every run with a version in `listed`."""
    return {f"{run}@{LATEST}": names[max(names)] for run, names in sorted(loaded_versions(listed).items())}


class AdapterNames:
    """Resolves the adapters requests name into names the engine serves.

    Args:
        engine: the engine served; its `list_adapters()` says what is loaded.
        store: an `AdapterStore` for tags and for versions loaded on demand; None = neither.
    """

    def __init__(self, engine: ServingEngine, *, store: Any = None) -> None:
        self.engine = engine
        self.store = store

    def resolve(self, names: Sequence[str | None]) -> list[str | None]:
        """Each name as the engine takes it (a blocking call: it lists the engine's adapters once and may
        read the store): None stays the base model, a reference becomes a loaded name or `store://RUN@N`,
        `store://` names pass as they are, other names must be loaded.

        Raises:
            HTTPError: 404 for a reference to an unknown run, version or tag; 400 for a malformed reference,
                a tag on a server without a store, or a plain name that is not loaded (SGLang's message).
        """
        if all(name is None for name in names):
            return list(names)  # the base model alone: nothing to list
        listed = list(self.engine.list_adapters())
        done: dict[str | None, str | None] = {None: None}
        for name in names:
            if name not in done:
                done[name] = self._one(name, listed) if name is not None else None
        return [done[name] for name in names]

    def _one(self, name: str, listed: list[str]) -> str:
        if not is_reference(name):
            if name.startswith(STORE_URI_PREFIX) or name in listed:
                return name
            raise HTTPError(400, unknown_adapter_message(name, listed), code=NOT_FOUND)
        try:
            run_id, selector = parse_adapter_spec(name)
        except StoreError as exc:
            raise HTTPError(400, str(exc), code=BAD_NAME) from None
        loaded = loaded_versions(listed).get(run_id, {})
        if selector is None:
            if not loaded:
                raise HTTPError(404, f"{name}: {self._no_version(run_id, listed)}", code=NOT_FOUND)
            return loaded[max(loaded)]
        version = selector if isinstance(selector, int) else self._tag(name, run_id, selector)
        return loaded.get(version) or self._from_store(name, run_id, version, listed)

    def _tag(self, name: str, run_id: str, tag: str) -> int:
        if self.store is None:
            raise HTTPError(400, f"{name}: tags live in the adapter store and this server has none", code=BAD_NAME)
        try:
            return int(self.store.tag_version(run_id, tag))
        except StoreError as exc:
            raise HTTPError(404, f"{name}: {exc}", code=NOT_FOUND) from None

    def _from_store(self, name: str, run_id: str, version: int, listed: list[str]) -> str:
        """`store://RUN@N` when the store holds version N (the engine loads it on first use)."""
        wanted = adapter_name(run_id, version)
        if self.store is None:
            message = f"{name}: {wanted} is not loaded on this server (and it has no store to load it from); "
            raise HTTPError(404, message + self._no_version(run_id, listed, any_loaded=True), code=NOT_FOUND)
        try:
            self.store.manifest(run_id, version)
        except StoreError as exc:
            message = f"{name}: {wanted} is not loaded on this server, nor in its store: {exc}"
            raise HTTPError(404, message, code=NOT_FOUND) from None
        return f"{STORE_URI_PREFIX}{run_id}@{version}"

    @staticmethod
    def _no_version(run_id: str, listed: list[str], any_loaded: bool = False) -> str:
        versions = loaded_versions(listed)
        mine = sorted(versions.get(run_id, {}).values())
        if any_loaded and mine:
            return f"loaded versions of {run_id}: {mine}"
        return (
            f"no version of run {run_id!r} is loaded on this server (loaded runs: {sorted(versions) or 'none'}; "
            f"loaded adapters: {sorted(listed) or 'none'}); `lora-rl subscribe --run {run_id}` keeps one loaded"
        )
