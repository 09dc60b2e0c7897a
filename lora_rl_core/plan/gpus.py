"""Which GPU is which: the physical id of a process's CUDA device, and whether a launched SGLang shares the
trainer's GPU (the run's plan reads both; `lora_rl_core.plan.make`)."""

from __future__ import annotations

import os

import torch

from lora_rl_core.config import RunConfig, SGLangEngineConfig


def physical_gpu(device: torch.device, visible: str | None) -> str:
    """The physical GPU id a process's `device` is, given its `CUDA_VISIBLE_DEVICES` (None: all visible)."""
    index = device.index or 0
    ids = [v.strip() for v in visible.split(",")] if visible else None
    return ids[index] if ids and index < len(ids) else str(index)


def sglang_shares_trainer_gpu(cfg: RunConfig, trainer_device: torch.device) -> bool:
    """A launched SGLang (one server, tensor parallel 1) runs on the trainer's GPU: its first visible GPU
    (`engine.launch.env`'s `CUDA_VISIBLE_DEVICES`, else this process's) is the trainer's (FSDP ranks: any of
    `cuda:0 .. trainer.backend.world_size - 1`)."""
    e = cfg.engine
    if trainer_device.type != "cuda" or not isinstance(e, SGLangEngineConfig) or not e.launch.enabled or e.ray_replicas:
        return False
    ours = os.environ.get("CUDA_VISIBLE_DEVICES")
    server = physical_gpu(torch.device("cuda", 0), e.launch.env.get("CUDA_VISIBLE_DEVICES", ours))
    ranks = range(cfg.trainer.ranks()) if cfg.trainer.ranks() else [trainer_device.index or 0]
    return any(physical_gpu(torch.device("cuda", i), ours) == server for i in ranks)
