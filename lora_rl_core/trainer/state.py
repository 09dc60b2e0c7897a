"""A trainer's checkpoint state (`PolicyTrainer.gather_state_dict` / `load_state_dict`): the policy's LoRA weights,
AdamW state, scheduler and every rank's torch RNG, and PPO's critic (its adapter, value head, AdamW state,
scheduler and pre-training progress) beside them.

The tensors are full (unsharded) and keyed by parameter name, so a state saved at one world size loads at any
other; the metadata is JSON (no pickle: the store is untrusted input). A run's checkpoints are written rank by
rank (`local_state`: each rank's part, the store puts the whole tensors together again on load,
`CheckpointStore.load`)."""

from __future__ import annotations

import copy
import json
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from lora_rl_core import distributed
from lora_rl_core.checkpoint import Piece

STATE_FORMAT = "lora-rl/policy-trainer-state/v1"


class Optimized(Protocol):
    """Parameters with their optimizer and scheduler: the policy's (`PolicyTrainer`) or the critic's (`Critic`)."""

    @property
    def param_names(self) -> list[str]: ...
    @property
    def params(self) -> Sequence[torch.Tensor]: ...
    @property
    def optimizer(self) -> torch.optim.Optimizer: ...
    @property
    def scheduler(self) -> torch.optim.lr_scheduler.LRScheduler: ...


class HasUpdates(Optimized, Protocol):
    """The critic: also the steps it has trained (what `critic.pretrain_steps` counts)."""

    updates: int


def gather_state(policy: Optimized, critic: HasUpdates | None, world_size: int) -> dict[str, Any] | None:
    """Everything needed to resume. Sharded: every rank must call it; rank 0 gets the result, other ranks None.

    Returns:
        `{"tensors": {name: tensor}, "meta": JSON-safe dict}`, full (unsharded) whatever the world size, so it
        saves as safetensors + JSON. The weights and moments are where they are, not copies: the caller copies
        them before the next step (`state_dict`: to the CPU; a rank: into shared memory). Tensor names:
        `params/<fqn>`, `optimizer/<fqn>/<key>` (AdamW `step`, `exp_avg`, `exp_avg_sq`), `rng/rank<r>/cpu`
        (and `/cuda`); with a critic also `critic/params/<fqn>` and `critic/optimizer/<fqn>/<key>` (its
        adapter and value head). Meta: format, param_names, param_groups (hyper-parameters, current lr),
        scheduler state, world_size; with a critic `critic` (the same for it, and `updates`).
    """
    tensors = _gather_tensors("", policy)
    if critic is not None:
        tensors.update(_gather_tensors("critic/", critic))
    rng_by_rank = distributed.gather_objects(_rng_state())
    if rng_by_rank is None:
        return None
    for r, rng in enumerate(rng_by_rank):
        tensors.update({f"rng/rank{r}/{k}": v for k, v in rng.items()})
    return {"tensors": tensors, "meta": _trainer_meta(policy, critic, world_size)}


def local_state(
    policy: Optimized, critic: HasUpdates | None, world_size: int
) -> tuple[dict[str, Piece], dict[str, Any] | None]:
    """This rank's part of `gather_state`'s result, copied to the CPU now (later steps do not change it), without
    communication (`distributed.local_part`): its shard of each sharded weight or AdamW moment, every N-th of
    those that are whole on every rank (the LoRA weights and moments: the N ranks share the writing), its own
    RNG, and on rank 0 the meta (other ranks: None). Keyed as `gather_state`.
    """
    rank, ranks = distributed.rank_and_world_size()
    pieces: dict[str, Piece] = {}
    named = _named_tensors("", policy) + (_named_tensors("critic/", critic) if critic is not None else [])
    for i, (key, value) in enumerate(named):  # the same order on every rank: the parameters' own
        part = distributed.local_part(value, rank, owner=i % ranks)
        if part is not None:
            pieces[key] = Piece(part[0].detach().to("cpu", copy=True), part[1], part[2])
    for kind, rng in _rng_state().items():  # each rank its own stream
        pieces[f"rng/rank{rank}/{kind}"] = Piece(rng.clone(), list(rng.shape), [0] * rng.dim())
    return pieces, (_trainer_meta(policy, critic, world_size) if rank == 0 else None)


def _trainer_meta(policy: Optimized, critic: HasUpdates | None, world_size: int) -> dict[str, Any]:
    meta: dict[str, Any] = {"format": STATE_FORMAT, **_meta(policy), "world_size": world_size}
    if critic is not None:
        meta["critic"] = {**_meta(critic), "updates": critic.updates}
    return meta


def load_state(policy: Optimized, critic: HasUpdates | None, state: dict[str, Any], rank: int) -> None:
    """Restore a `gather_state` result saved at any world size. Sharded: every rank passes the whole state.

    RNG: each rank restores its own saved stream when the checkpoint has one for its rank.

    Raises:
        ValueError: not a trainer state, or its parameters differ (another target set: their names; another
            LoRA rank: their shapes, naming the first), or it has no critic or another one.
    """
    tensors, meta = state["tensors"], state["meta"]
    if meta.get("format") != STATE_FORMAT:
        raise ValueError(f"not a trainer state: format {meta.get('format')!r}, expected {STATE_FORMAT!r}")
    _check(policy, tensors, meta, "", "model", "lora")
    saved = meta.get("critic")
    if critic is not None:  # both checked before any weight is copied
        if saved is None:
            raise ValueError(
                "the checkpoint has no critic state: it was written by a run without algorithm.advantage=gae; "
                "resume it with its own algorithm, or start a new run (another run.id)"
            )
        _check(critic, tensors, saved, "critic/", "critic", "critic.lora")
    _load(policy, tensors, meta, "")
    if critic is not None:
        _load(critic, tensors, saved, "critic/")
        critic.updates = int(saved["updates"])
    prefix = f"rng/rank{rank}/"
    _set_rng_state({k.removeprefix(prefix): v for k, v in tensors.items() if k.startswith(prefix)})


def _meta(parts: Optimized) -> dict[str, Any]:
    groups = [{k: v for k, v in g.items() if k != "params"} for g in parts.optimizer.param_groups]
    return {
        "param_names": parts.param_names,
        "param_groups": _json_safe(groups),
        "scheduler": _json_safe(parts.scheduler.state_dict()),
    }


def _check(
    parts: Optimized, tensors: dict[str, torch.Tensor], meta: dict[str, Any], prefix: str, what: str, section: str
) -> None:
    """The saved state fits `parts` (the `what`, set by the config's `section`): the same parameter names (another
    target set differs here), then the same shapes (another rank keeps the names).

    Raises:
        ValueError: naming the unknown and missing parameters, the first parameter the state lacks, or the first
            of another shape.
    """
    saved, ours = meta["param_names"], parts.param_names
    if saved != ours:
        mine, theirs = set(ours), set(saved)
        raise ValueError(
            f"trainer state does not fit this {what} ({section} differs from the run's): {len(theirs - mine)} unknown "
            "parameters "
            f"(e.g. {sorted(theirs - mine)[:2]}), {len(mine - theirs)} missing (e.g. {sorted(mine - theirs)[:2]})"
        )
    for name, p in zip(parts.param_names, parts.params, strict=True):
        saved_tensor = tensors.get(f"{prefix}params/{name}")
        if saved_tensor is None:  # its meta lists the parameter, but no rank's file held it
            raise ValueError(
                f"trainer state has no {prefix}params/{name}, which its meta lists: the checkpoint is incomplete; "
                "resume from an earlier one"
            )
        shape = saved_tensor.shape
        if shape != p.shape:  # a DTensor's shape is the whole parameter's, as saved
            raise ValueError(
                f"trainer state's {prefix}params/{name} is {list(shape)}, this {what}'s {list(p.shape)}: the "
                f"checkpoint was written with another {section}.rank; resume with the run's own config, or start a "
                "new run (another run.id)"
            )


def _named_tensors(prefix: str, parts: Optimized) -> list[tuple[str, torch.Tensor]]:
    """Each parameter and its AdamW state tensors, keyed `<prefix>params/<fqn>`, `<prefix>optimizer/<fqn>/<key>`."""
    out: list[tuple[str, torch.Tensor]] = []
    for name, p in zip(parts.param_names, parts.params, strict=True):
        state = sorted(parts.optimizer.state.get(p, {}).items())
        out += [(f"{prefix}params/{name}", p.detach())]
        out += [(f"{prefix}optimizer/{name}/{k}", v) for k, v in state if torch.is_tensor(v)]
    return out


def _gather_tensors(prefix: str, parts: Optimized) -> dict[str, torch.Tensor]:
    """Full parameters and optimizer state where they are, one tensor at a time (kept on rank 0 only)."""
    rank, _ = distributed.rank_and_world_size()
    out: dict[str, torch.Tensor] = {}
    for key, value in _named_tensors(prefix, parts):
        full = distributed.full_tensor(value)
        if rank == 0:
            out[key] = full.detach()
    return out


def _load(parts: Optimized, tensors: dict[str, torch.Tensor], meta: dict[str, Any], prefix: str) -> None:
    """Copy the saved weights, AdamW state (each tensor laid out like its parameter) and scheduler into `parts`."""
    for name, p in zip(parts.param_names, parts.params, strict=True):  # `_check`ed first
        distributed.copy_full_(p, tensors[f"{prefix}params/{name}"])
    groups = meta["param_groups"]
    if len(groups) != 1:
        raise ValueError(f"trainer state has {len(groups)} optimizer param groups, expected 1")
    index = {name: i for i, name in enumerate(parts.param_names)}
    state: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        if key.startswith(f"{prefix}optimizer/"):
            name, field = key.removeprefix(f"{prefix}optimizer/").rsplit("/", 1)
            i = index[name]
            state.setdefault(i, {})[field] = (
                value.clone() if value.dim() == 0 else distributed.shard_like(parts.params[i], value)
            )
    parts.optimizer.load_state_dict(
        {"state": state, "param_groups": [{**groups[0], "params": list(range(len(parts.params)))}]}
    )
    parts.scheduler.load_state_dict(copy.deepcopy(meta["scheduler"]))


def _rng_state() -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, torch.Tensor]) -> None:
    if "cpu" in state:
        torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _json_safe(value: Any) -> Any:
    """Round-trip through JSON (tuples become lists) so checkpoint metadata needs no pickle."""
    return json.loads(json.dumps(value, default=str))
