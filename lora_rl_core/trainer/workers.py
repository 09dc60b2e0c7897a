"""Persistent FSDP2 trainer processes: load the model once, then serve training steps until closed.

`TrainerWorkers(plan)` starts `plan.world_size` processes
(`torch.multiprocessing`, spawn context). Each joins one process group (gloo on
CPU, nccl on CUDA, 127.0.0.1 and a free port), loads the base model, applies
LoRA after `torch.manual_seed(plan.seed)` (so every rank, and a single
process, starts from the same adapter), shards it with FSDP2
(`distributed.shard_model`) and builds a `PolicyTrainer`. The parent then sends
commands over one `Pipe` per rank: every rank gets the same command, rank 0's
answer is returned (metrics are already global; gathered tensors live on rank 0).

The same ranks run as Ray actors with `trainer.backend: ray` (`lora_rl_core/trainer/ray_actors.py`, same
`COMMANDS`). These spawned processes stay the default for `world_size` >= 1 on one machine: no Ray runtime
to start (seconds on 2 cores), and nothing beyond torch is needed.

Wire format: commands and results are small picklable objects (`TrainBatch` of
int/float lists, metric dicts); tensors (adapter, checkpoint) travel packed
(`PackedTensors`): copied into one flat shared-memory buffer per dtype, which
crosses the pipe as a file descriptor (torch's `file_descriptor` sharing: the
segment is unlinked at once, so a killed worker leaks none), with their names,
shapes and offsets; the receiver copies each tensor out of it. Measured on a
2-core CPU (`benchmarks/rank_transfer.py`): a 7B adapter (161 MB) 0.18 s
against 0.59 s as safetensors bytes through the pipe, a 32B checkpoint's state
(1.6 GB) 2.4 s against 9.8 s. A handful of buffers, not one per tensor, so thousands of
tensors need no more file descriptors. Where /dev/shm has no room (a container's
default is 64 MB) they travel as safetensors bytes, as before.

Failure: every call has a timeout. When a worker dies, times out or raises, the
call raises `TrainerWorkerError` (naming the rank, exit code or traceback) and
all workers are shut down, because the survivors may be stuck in a collective;
build new workers and load the last checkpoint. `close()` asks the workers to
leave the process group, then terminates and kills stragglers; it also runs at
interpreter exit (atexit), and the class is a context manager. Workers ignore
SIGINT (Ctrl-C reaches the parent, which closes them) and exit when the
parent's end of their pipe closes. As with any spawn-based code, a script that
builds workers must guard its entry point with `if __name__ == "__main__":`.
"""

from __future__ import annotations

import atexit
import contextlib
import math
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any, NoReturn, Self

import torch
import torch.multiprocessing as mp  # also registers torch's shared-memory pickling of tensors (PackedTensors)
from safetensors.torch import load as load_tensors
from transformers.utils import logging as hf_logging

from lora_rl_core import distributed
from lora_rl_core.adapters.io import safetensors_bytes
from lora_rl_core.checkpoint import CheckpointTarget, ShardReport
from lora_rl_core.errors import LoraRLError
from lora_rl_core.records import TrainBatch
from lora_rl_core.runtime import cpu_threads
from lora_rl_core.trainer.build import policy_model
from lora_rl_core.trainer.plan import TrainerPlan
from lora_rl_core.trainer.policy import PolicyTrainer


@dataclass(frozen=True)
class PackedTensors:
    """Named CPU tensors in one flat shared-memory buffer per dtype, to cross a process boundary cheaply.

    Where /dev/shm has no room for them (a container's is often 64 MB, and writing past a full tmpfs kills
    the process with SIGBUS) they travel as safetensors bytes instead (`blob`).

    Attributes:
        buffers: one 1-D tensor per dtype (by dtype name), in shared memory.
        index: `(name, dtype name, shape, offset)` per tensor, in the original order; offset in elements.
        blob: the tensors as safetensors bytes where shared memory had no room (then no buffers).
    """

    buffers: dict[str, torch.Tensor]
    index: tuple[tuple[str, str, tuple[int, ...], int], ...]
    blob: bytes | None = None

    @classmethod
    def pack(cls, tensors: dict[str, torch.Tensor], *, shared: bool = True) -> PackedTensors:
        """Copy `tensors` (any device; each read once) into fresh shared-memory buffers, or into safetensors
        bytes where /dev/shm has no room for them (`shared_memory_room`) or `shared` is False (Ray pickles what
        its actors return itself: a shared-memory buffer would only add a copy beside its object store)."""
        need = sum(t.numel() * t.element_size() for t in tensors.values())
        if not shared or need > shared_memory_room():
            return cls({}, (), safetensors_bytes(tensors, metadata=None))
        sizes: dict[str, int] = {}
        index = []
        for name, t in tensors.items():
            dtype = str(t.dtype).removeprefix("torch.")
            index.append((name, dtype, tuple(t.shape), sizes.get(dtype, 0)))
            sizes[dtype] = sizes.get(dtype, 0) + t.numel()
        buffers = {d: torch.empty(n, dtype=getattr(torch, d)).share_memory_() for d, n in sizes.items()}
        with torch.no_grad():
            for (_, dtype, _, offset), t in zip(index, tensors.values(), strict=True):
                buffers[dtype][offset : offset + t.numel()].copy_(t.reshape(-1))
        return cls(buffers, tuple(index))

    def unpack(self) -> dict[str, torch.Tensor]:
        """The tensors by name, each a copy with its own storage (views of one buffer would be shared tensors to
        safetensors, which refuses to save them, and `torch.set_rng_state` reads a view's storage from its
        start)."""
        if self.blob is not None:
            return load_tensors(self.blob)
        return {
            name: self.buffers[dtype][offset : offset + math.prod(shape)].view(shape).clone()
            for name, dtype, shape, offset in self.index
        }


def shared_memory_room(margin: float = 0.5) -> int:
    """Bytes a new shared-memory buffer may take: `margin` of what /dev/shm has free (others use it too); 0
    where there is no /dev/shm."""
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return 0
    return int(st.f_bavail * st.f_frsize * margin)


class TrainerWorkerError(LoraRLError):
    """A trainer worker died, timed out or raised; the workers have been shut down."""


def build_sharded_trainer(plan: TrainerPlan, *, device: torch.device) -> PolicyTrainer:
    """Load the model, apply seeded LoRA, shard it with FSDP2 and wrap it in a `PolicyTrainer`.

    Call on every rank after `distributed.init_process_group` (also under torchrun). Activation
    checkpointing (the plan's `gradient_checkpointing`) is applied per decoder layer by `shard_model`; FSDP2's
    bfloat16 mixed precision follows the plan's LoRA compute dtype (`TrainerPlan.mixed_precision`).
    """
    # on a GPU the weights load to host memory and each layer moves to the GPU as it is sharded: a rank never
    # holds the whole model, so a model larger than one GPU's share loads (and a launched SGLang beside it keeps
    # the memory the plan gave it)
    peft_model, pad_id = policy_model(plan, device="cpu" if device.type == "cuda" else device, seed=plan.seed)
    distributed.shard_model(
        peft_model,
        mixed_precision=plan.mixed_precision,
        activation_checkpointing=plan.gradient_checkpointing,
        device=device,
        shard_weights=plan.shard_weights,
    )
    return PolicyTrainer(peft_model, plan, pad_id=pad_id)


def rank_device(kind: str, cuda_index: int, world_size: int) -> torch.device:
    """The device one of `world_size` ranks trains on, made current: `cuda:<cuda_index>`, or the CPU with
    torch limited to its share of the usable cores (no oversubscription). Used by both rank backends."""
    if kind == "cuda":
        torch.cuda.set_device(cuda_index)
        return torch.device("cuda", cuda_index)
    torch.set_num_threads(max(1, cpu_threads() // world_size))
    return torch.device("cpu")


class RankCommands:
    """The `Trainer` protocol over ranks that run `COMMANDS`: a subclass sends one command to every rank
    (`_call`, the answers by rank) and rank 0's answer is used. Tensors cross packed (`PackedTensors`).

    Args:
        world_size: ranks, >= 1.
        timeout_s: deadline of each call, seconds.

    Raises:
        ValueError: `world_size` < 1.
    """

    shared_memory = False
    """Tensors cross in shared memory (`PackedTensors`): for ranks that are this host's own processes."""

    def __init__(self, world_size: int, timeout_s: float) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size, self.timeout_s = world_size, timeout_s
        self._closed = False

    def _call(self, cmd: str, *args: Any) -> list[Any]:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """One `PolicyTrainer.train_step` over the whole batch, rows shared across ranks; global metrics."""
        return self._call("train_step", batch)[0]

    def profiled_train_step(self, batch: TrainBatch, row_limit: int = 25) -> tuple[dict[str, float], str]:
        """`train_step` with every rank under `torch.profiler`: the metrics and the ranks' reports, rank by rank
        (`PolicyTrainer.profiled_train_step`)."""
        answers = self._call("profiled_train_step", batch, row_limit)
        return answers[0][0], "\n\n".join(report for _, report in answers)

    def adapter_state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """The full adapter (PEFT keys, float32 CPU tensors) and its JSON-safe PEFT config, as `lora.adapter_state`."""
        packed, config = self._call("adapter_state", self.shared_memory)[0]
        return packed.unpack(), config

    def state_dict(self) -> dict[str, Any]:
        """The trainer checkpoint (`PolicyTrainer.state_dict` format: full tensors + JSON meta, any world size)."""
        packed, meta = self._call("state_dict", self.shared_memory)[0]
        return {"tensors": packed.unpack(), "meta": meta}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a checkpoint from `state_dict()` (of any world size, or an in-process `PolicyTrainer`)."""
        self._call("load_state_dict", PackedTensors.pack(state["tensors"], shared=self.shared_memory), state["meta"])

    def save_checkpoint(self, target: CheckpointTarget) -> None:
        """Every rank snapshots its part of the state and writes it to the store in the background
        (`PolicyTrainer.save_checkpoint`); nothing crosses to this process."""
        self._call("save_checkpoint", target)

    def written_checkpoints(self, wait: bool = False) -> list[ShardReport]:
        """The ranks' checkpoint writes that ended since the last call, every rank's (`wait`: all, waited for)."""
        return [report for answer in self._call("written_checkpoints", wait) for report in answer]


class TrainerWorkers(RankCommands):
    """`world_size` persistent processes training one FSDP2-sharded LoRA policy.

    Args:
        plan: the trainer's plan: `world_size` processes (one GPU each on CUDA) on `device` (`cpu`: gloo;
            `cuda`: nccl, rank r uses `cuda:r` of the visible devices), FSDP2's bf16 compute / fp32 reduction
            unless the LoRA computes in float32 (`TrainerPlan.mixed_precision`; ignored on CPU).
        timeout_s: limit for each call, and for each collective inside the workers.
        start_timeout_s: limit for start-up (model load and sharding).

    Raises:
        TrainerWorkerError: a worker failed to start (its traceback is in the message).
    """

    shared_memory = True  # the ranks are this host's own processes: tensors cross as shared memory

    def __init__(
        self,
        plan: TrainerPlan,
        *,
        timeout_s: float = 600.0,
        start_timeout_s: float = 900.0,
    ) -> None:
        world_size = plan.world_size
        super().__init__(world_size, timeout_s)
        needed = max(plan.gpus, default=world_size - 1) + 1
        if plan.device == "cuda" and torch.cuda.device_count() < needed:
            raise ValueError(f"world_size {world_size} needs {needed} GPUs, {torch.cuda.device_count()} visible")
        self._conns: list[Connection] = []
        self._procs: list[Any] = []
        atexit.register(self.close)
        spec = _WorkerSpec(plan, distributed.free_port(), timeout_s)  # pickled to the ranks as made
        ctx = mp.get_context("spawn")
        for rank in range(world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=_worker_main, args=(rank, spec, child), name=f"lora-rl-trainer-{rank}", daemon=True
            )
            proc.start()
            child.close()
            self._conns.append(parent)
            self._procs.append(proc)
        self.info: dict[str, Any] = self._collect("start", start_timeout_s)[0]

    # ------------------------------------------------------------------ commands
    @property
    def pids(self) -> list[int]:
        """Process ids of the workers, by rank."""
        return [p.pid for p in self._procs]

    # ------------------------------------------------------------------ lifecycle
    def close(self, *, graceful: bool = True, grace_s: float = 10.0) -> None:
        """Stop the workers (idempotent): ask them to leave the process group, then terminate and kill stragglers."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        if graceful:
            for conn in self._conns:
                with contextlib.suppress(OSError):
                    conn.send(("close", ()))
        deadline = time.monotonic() + (grace_s if graceful else 0.0)
        for proc in self._procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self._procs:
            if proc.is_alive():
                proc.terminate()
        for proc in self._procs:
            proc.join(5.0)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self._conns:
            conn.close()

    # ------------------------------------------------------------------ plumbing
    def _call(self, cmd: str, *args: Any) -> list[Any]:
        """Send one command to every rank; the answers by rank."""
        if self._closed:
            raise TrainerWorkerError(f"cannot run {cmd!r}: the trainer workers are closed")
        for rank, conn in enumerate(self._conns):
            try:
                conn.send((cmd, args))
            except OSError as exc:
                self._fail(f"cannot send {cmd!r} to trainer worker rank {rank}: {exc}")
        return self._collect(cmd, self.timeout_s)

    def _collect(self, cmd: str, timeout_s: float) -> list[Any]:
        """Wait for every rank's answer to `cmd`; fail fast when a worker dies, raises or the time runs out."""
        results: list[Any] = [None] * self.world_size
        pending = set(range(self.world_size))
        deadline = time.monotonic() + timeout_s
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self._fail(f"trainer workers timed out after {timeout_s:.0f} s in {cmd!r}: ranks {sorted(pending)}")
            ready = wait([self._conns[r] for r in pending] + [p.sentinel for p in self._procs], remaining)
            for rank in sorted(pending):
                if self._conns[rank] in ready:
                    results[rank] = self._receive(rank, cmd)
                    pending.discard(rank)
            if pending and self._dead_workers():
                self._fail(f"a trainer worker died during {cmd!r}")
        return results

    def _receive(self, rank: int, cmd: str) -> Any:
        try:
            status, value = self._conns[rank].recv()
        except (EOFError, OSError):
            self._procs[rank].join(1.0)
            self._fail(f"trainer worker rank {rank} closed its pipe during {cmd!r}")
        if status == "error":
            self._fail(f"trainer worker rank {rank} failed in {cmd!r}:\n{value}")
        return value

    def _dead_workers(self) -> str:
        return ", ".join(
            f"rank {r} (pid {p.pid}) died with exit code {p.exitcode}"
            for r, p in enumerate(self._procs)
            if p.exitcode is not None
        )

    def _fail(self, message: str) -> NoReturn:
        deadline = time.monotonic() + 0.5  # a peer's error often races its cause: let a dying worker finish dying
        for proc in self._procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        dead = self._dead_workers()
        self.close(graceful=False)
        raise TrainerWorkerError(f"{message}{f' [{dead}]' if dead else ''}; all trainer workers were shut down")


# ---------------------------------------------------------------------- worker side
@dataclass(frozen=True)
class _WorkerSpec:
    plan: TrainerPlan
    port: int
    timeout_s: float


def _worker_main(rank: int, spec: _WorkerSpec, conn: Connection) -> None:
    """Entry point of a worker process: set up, report, then serve commands until `close` or the parent is gone."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sys.excepthook = _parent_gone_quietly
    # No weight-loading progress bars: the parent shows its own, and tqdm's multiprocessing lock would be
    # a named semaphore that `_exit` leaves behind (the resource tracker then warns "leaked semaphore").
    hf_logging.disable_progress_bar()
    try:
        trainer = _setup(rank, spec)
    except BaseException:  # noqa: BLE001 - the parent shows the traceback
        _reply(conn, "error", traceback.format_exc())
        _exit(1)
    _reply(conn, "ok", rank_info(rank, trainer))
    try:
        _serve(trainer, conn)
    finally:
        trainer.close()  # a checkpoint write under way finishes
        distributed.destroy_process_group()
        _exit(0)


def _parent_gone_quietly(exc_type: type[BaseException], exc: BaseException, tb: Any) -> None:
    """A worker's `sys.excepthook`: silent for a connection the run's process dropped, the default otherwise.

    A reply that holds tensors crosses as shared memory: the parent's unpickling connects back to this process's
    `multiprocessing.resource_sharer` thread for each file descriptor. When the parent stops mid-handover (a
    SIGTERM while it receives a step's result), that thread's handshake fails with `ConnectionResetError`,
    and the thread reports it through `sys.excepthook` as a traceback, in the run's log after the parent's
    own line saying why it stopped. The parent is going away and says so itself; the reset adds nothing.
    (The serving loop catches everything it runs, so the main thread does not come here.)
    """
    if issubclass(exc_type, (ConnectionError, EOFError)):
        return
    sys.__excepthook__(exc_type, exc, tb)


def rank_info(rank: int, trainer: PolicyTrainer) -> dict[str, Any]:
    """What a rank reports once started: `{"rank", "pid", "trainable_params"}` (parameter count)."""
    return {"rank": rank, "pid": os.getpid(), "trainable_params": sum(p.numel() for p in trainer.params)}


def _exit(code: int) -> NoReturn:
    """Leave without interpreter teardown: torch's C++ destructors take seconds there, and nothing is left to save."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _setup(rank: int, spec: _WorkerSpec) -> PolicyTrainer:
    plan = spec.plan
    device = rank_device(plan.device, plan.gpus[rank] if plan.gpus else rank, plan.world_size)
    distributed.init_process_group(
        device, rank=rank, world_size=plan.world_size, port=spec.port, timeout_s=spec.timeout_s
    )
    return build_sharded_trainer(plan, device=device)


def _serve(trainer: PolicyTrainer, conn: Connection) -> None:
    while True:
        try:
            cmd, args = conn.recv()
        except (EOFError, OSError):  # the parent is gone
            return
        if cmd == "close":
            return
        try:
            result = COMMANDS[cmd](trainer, *args)
        except BaseException:  # noqa: BLE001 - reported to the parent, which shuts the workers down
            _reply(conn, "error", traceback.format_exc())
            continue
        finally:
            del args  # a received PackedTensors' shared memory is not kept until the next command
        _reply(conn, "ok", result)
        del result  # nor one this rank sent


def _reply(conn: Connection, status: str, value: Any) -> None:
    with contextlib.suppress(OSError):
        conn.send((status, value))


# The rank's tensors go from where they are (GPU) straight into the shared-memory buffer: no CPU copy between.
def _adapter_state(trainer: PolicyTrainer, shared: bool) -> tuple[PackedTensors, dict[str, Any]] | None:
    state = trainer.gather_adapter_state()
    return None if state is None else (PackedTensors.pack(state[0], shared=shared), state[1])


def _state_dict(trainer: PolicyTrainer, shared: bool) -> tuple[PackedTensors, dict[str, Any]] | None:
    state = trainer.gather_state_dict()
    return None if state is None else (PackedTensors.pack(state["tensors"], shared=shared), state["meta"])


def _load_state_dict(trainer: PolicyTrainer, packed: PackedTensors, meta: dict[str, Any]) -> None:
    trainer.load_state_dict({"tensors": packed.unpack(), "meta": meta})


COMMANDS: dict[str, Callable[..., Any]] = {  # what a rank runs, here and on Ray (`ray_actors`)
    "train_step": PolicyTrainer.train_step,
    "profiled_train_step": PolicyTrainer.profiled_train_step,
    "adapter_state": _adapter_state,
    "state_dict": _state_dict,
    "load_state_dict": _load_state_dict,
    "save_checkpoint": PolicyTrainer.save_checkpoint,
    "written_checkpoints": PolicyTrainer.written_checkpoints,
}
