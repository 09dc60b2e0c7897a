"""Errors that lora-rl raises for bad input.

Every error names the field, file or object at fault and says how to fix it,
so the CLI can print it as one line (``lora-rl: error: <message>``) instead of
a traceback.
"""

from __future__ import annotations


class LoraRLError(Exception):
    """Base class: a user-facing error whose message is one clear line."""


class ConfigError(LoraRLError):
    """A run config is malformed: unknown key, bad value, bad override."""


class DataError(LoraRLError):
    """A dataset file is missing or a row is malformed."""


class ModelError(LoraRLError):
    """A model cannot be found, fetched or loaded."""


class RewardError(LoraRLError):
    """A reward function cannot be imported or returned a bad value."""


class StoreError(LoraRLError):
    """An adapter store object is missing, malformed or fails its checksum."""


class BackgroundWriteError(StoreError):
    """A version or checkpoint written to the store in the background failed (the message names it and the
    cause; what was stored before it is intact, and the run resumes from there)."""


class EngineError(LoraRLError):
    """An inference engine rejected a request (unknown adapter, bad params)."""


class EngineUnavailable(EngineError):
    """The engine could not be reached, or did not answer in time; the call may succeed later."""


class TrainerOutOfMemoryError(LoraRLError):
    """The trainer's update did not fit the GPU (the message names the batch's longest row, the micro-batch and
    the settings that lower the need); its gradients and cached CUDA blocks were given back first, so a
    colocated SGLang takes its KV cache back and the run stops with this error, every finished step kept in the
    store."""
