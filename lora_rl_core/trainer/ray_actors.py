"""The FSDP2 trainer on Ray (`trainer.backend: ray`): one Ray actor per rank, in a placement group.

Same ranks as `workers.TrainerWorkers` (the spawned-process backend), other transport: each actor
joins the process group by `env://` (rank 0's node address and a free port there, so the ranks may sit on
several nodes of a Ray cluster), builds its shard with `build_sharded_trainer`, and runs the same commands
(`workers.COMMANDS`). A call goes to every rank at once (the collectives need them all); rank 0's
answer is returned. Ranks are gloo CPU actors (`trainer.device: cpu`, one CPU each) or one GPU each
(`cuda`, nccl).

Choices made here:

* Every call has a deadline; a rank that dies, raises or times out ends all ranks and raises
  `TrainerWorkerError` with the cause (as the process backend does). Actors are never restarted: a
  restarted rank would rejoin without its shard's optimizer state.
* Ray: one use of this process's connection (`lora_rl_core.ray_cluster`: `RAY_ADDRESS`, else a local
  Ray), given back by `close()`.
"""

from __future__ import annotations

import os
from typing import Any, NoReturn

from lora_rl_core import distributed
from lora_rl_core.ray_cluster import acquire_ray, release_ray
from lora_rl_core.trainer.plan import TrainerPlan
from lora_rl_core.trainer.workers import (
    COMMANDS,
    RankCommands,
    TrainerWorkerError,
    build_sharded_trainer,
    rank_device,
    rank_info,
)


class TrainerRank:
    """The body of one rank's actor."""

    def __init__(self, rank: int, plan: TrainerPlan, timeout_s: float) -> None:
        self.plan = plan  # as the run's plan made it (Ray pickles it), not validated again
        self.rank, self.world_size, self.timeout_s = rank, self.plan.world_size, timeout_s
        self.trainer: Any = None

    def address(self) -> tuple[str, int]:
        """This node's address and a free port on it (asked of rank 0: the rendezvous)."""
        import ray

        return ray.util.get_node_ip_address(), distributed.free_port()

    def setup(self, master_addr: str, master_port: int) -> dict[str, Any]:
        """Join the process group and build this rank's shard; `{"rank", "pid", "trainable_params"}`."""
        os.environ.update(
            MASTER_ADDR=master_addr, MASTER_PORT=str(master_port), RANK=str(self.rank), WORLD_SIZE=str(self.world_size)
        )
        device = rank_device(self.plan.device, 0, self.world_size)  # Ray sets CUDA_VISIBLE_DEVICES to our GPU
        distributed.init_process_group(device, timeout_s=self.timeout_s)
        self.trainer = build_sharded_trainer(self.plan, device=device)
        return rank_info(self.rank, self.trainer)

    def call(self, cmd: str, *args: Any) -> Any:
        """Run one command (`workers.COMMANDS`) on this rank."""
        return COMMANDS[cmd](self.trainer, *args)

    def close(self) -> None:
        """Finish a checkpoint write under way and leave the process group."""
        if self.trainer is not None:
            self.trainer.close()
        distributed.destroy_process_group()


class RayTrainer(RankCommands):
    """`world_size` FSDP2 ranks as Ray actors; the `Trainer` protocol (`RankCommands`), as `TrainerWorkers`.

    Args:
        plan: the trainer's plan: `world_size` ranks (actors) on `device` (`cpu`: gloo, one CPU per actor;
            `cuda`: nccl, `ray_gpus_per_rank` GPUs per actor), FSDP2's bf16 compute / fp32 reduction unless
            the LoRA computes in float32 (`TrainerPlan.mixed_precision`; ignored on CPU).
        timeout_s: deadline of each call and of each collective inside the ranks, seconds.
        start_timeout_s: deadline of the start (placement, model load, sharding), seconds.

    Raises:
        TrainerWorkerError: the ranks could not be placed or started (the cause is in the message).
    """

    def __init__(
        self,
        plan: TrainerPlan,
        *,
        timeout_s: float = 600.0,
        start_timeout_s: float = 900.0,
    ) -> None:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        world_size = plan.world_size
        super().__init__(world_size, timeout_s)
        acquire_ray()
        gpus = plan.ray_gpus_per_rank
        bundle = {"GPU": gpus, "CPU": 1.0} if gpus else {"CPU": 1.0}
        self._group = placement_group([bundle] * world_size, strategy="PACK")
        self._actors: list[Any] = []
        try:
            ray.get(self._group.ready(), timeout=start_timeout_s)
            rank_cls: Any = ray.remote(TrainerRank)  # Ray's stubs: untyped
            for rank in range(world_size):
                strategy = PlacementGroupSchedulingStrategy(
                    placement_group=self._group, placement_group_bundle_index=rank
                )
                options = {"num_cpus": 1, "num_gpus": gpus, "max_restarts": 0}
                actor = rank_cls.options(**options, scheduling_strategy=strategy)
                self._actors.append(actor.remote(rank, plan, timeout_s))
            addr, port = ray.get(self._actors[0].address.remote(), timeout=start_timeout_s)
            infos = self._gather([a.setup.remote(addr, port) for a in self._actors], "start", start_timeout_s)
        except TrainerWorkerError:
            raise
        except Exception as exc:  # placement timed out, Ray refused the actors
            self._fail(f"trainer ranks on Ray did not start: {type(exc).__name__}: {exc}")
        self.info: dict[str, Any] = infos[0]

    def close(self) -> None:
        """Leave the process group, kill the actors, free the placement group, give back the use of Ray
        (idempotent)."""
        if self._closed:
            return
        self._closed = True
        import ray
        from ray.util.placement_group import remove_placement_group

        try:
            ray.get([a.close.remote() for a in self._actors], timeout=30.0)
        except Exception:  # noqa: BLE001 - dead or stuck ranks are killed below
            pass
        for actor in self._actors:
            ray.kill(actor, no_restart=True)
        remove_placement_group(self._group)
        release_ray()

    # ------------------------------------------------------------------ plumbing
    def _call(self, cmd: str, *args: Any) -> list[Any]:
        if self._closed:
            raise TrainerWorkerError(f"cannot run {cmd!r}: the trainer ranks are closed")
        return self._gather([a.call.remote(cmd, *args) for a in self._actors], cmd, self.timeout_s)

    def _gather(self, refs: list[Any], what: str, timeout_s: float) -> list[Any]:
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

        try:
            return list(ray.get(refs, timeout=timeout_s))
        except GetTimeoutError:
            self._fail(f"trainer ranks on Ray timed out after {timeout_s:.0f} s in {what!r}")
        except RayActorError as exc:
            self._fail(f"a trainer rank on Ray died during {what!r}: {type(exc).__name__}")
        except RayTaskError as exc:
            self._fail(f"a trainer rank on Ray failed in {what!r}:\n{exc}")

    def _fail(self, message: str) -> NoReturn:
        self.close()
        raise TrainerWorkerError(f"{message}; all trainer ranks were shut down")
