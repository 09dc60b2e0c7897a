"""Adapter store: versioned LoRA adapters in an fsspec object store (``file://``, ``s3://``, ``memory://``).

Layout (docs/DESIGN.md, "Object store layout")::

    <store>/<run_id>/run.json                                  config snapshot
    <store>/<run_id>/adapters/v000007/manifest.json            created LAST, exclusively
    <store>/<run_id>/adapters/v000007/<data_dir>/adapter_model.safetensors
                                                /adapter_config.json   (a PEFT folder)
    <store>/<run_id>/adapters/LATEST                           {"version": 7}, a hint
    <store>/<run_id>/tags/best.json                            {"version": 7, ...}

Publish protocol (atomic visibility without rename, racing writers):

1. If the version's manifest exists: identical files return its ref (retried
   tasks are idempotent), different files raise (versions are immutable).
2. Write the files into a data folder unique to this attempt,
   ``<sha256[:12] of the weights>-<random 12 hex>``. Two writers never write
   the same object, so nothing can interleave, and an object store needs no rename.
3. Create ``manifest.json`` only if absent (S3 ``If-None-Match: *`` through
   s3fs ``pipe_file(mode="create")``; ``os.link`` of a complete temp file on a
   local disk) and read it back. The manifest names the data folder and the
   sha256 and size of each file. The one writer whose manifest landed wins; a
   loser with the same weights gets the winner's ref, a loser with other
   weights gets a ``StoreError`` ("lost the race ...") and deletes its folder.
4. Update ``LATEST`` (best effort; ``latest()`` never trusts it).

A version exists iff its manifest exists, and readers only ever read files a
manifest names, so a writer killed mid-upload leaves an invisible folder and
a re-publish of the version simply uses a new one. ``gc`` removes such
leftovers inside complete versions.

Integrity and untrusted input: every read checks each file's size and sha256
against the manifest (errors name the object's URI), parses the safetensors
header (weights are safetensors only: no pickle), and validates the config and
tensor shapes (``lora_rl_core.adapters``). Run ids, versions, tags,
manifest file names and data folders are checked before they become paths;
files over ``max_file_bytes`` and symbolic links (local stores, ``publish_folder``
input, pull destinations) are refused.

Faults: transient store errors (5xx, 429, throttling, timeouts, dropped
connections) are retried with exponential backoff and jitter; permanent ones
raise ``StoreError`` at once. A publish that fails leaves no manifest, so a
retry simply publishes again. ``publish`` is ``write(prepare(...))``: ``prepare``
checks and serialises in memory (the ref is known then), ``write`` does the store
half, so a trainer can run it on a background thread (``lora_rl_core.run.writer``).

Modules: ``adapter_store`` (``AdapterStore``, the one object callers use) owns its parts, which share
its ``StoreIO`` (``io``) and ``StoreLayout`` (``layout``: paths, size caps, JSON): ``reader``
(runs, versions, manifests, refs, specs), ``publish`` (the protocol above), ``verify`` (verify, pull,
load_tensors), ``tags`` and ``retention`` (``gc``); ``records`` holds the records and ``plan_retention``.

Left out: deleting leftover data folders of versions that never completed
(they may belong to a publish still in flight; delete them by hand if a version
number is abandoned); locking between ``gc`` and readers of the versions it
deletes (gc never deletes the newest or a tagged version).
"""

from lora_rl_core.adapters.names import (  # the naming rules live in lora_rl_core.adapters; re-exported as store API
    CONFIG_FILE,
    LATEST_FILE,
    MANIFEST_FILE,
    MODEL_FILE,
    PICKLE_SUFFIXES,
    RUN_CONFIG_FILE,
    adapter_name,
    parse_adapter_spec,
    validate_run_id,
    validate_tag,
    validate_version,
)
from lora_rl_core.store.adapter_store import AdapterStore
from lora_rl_core.store.io import RetryPolicy, is_transient
from lora_rl_core.store.layout import DEFAULT_MAX_FILE_BYTES, MAX_JSON_BYTES
from lora_rl_core.store.publish import PreparedVersion
from lora_rl_core.store.records import AdapterManifest, AdapterRef, FileEntry, RetentionPolicy, plan_retention

__all__ = [
    "CONFIG_FILE",
    "DEFAULT_MAX_FILE_BYTES",
    "LATEST_FILE",
    "MANIFEST_FILE",
    "MAX_JSON_BYTES",
    "MODEL_FILE",
    "PICKLE_SUFFIXES",
    "RUN_CONFIG_FILE",
    "AdapterManifest",
    "AdapterRef",
    "AdapterStore",
    "FileEntry",
    "PreparedVersion",
    "RetentionPolicy",
    "RetryPolicy",
    "adapter_name",
    "is_transient",
    "parse_adapter_spec",
    "plan_retention",
    "validate_run_id",
    "validate_tag",
    "validate_version",
]
