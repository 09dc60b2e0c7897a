"""``AdapterVerifier``: read a version's files, verified end to end, into memory or a local PEFT folder.

Every file a manifest lists is checked against its size and sha256 (errors name the object's URI and
say the version is corrupt), then the safetensors headers are parsed (no pickle) and the config and
shapes checked against ``AdapterRules`` (the store is untrusted input). Files the manifest does not
name are never read. Left out: streaming (a version is read whole, capped at ``max_file_bytes`` a file).
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from lora_rl_core.adapters.io import load_safetensors, safetensors_shapes
from lora_rl_core.adapters.names import CONFIG_FILE, MANIFEST_FILE, MODEL_FILE, adapter_name
from lora_rl_core.adapters.validation import AdapterRules
from lora_rl_core.errors import StoreError
from lora_rl_core.store.io import StoreIO
from lora_rl_core.store.layout import StoreLayout, json_load, sha256_hex
from lora_rl_core.store.reader import VersionReader
from lora_rl_core.store.records import AdapterManifest

if TYPE_CHECKING:
    import torch


class AdapterVerifier:
    """Verifies, pulls and loads adapter versions; ``AdapterStore.verify``, ``pull`` and ``load_tensors`` document them.

    Args:
        io: the store's I/O; layout: its paths and size caps; reader: finds the manifests.
    """

    def __init__(self, io: StoreIO, layout: StoreLayout, reader: VersionReader):
        self._io = io
        self._layout = layout
        self._reader = reader

    def verified_files(self, run_id: str, version: int) -> tuple[AdapterManifest, dict[str, bytes]]:
        """The manifest and every file it lists (name -> bytes), each checked against its size and sha256.

        Raises:
            StoreError: missing version; a file that is over its cap, missing, truncated or fails its
                checksum (the message names its URI).
        """
        manifest = self._reader.manifest(run_id, version)
        files_dir = self._layout.files_dir(manifest)
        out = {}
        for name, entry in manifest.files.items():
            uri = self._io.uri(f"{files_dir}/{name}")
            self._layout.check_size(name, entry.size, uri)
            data = self._io.get(f"{files_dir}/{name}", self._layout.limit(name))
            if data is None:
                raise StoreError(f"{uri} is missing; adapter {run_id}@{version} is corrupt, publish a new version")
            if len(data) != entry.size:
                raise StoreError(
                    f"{uri} is {len(data)} bytes but its manifest says {entry.size} (truncated or replaced); "
                    f"adapter {run_id}@{version} is corrupt, publish a new version"
                )
            got = sha256_hex(data)
            if got != entry.sha256:
                raise StoreError(
                    f"{uri} fails its checksum: manifest sha256 {entry.sha256}, file sha256 {got}; "
                    f"adapter {run_id}@{version} is corrupt, publish a new version"
                )
            out[name] = data
        return manifest, out

    def checked_adapter(
        self, run_id: str, version: int, rules: AdapterRules | None = None
    ) -> tuple[AdapterManifest, dict[str, bytes], dict]:
        """Verified files plus checks of the weights' format and the config: ``(manifest, files, config)``.

        Raises:
            StoreError: as ``verified_files``; the manifest lacks the model or config file; malformed
                safetensors or config; an adapter that breaks ``rules`` (default: any LoRA, DoRA allowed).
        """
        manifest, files = self.verified_files(run_id, version)
        where = self._io.uri(self._layout.files_dir(manifest))
        if MODEL_FILE not in files or CONFIG_FILE not in files:
            raise StoreError(f"{where}: manifest must list {MODEL_FILE} and {CONFIG_FILE}")
        config = json_load(files[CONFIG_FILE], f"{where}/{CONFIG_FILE}")
        shapes = {}
        for name in files:
            if name.endswith(".safetensors"):
                shapes.update(safetensors_shapes(files[name], f"{where}/{name}"))
        (rules or AdapterRules(allow_dora=True)).check(config, shapes, where)
        return manifest, files, config

    def verify(self, run_id: str, version: int, *, rules: AdapterRules | None = None) -> AdapterManifest:
        """Download a version, check it end to end, keep nothing; returns its manifest.

        Raises:
            StoreError: as ``checked_adapter``.
        """
        return self.checked_adapter(run_id, version, rules)[0]

    def pull(self, run_id: str, version: int, dest: str | Path) -> Path:
        """Copy a version, verified, into local folder ``dest`` (renamed into place); returns ``dest`` absolute.

        Raises:
            StoreError: as ``checked_adapter``; ``dest`` is a symbolic link, or exists and is neither an
                empty folder nor this exact version.
        """
        dest = Path(dest).expanduser().absolute()
        if dest.is_symlink():
            raise StoreError(f"cannot pull into {dest}: it is a symbolic link; give a real folder")
        manifest, files, _ = self.checked_adapter(run_id, version)
        files[MANIFEST_FILE] = manifest.model_dump_json(indent=2).encode()
        if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
            if _same_pull(dest, files[MANIFEST_FILE]):
                return dest
            raise StoreError(
                f"cannot pull {adapter_name(run_id, version)} into {dest}: it exists and is not an empty folder"
            )
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
        try:
            for name, data in files.items():
                (tmp / name).write_bytes(data)
            if dest.exists():
                dest.rmdir()
            tmp.rename(dest)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return dest

    def load_tensors(
        self, run_id: str, version: int, *, rules: AdapterRules | None = None
    ) -> tuple[dict[str, torch.Tensor], dict]:
        """A version's weights (CPU tensors keyed as PEFT saves them) and config dict, verified.

        Raises:
            StoreError: as ``checked_adapter``.
        """
        manifest, files, config = self.checked_adapter(run_id, version, rules)
        where = self._io.uri(f"{self._layout.files_dir(manifest)}/{MODEL_FILE}")
        return load_safetensors(files[MODEL_FILE], where), config


def _same_pull(dest: Path, manifest_bytes: bytes) -> bool:
    """True if ``dest`` already holds the version whose manifest is ``manifest_bytes``."""
    path = dest / MANIFEST_FILE
    return path.is_file() and not path.is_symlink() and path.read_bytes() == manifest_bytes
