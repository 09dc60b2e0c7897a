"""The `placement` section: which GPUs the trainer and a launched SGLang use, keyed by `type`.

One setting uses every visible GPU: `colocated` puts FSDP2 trainer ranks and SGLang servers (one per GPU) on
the same GPUs (SGLang's KV cache is released while the trainer trains), `split` gives SGLang the first
`engine_gpus` and the trainer the rest (rollouts one step ahead: `rollout.mode: auto` is `async` there).
`auto` (the default) is one GPU as before on a one-GPU machine, and `split` on several (measured fastest for a
7B on two H100s: `lora_rl_core.plan.placement.AUTO_SEVERAL`); `manual` leaves the GPUs to `trainer.backend`,
`model.device` and `engine.launch.env`.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from lora_rl_core.config.base import Section, keyed_by_type


class AutoPlacement(Section):
    """`placement: auto` (the default): chosen by the run's plan from the visible GPUs and the settings
    (`lora_rl_core.plan.placement.resolve_placement`); settings that already place the run (a trainer
    backend with ranks, `engine.launch.env` with `CUDA_VISIBLE_DEVICES`, `model.device: cuda:N`) are kept."""

    type: Literal["auto"] = "auto"
    """The kind: the plan chooses."""


class ManualPlacement(Section):
    """`placement: manual`: the GPUs as `trainer.backend`, `model.device` and `engine.launch.env` say."""

    type: Literal["manual"] = "manual"
    """The kind: nothing is placed by the plan."""


class PlacedGPUs(Section):
    """What the placing kinds share: the GPUs the run uses and SGLang's tensor parallelism over them."""

    gpus: tuple[int, ...] | Literal["all"] = "all"
    """The GPUs (indices among this process's visible CUDA devices) the run uses; `all`: every visible one."""
    engine_tp: int | Literal["auto"] = "auto"
    """GPUs per SGLang server (tensor parallel, `--tp-size`): the engine GPUs form servers of this many each.
    `auto`: the smallest of 1, 2, 4, 8 that divides them and whose memory plan fits (a model whose copy does
    not fit one GPU beside the rest is split over several)."""

    @model_validator(mode="after")
    def _valid_gpus(self) -> PlacedGPUs:
        gpus, tp = self.gpus, self.engine_tp
        if isinstance(gpus, tuple) and (not gpus or len(set(gpus)) != len(gpus) or min(gpus) < 0):
            raise ValueError(f"placement.gpus must be distinct GPU indices >= 0 or `all`, got {gpus}")
        if isinstance(tp, int) and tp not in (1, 2, 4, 8):
            raise ValueError(f"placement.engine_tp must be 1, 2, 4, 8 or auto, got {tp}")
        return self


class ColocatedPlacement(PlacedGPUs):
    """`placement: colocated`: on each of `gpus`, one FSDP2 trainer rank (in this process with one GPU) and
    SGLang (a server per GPU, or per `engine_tp` GPUs; data parallel: a group's samples on one server), whose
    KV cache is released while the trainer trains (SGLang's memory saver) where the memory plan says it pays."""

    type: Literal["colocated"] = "colocated"
    """The kind: trainer and SGLang share every GPU."""


class SplitPlacement(PlacedGPUs):
    """`placement: split`: SGLang on the first `engine_gpus` of `gpus` (a server per GPU, or per `engine_tp`
    GPUs), the trainer on the rest (FSDP2 ranks, or in this process with one GPU); `rollout.mode: auto` is
    `async` here, so that rollouts run one step ahead while the trainer trains."""

    type: Literal["split"] = "split"
    """The kind: SGLang and the trainer on separate GPUs."""
    engine_gpus: int | Literal["auto"] = "auto"
    """GPUs for SGLang; the rest train. `auto`: half of `gpus`, rounded down, at least 1."""

    @model_validator(mode="after")
    def _engine_gpus(self) -> SplitPlacement:
        if isinstance(self.engine_gpus, int) and self.engine_gpus < 1:
            raise ValueError(f"placement.engine_gpus must be >= 1 or auto, got {self.engine_gpus}")
        return self


PlacementConfig = Annotated[
    AutoPlacement | ManualPlacement | ColocatedPlacement | SplitPlacement,
    Field(discriminator="type"),
    keyed_by_type("auto"),
]
"""`placement`, keyed by `type`; a bare kind (`placement=split`) takes that kind's defaults."""
