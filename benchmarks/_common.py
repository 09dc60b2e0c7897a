"""Shared helpers of the engine benchmarks: random-weight models from a config, machine facts, table + JSON.

Imports only torch, transformers, rich and the standard library (no prefect, pydantic, gguf or s3fs), so the
benchmarks run on the GPU machine from a plain checkout: `PYTHONPATH=. python benchmarks/X.py ...`.
"""

from __future__ import annotations

import json
import os
import platform
import re
import sys
from dataclasses import dataclass
from datetime import UTC, datetime
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as package_version
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # run as a script from a checkout without installing the project

import torch  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

MODEL_CONFIGS = ROOT / "benchmarks" / "model_configs"  # published Qwen2.5 shapes (config.json copies)
RESULTS = ROOT / "benchmarks" / "results"
ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
TINY_CONFIG = {
    "model_type": "qwen2",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
    "max_position_embeddings": 1024,
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
"""A Qwen2-shaped model small enough for CPU smoke runs (`--tiny`)."""


@dataclass
class StubTokenizer:
    """What `EmbeddedEngine` reads from a tokenizer when it is given token ids: the pad and EOS ids."""

    pad_token_id: int
    eos_token_id: int | None


def model_config(path: Path | None, *, layers: int | None = None) -> dict[str, Any]:
    """A model config dict: the JSON at `path` (e.g. `MODEL_CONFIGS / "qwen2.5-0.5b.json"`), or `TINY_CONFIG`
    for None; `layers` truncates `num_hidden_layers` (a quicker CPU run of the same layer shapes)."""
    cfg = dict(TINY_CONFIG) if path is None else json.loads(Path(path).read_text())
    for key in ("architectures", "torch_dtype", "transformers_version"):
        cfg.pop(key, None)
    if layers is not None:
        cfg["num_hidden_layers"] = min(layers, cfg["num_hidden_layers"])
    return cfg


def random_model(cfg: dict[str, Any], *, device: str, dtype: torch.dtype, seed: int = 0) -> torch.nn.Module:
    """A random-weight causal LM of config `cfg`, built directly on `device` in `dtype`, in eval mode."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg), dtype=dtype)
    return model.eval()


def stub_tokenizer(cfg: dict[str, Any]) -> StubTokenizer:
    """Pad = BOS (or 0), EOS from the config."""
    eos = cfg.get("eos_token_id")
    return StubTokenizer(pad_token_id=cfg.get("bos_token_id") or 0, eos_token_id=eos if isinstance(eos, int) else None)


def resolve_device(device: str) -> str:
    """`auto` -> cuda when available, else cpu."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def default_dtype(device: str, name: str) -> torch.dtype:
    """`auto` -> bfloat16 on CUDA, float32 on CPU; else the named torch dtype."""
    if name == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    return getattr(torch, name)


def machine_info(device: str) -> dict[str, Any]:
    """Device name, CPU count, load, platform, Python and package versions."""
    name = torch.cuda.get_device_name(0) if device.startswith("cuda") else platform.processor() or "cpu"
    versions = {}
    for package in ("torch", "transformers", "peft", "safetensors", "liger-kernel"):
        try:
            versions[package] = package_version(package)
        except PackageNotFoundError:
            versions[package] = None
    return {
        "device": device,
        "device_name": name,
        "cpus": os.cpu_count(),
        "load_average_1m": os.getloadavg()[0],
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "versions": versions,
    }


def print_table(title: str, columns: list[str], rows: list[list[Any]]) -> None:
    """A rich table; floats are shown with 3 significant decimals."""
    table = Table(*columns, title=title)
    for row in rows:
        table.add_row(*[f"{v:.3f}" if isinstance(v, float) else str(v) for v in row])
    Console(width=max(Console().width, 160)).print(table)


def write_json(record: dict[str, Any], out: Path) -> None:
    """Write `record` (with a UTC `date` added first) as indented JSON to `out`."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    record = _no_machine_paths({"date": datetime.now(UTC).isoformat(timespec="seconds"), **record})
    out.write_text(json.dumps(record, indent=2, default=str) + "\n")
    print(f"wrote {out}")


_FOLDERS = re.compile(r"(?:(?<![\w.:/<>-])|(?<=file://))/(?:[^\s/'\"]+/)+")
"""The folders of an absolute path inside a string (a command line, a `file://` URI); not an HTTP URL's path,
nor a relative path's or a ratio's."""


def _no_machine_paths(value: Any) -> Any:
    """Absolute paths become their file names, so committed results name no machine's folders: a path on its
    own, and each path inside a string (an SGLang command line: `/opt/x/bin/python3 ... --model-path
    /tmp/models/m` -> `python3 ... --model-path m`)."""
    if isinstance(value, dict):
        return {k: _no_machine_paths(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_no_machine_paths(v) for v in value]
    if isinstance(value, Path) or (isinstance(value, str) and value.startswith("/") and "\n" not in value):
        return Path(value).name
    if isinstance(value, str):
        return _FOLDERS.sub("", value)
    return value
