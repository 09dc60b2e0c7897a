"""Read an adapter's weights and config from wherever a caller names it: a PEFT folder (local path or fsspec
URI), a store version folder (`AdapterRef.uri`, sha256-verified through `AdapterStore`), or `store://SPEC`.

This is the store's side of reading adapters: `lora_rl_core.adapters` parses names and safetensors files and
knows nothing of the store; this module may build an `AdapterStore` for a version folder.
"""

from __future__ import annotations

import json
from typing import Any

import fsspec

from lora_rl_core.adapters import (
    CONFIG_FILE,
    MANIFEST_FILE,
    MODEL_FILE,
    STORE_URI_PREFIX,
    TensorsAndConfig,
    load_safetensors,
    parse_version_uri,
    refuse_pickles,
)
from lora_rl_core.errors import StoreError


def read_adapter_folder(path: str) -> TensorsAndConfig:
    """Read a PEFT adapter folder (local path or fsspec URI): safetensors weights and config.

    A store version folder (``<store>/<run>/adapters/vNNNNNN`` with a ``manifest.json``, ``AdapterRef.uri``)
    is read through the store, sha256-verified (``read_store_version``).

    Raises:
        StoreError: a file is missing, the config is not JSON, the weights are not safetensors, only a
            pickle checkpoint is offered, or a store version fails its checks.
    """
    fs, root = fsspec.core.url_to_fs(path)
    root = root.rstrip("/")
    if not fs.exists(f"{root}/{CONFIG_FILE}") and fs.exists(f"{root}/{MANIFEST_FILE}"):
        return read_store_version(path)
    if not fs.exists(f"{root}/{MODEL_FILE}") and fs.isdir(root):
        refuse_pickles((p.rsplit("/", 1)[-1] for p in fs.ls(root, detail=False)), path)
    try:
        config_bytes, model_bytes = fs.cat_file(f"{root}/{CONFIG_FILE}"), fs.cat_file(f"{root}/{MODEL_FILE}")
    except FileNotFoundError as exc:
        raise StoreError(
            f"{path}: missing {exc.filename or exc}: an adapter folder needs {CONFIG_FILE} and {MODEL_FILE}"
        ) from None
    try:
        config = json.loads(config_bytes)
    except ValueError as exc:
        raise StoreError(f"{path}/{CONFIG_FILE} is not valid JSON: {exc}") from None
    return load_safetensors(model_bytes, f"{path}/{MODEL_FILE}"), config


def read_store_version(uri: str) -> TensorsAndConfig:
    """Weights and config of a store version folder URI (``AdapterRef.uri``), through
    ``AdapterStore.load_tensors`` (sha256-verified, config and tensors checked).

    Raises:
        StoreError: ``uri`` is not ``<store>/<run>/adapters/vNNNNNN``, or the version fails the store's checks.
    """
    from lora_rl_core.store.adapter_store import AdapterStore  # lazy: the store's facade imports this module

    parsed = parse_version_uri(uri)
    if parsed is None:
        raise StoreError(
            f"{uri}: has a {MANIFEST_FILE} but is not a store version folder <store>/<run>/adapters/vNNNNNN"
        )
    root, run_id, version = parsed
    try:
        return AdapterStore(root).load_tensors(run_id, version)
    except StoreError as exc:
        raise StoreError(f"{uri}: {exc}") from None


def read_store_uri(store: Any, uri: str) -> TensorsAndConfig:
    """Weights and config of the version ``store://SPEC`` names (``AdapterStore.resolve`` specs), from ``store``
    (sha256-verified by the store).

    Raises:
        StoreError: no store given, a bad spec, or the version is missing or fails the store's checks.
    """
    if store is None:
        raise StoreError(f"{uri}: store URIs need an engine with a store (EmbeddedEngine(store=AdapterStore(...)))")
    try:
        ref = store.resolve(uri.removeprefix(STORE_URI_PREFIX))
        return store.load_tensors(ref.run_id, ref.version)
    except StoreError as exc:
        raise StoreError(f"{uri}: {exc}") from None
