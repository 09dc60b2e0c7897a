"""Find a reward function by the name `reward.functions[*].name` gives: a built-in (`math`, `format`), an
importable `module.path:function`, or a file `path/to/file.py:function` (a relative path is taken from
`reward.files_dir`, which `load_config` sets to the config file's folder)."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lora_rl_core.errors import RewardError
from lora_rl_core.rewards.answers import AnswerFormat
from lora_rl_core.rewards.builtin import BUILTIN_REWARDS
from lora_rl_core.rewards.verify import MathVerifier


def load_reward_function(
    name: str, verifier: MathVerifier, files_dir: str | None = None, *, answer_format: AnswerFormat
) -> Callable[..., Any]:
    """The callable `name` names.

    Args:
        name: a key of `BUILTIN_REWARDS`, `module.path:function`, or `path/to/file.py:function`.
        verifier: given to the built-in `math` reward.
        files_dir: where a relative file path is found (`reward.files_dir`: the config file's folder); None =
            the working directory.
        answer_format: given to the built-in `math` reward (`reward.answer_format`, the one source of its
            default).

    Raises:
        RewardError: an unknown name, a module or file that cannot be imported, a missing attribute, or an
            object that is not callable.
    """
    if name in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[name](verifier, answer_format)
    target, sep, attr = name.rpartition(":")
    if not sep or not target or not attr:
        valid = ", ".join(sorted(BUILTIN_REWARDS))
        raise RewardError(
            f"unknown reward {name!r}; use one of: {valid}, 'module.path:function' or 'path/to/file.py:function'"
        )
    module = _module_from_file(target, name, files_dir) if target.endswith(".py") else _module(target, name)
    fn = getattr(module, attr, None)
    if fn is None:
        raise RewardError(f"reward {name!r}: {target} has no attribute {attr!r}")
    if not callable(fn):
        raise RewardError(
            f"reward {name!r} is a {type(fn).__name__}, not a function "
            "(prompts, completions, completion_ids, **columns) -> list[float | None]"
        )
    return fn


def _module(module_name: str, name: str) -> Any:
    try:
        return importlib.import_module(module_name)
    except Exception as err:  # noqa: BLE001 - any import-time failure is the user's module's fault
        raise RewardError(f"cannot import reward module {module_name!r} for {name!r}: {_one_line(err)}") from None


def _module_from_file(path_text: str, name: str, files_dir: str | None) -> Any:
    """Import a reward file under a name derived from its path (so two files named `rewards.py` differ)."""
    path = (Path(files_dir or ".") / Path(path_text).expanduser()).resolve()
    if not path.is_file():
        raise RewardError(
            f"reward {name!r}: file not found: {path} (a relative path is taken from the config's folder)"
        )
    module_name = f"lora_rl_user_rewards_{hashlib.sha1(str(path).encode()).hexdigest()[:12]}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise RewardError(f"reward {name!r}: cannot import {path} as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as err:  # noqa: BLE001
        del sys.modules[module_name]
        raise RewardError(f"cannot import reward file {path} for {name!r}: {_one_line(err)}") from None
    return module


def _one_line(err: BaseException) -> str:
    """``"ErrorType: first line of the message"`` for a one-line error report."""
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0]}" if lines else type(err).__name__
