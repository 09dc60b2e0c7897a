"""The one place that builds what a training run uses: store, run files, data, rewards, engine and trainer
(the data and the rewards, and the checks made on them before step 1, through `lora_rl_core.run.inputs`).

`build_run(cfg, run_id)` returns a `RunComponents`; the phases (`lora_rl_core.run.phases`) and resume
(`lora_rl_core.run.resume`) are functions over it. Nothing here runs a phase, and nothing here knows about
Prefect: the flow's tasks keep the components of open runs in `tasks.registry`.
"""

from __future__ import annotations

import hashlib
import random
import threading
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from lora_rl_core.adapters import safetensors_bytes
from lora_rl_core.checkpoint import CheckpointStore
from lora_rl_core.config import RunConfig
from lora_rl_core.data import Problem, PromptSampler, prompt_instruction, render_prompt
from lora_rl_core.engines import BuiltEngine, EngineInputs, InferenceEngine
from lora_rl_core.engines.launch.probe import probe_sglang
from lora_rl_core.engines.launch.process import LaunchPlan
from lora_rl_core.engines.registry import build_engine
from lora_rl_core.errors import DataError, LoraRLError
from lora_rl_core.lora import apply_lora
from lora_rl_core.memory import MemoryPlan, ModelShape, log_plan, plan_memory, sglang_shares_trainer_gpu
from lora_rl_core.models import load_model, load_tokenizer, model_dtype, model_folder, resolve_device
from lora_rl_core.rewards import Grader, RewardSet, build_grader
from lora_rl_core.run.inputs import build_problems, build_rewards, check_answers, check_leaks
from lora_rl_core.run.rundir import RunDir
from lora_rl_core.run.writer import StoreWriter
from lora_rl_core.runtime import choose_dtype, choose_lora_compute_dtype, configure_threads, cpu_threads
from lora_rl_core.store import AdapterRef, AdapterStore, validate_run_id
from lora_rl_core.trainer import PolicyTrainer, Trainer
from lora_rl_core.trainer.kernels import apply_kernels, choose_kernels
from lora_rl_core.trainer.workers import TrainerWorkers


def trainer_device(cfg: RunConfig) -> torch.device:
    """The trainer's device: `model.device` in this process, `trainer.device` for FSDP2 ranks (rank 0's)."""
    return resolve_device(cfg.trainer.device if cfg.trainer.world_size else cfg.model.device)


def runtime_info(cfg: RunConfig) -> dict[str, Any]:
    """What the run computes on, for the run log, `run.json` and the report: `{"device", "dtype",
    "dtype_reason", "lora_compute_dtype", "lora_compute_dtype_reason", "liger_kernels", "liger_kernels_reason",
    "cpu_threads"}` (the dtype `model.dtype` resolved to on the model's device; what `trainer.lora_compute_dtype`
    and `trainer.liger_kernels` resolve to on the trainer's), decided here once, before anything starts.

    Raises:
        ConfigError: `trainer.lora_compute_dtype: bfloat16` over base weights that are not bfloat16;
            `trainer.liger_kernels: true` where Liger cannot run (`trainer.kernels.choose_kernels`).
    """
    choice = model_dtype(cfg.model)
    device = trainer_device(cfg)
    lora = choose_lora_compute_dtype(cfg.trainer.lora_compute_dtype, device, choose_dtype(cfg.model.dtype, device).name)
    kernels = choose_kernels(cfg.trainer.liger_kernels, device, _model_type(cfg) if cfg.trainer.liger_kernels else "")
    return {
        "device": str(resolve_device(cfg.model.device)),
        "dtype": choice.name,
        "dtype_reason": choice.reason,
        "lora_compute_dtype": lora.name,
        "lora_compute_dtype_reason": lora.reason,
        "liger_kernels": kernels.liger,
        "liger_kernels_reason": kernels.reason,
        "cpu_threads": cpu_threads(),
    }


def _model_type(cfg: RunConfig) -> str:
    """The model's family (`model_type` of its `config.json`), read without loading weights."""
    from transformers import AutoConfig

    return str(
        AutoConfig.from_pretrained(model_folder(cfg.model), trust_remote_code=cfg.model.trust_remote_code).model_type
    )


def build_trainer(cfg: RunConfig, tokenizer: PreTrainedTokenizerBase) -> Trainer:
    """The in-process trainer (`trainer.world_size: 0`, its own copy of the base model with a fresh LoRA), or
    `trainer.world_size` persistent FSDP2 ranks: spawned processes (`trainer.backend: local`) or Ray actors
    (`ray`), with FSDP2's bfloat16 mixed precision unless `trainer.lora_compute_dtype` is `float32`."""
    t = cfg.trainer
    mixed = t.lora_compute_dtype != "float32"
    if t.world_size >= 1 and t.backend == "ray":
        from lora_rl_core.trainer.ray_actors import RayTrainer  # lazy: Ray only when asked for

        return RayTrainer(cfg, world_size=t.world_size, device=t.device, mixed_precision=mixed)
    if t.world_size >= 1:
        return TrainerWorkers(cfg, world_size=t.world_size, device=t.device, mixed_precision=mixed)
    model, _ = load_model(cfg.model)
    apply_kernels(model, t.liger_kernels, model.device)
    return PolicyTrainer.from_config(apply_lora(model, cfg.lora), cfg, pad_id=tokenizer.pad_token_id)


def plan_run_memory(cfg: RunConfig, tokenizer: PreTrainedTokenizerBase, problems: list[Problem]) -> MemoryPlan:
    """The run's GPU memory plan (`lora_rl_core.memory.plan_memory`) for the trainer's GPU and a launched
    SGLang beside it; on a CPU only `auto` settings are resolved (gradient checkpointing off).

    Raises:
        ConfigError: the run cannot fit the GPU (naming the settings to change).
        EngineError: the launched SGLang's installation cannot be probed.
    """
    device = trainer_device(cfg)
    if device.type != "cuda":
        return plan_memory(cfg, None, prompt_tokens=0, gpu_free=0, gpu_total=0, colocated=False, saver_available=False)
    colocated = sglang_shares_trainer_gpu(cfg, device)
    saver = colocated and cfg.engine.launch.memory_saver is not False and probe_sglang(cfg.engine.launch).memory_saver
    r = cfg.rollout
    instruction = prompt_instruction(cfg.data, r)
    prompt_tokens = max(
        (
            len(render_prompt(tokenizer, p, system_prompt=r.system_prompt, instruction=instruction))
            for p in problems[:256]
        ),
        default=0,
    )
    free, total = torch.cuda.mem_get_info(device)
    plan = plan_memory(
        cfg,
        ModelShape.of(cfg.model, cfg.lora),
        prompt_tokens=prompt_tokens,
        gpu_free=free,
        gpu_total=total,
        colocated=colocated,
        saver_available=saver,
    )
    log_plan(plan)
    return plan


@dataclass(frozen=True)
class PublishedVersion:
    """The last published version as the trainer made it, for the tensor sync path, and its write to the store.

    Attributes:
        ref: the ref `versions.publish` returned (`sha256` None while the version is not serialised yet).
        tensors / config: its PEFT-keyed CPU tensors (a copy: later train steps do not change them) and its
            PEFT config.
        prepared: the complete ref (sha256 included) once the background write has serialised the version.
        stored: the complete ref once the version is in the store (`StoreWriter.submit`). Both raise
            `BackgroundWriteError` from `result()` if the write failed.
    """

    ref: AdapterRef
    tensors: dict[str, torch.Tensor]
    config: dict[str, Any]
    prepared: Future[AdapterRef]
    stored: Future[AdapterRef]

    def checksum(self) -> str | None:
        """The sha256 of the version's safetensors bytes: the background write's once it has serialised them,
        else computed here (serialising is deterministic) rather than waiting behind the step's checkpoint.

        Raises:
            BackgroundWriteError: the version's write failed.
        """
        if self.prepared.done():  # a write that failed before serialising failed `prepared` too
            return self.prepared.result().sha256
        if self.stored.done():
            return self.stored.result().sha256
        return hashlib.sha256(safetensors_bytes(self.tensors)).hexdigest()


@dataclass(frozen=True)
class Restored:
    """What `lora_rl_core.run.resume.restore` found when the run opened (0 and None for a fresh run).

    Attributes:
        step: the checkpoint step the trainer was restored from. Its update and every earlier one are in the
            trainer: the train phase of such a step replays the stats it recorded instead of training again.
        newest_version: the newest adapter version then in the store. Publishing a version up to it returns
            the stored one (versions are immutable; a resumed run re-derives the same weights).
    """

    step: int = 0
    newest_version: int | None = None


def _transport_for_placement(cfg: RunConfig) -> RunConfig:
    """`engine.tensor_transport: auto` where this run launches SGLang on another GPU than the trainer's: `file`
    (a local PEFT folder written for the load: CUDA IPC handles do not open in a server that cannot see the
    trainer's GPU, inline data costs seconds for a 7B adapter: 3.2 s per sync measured on two H100s, and the
    published folder waits for the store write, queued behind the step's checkpoint)."""
    e = cfg.engine
    device = trainer_device(cfg)
    launched_here = e.type == "sglang" and e.launch.enabled and not e.ray_replicas
    if e.tensor_transport != "auto" or not launched_here or device.type != "cuda":
        return cfg
    if sglang_shares_trainer_gpu(cfg, device):
        return cfg
    return cfg.model_copy(update={"engine": e.model_copy(update={"tensor_transport": "file"})})


@dataclass
class PolicyState:
    """Which adapter version the engines serve for rollouts, which versions rollouts still hold, and the
    tensors of the last publish. Thread-safe: in `rollout.mode: async` rollouts run beside the step's sync.

    Attributes:
        version: the policy version rollouts use; None until version 0 is synced.
        pending: the last version published from the trainer, for the tensor sync path (`engine.sync:
            tensor`) and for a sync that must wait for its write to the store; dropped once synced.
    """

    version: int | None = None
    pending: PublishedVersion | None = None
    _holds: Counter[int] = field(default_factory=Counter)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @contextmanager
    def hold(self) -> Iterator[int]:
        """The current version, held until the block ends: `held()` reports it, and the sync protocol does
        not retire a held version (docs/HOTSWAP.md, "Asynchronous rollouts").

        Raises:
            LoraRLError: no version has been synced yet.
        """
        with self._lock:
            if self.version is None:
                raise LoraRLError("no adapter version has been synced to the engine yet (publish and sync version 0)")
            version = self.version
            self._holds[version] += 1
        try:
            yield version
        finally:
            with self._lock:
                self._holds[version] -= 1
                if not self._holds[version]:
                    del self._holds[version]

    def held(self) -> set[int]:
        """Versions that rollouts hold now."""
        with self._lock:
            return set(self._holds)

    def switch(self, version: int) -> None:
        """Make `version` the one later rollouts use (rollouts holding an older one keep it)."""
        with self._lock:
            self.version = version


@dataclass
class RunComponents:
    """Everything one training run uses in this process. Build with `build_run`; `close()` when done.

    Attributes:
        cfg / run_id: the run's config and id.
        store: the adapter store (versions are published here).
        run_dir: the run's own files in the store (phase outputs, config snapshot, fault markers).
        checkpoints: the run's trainer checkpoints.
        workdir: the local folder for the report and plots (`<run.output_dir>/<run_id>`).
        tokenizer / trainer: the model side; the trainer holds the policy LoRA and the optimizer.
        built: the engine (`engine`: its own copy of the base model, or clients of remote engines) with what
            was started for it (an SGLang server, Ray actors), from the engine registry.
        train_problems / test_problems / sampler: the data.
        rewards: the reward terms (`RewardSet`: it owns the math verifier's worker processes).
        grader: the evaluation's fixed grader (`eval.grader`), apart from the reward terms.
        runtime: device, dtype and why, the LoRA compute dtype and why, CPU threads, the memory plan
            (`runtime_info`).
        writer: writes train records, checkpoints and adapter versions to the store, in step order, on a
            background thread (`trainer.background_publish`) or at once.
        memory: the GPU memory plan (`lora_rl_core.memory`; None on a CPU).
        policy: the version rollouts use (mutable; `lora_rl_core.run.versions.sync` moves it).
        restored: what the run resumed from (`lora_rl_core.run.resume.restore` sets it).
    """

    cfg: RunConfig
    run_id: str
    store: AdapterStore
    run_dir: RunDir
    checkpoints: CheckpointStore
    workdir: Path
    tokenizer: PreTrainedTokenizerBase
    built: BuiltEngine
    trainer: Trainer
    train_problems: list[Problem]
    test_problems: list[Problem]
    sampler: PromptSampler
    rewards: RewardSet
    grader: Grader
    runtime: dict[str, Any]
    writer: StoreWriter
    policy: PolicyState = field(default_factory=PolicyState)
    restored: Restored = Restored()
    memory: MemoryPlan | None = None

    @contextmanager
    def engine_memory_released(self) -> Iterator[None]:
        """Free the KV cache of the SGLang servers this run launched with the memory saver (the memory plan's
        `memory_saver`: the trainer shares their GPU and needs that memory) for the block, then give the
        trainer's cached CUDA blocks back (the plan allows the saver only for a trainer in this process) and
        take the KV cache back.

        Raises:
            EngineError: a server refused the release or the resume.
        """
        servers = [s for s in self.built.servers if getattr(s, "memory_saver", False)]
        for server in servers:
            server.release_memory()
        try:
            yield
        finally:
            if servers and torch.cuda.is_available():
                torch.cuda.empty_cache()  # the step's activations, before SGLang takes its KV cache back
            for server in servers:
                server.resume_memory()

    @property
    def engine(self) -> InferenceEngine:
        """The engine rollouts, syncs and evaluations use."""
        return self.built.engine

    @cached_property
    def _problems_by_id(self) -> dict[str, Problem]:
        return {p.id: p for p in self.train_problems}

    def problem(self, problem_id: str) -> Problem:
        """The training problem with id `problem_id` (what a rollout row names).

        Raises:
            DataError: no training problem has that id (the data changed since the rollout was written).
        """
        try:
            return self._problems_by_id[problem_id]
        except KeyError:
            raise DataError(
                f"rollout row names problem {problem_id!r}, which the training data does not have: the data "
                "changed since the rollouts were written; resume with the run's own data"
            ) from None

    def close(self) -> None:
        """Wait for the store writes still queued and stop the writer's thread, then stop the trainer's worker
        processes, then the engine (its worker thread, or its HTTP clients) and what was started for it
        (`engine.launch`'s SGLang server, Ray actors)."""
        with ExitStack() as stack:  # closes in reverse order, each one even if an earlier one raised
            stack.callback(self.rewards.close)
            stack.callback(self.grader.close)
            stack.callback(self.built.close)
            stack.callback(self.trainer.close)
            stack.callback(self.writer.close)


def build_run(cfg: RunConfig, run_id: str) -> RunComponents:
    """Build the components of run `run_id`: set CPU threads, write the config snapshot `run.json`, load data,
    rewards, tokenizer, the engine and the trainer, and seed Python's and torch's RNGs with `run.seed`. The
    trainer gets the `auto` settings resolved: the LoRA compute dtype and Liger's kernels (`runtime_info`),
    gradient checkpointing and the micro-batch (the memory plan).

    The engine comes from the engine registry (`lora_rl_core.engines.registry.build_engine`) with what it
    starts: with `engine.launch.enabled` an SGLang server (log: `<workdir>/sglang.log`), with
    `engine.ray_replicas` Ray actors (SGLang logs `<workdir>/sglang-<i>.log`). If a later part fails, what was
    already built is closed or stopped again.

    Raises:
        StoreError: bad run id, or the store cannot be opened or written.
        ConfigError / DataError / RewardError / ModelError / EngineError: what could not be built.
    """
    run_id = validate_run_id(run_id)
    configure_threads()
    runtime = runtime_info(cfg)
    store = cfg.store.build()
    run_dir = RunDir(store.uri, run_id, cfg.store.storage_options)
    run_dir.write_config({**cfg.model_dump(mode="json"), "runtime": runtime})
    train_problems = build_problems(cfg.data, "train", cfg.run.seed)
    test_problems = build_problems(cfg.data, "test", cfg.run.seed)
    check_answers(cfg, train_problems, test_problems)
    random.seed(cfg.run.seed)
    torch.manual_seed(cfg.run.seed)
    tokenizer = load_tokenizer(cfg.model)
    memory = plan_run_memory(cfg, tokenizer, train_problems)
    cfg = cfg.model_copy(
        update={
            "trainer": cfg.trainer.model_copy(
                update={
                    "gradient_checkpointing": memory.gradient_checkpointing,
                    "micro_batch_size": memory.micro_batch_size,
                    "lora_compute_dtype": runtime["lora_compute_dtype"],
                    "liger_kernels": runtime["liger_kernels"],
                }
            )
        }
    )
    cfg = _transport_for_placement(cfg)
    if memory.gpu_total:
        runtime["memory_plan"] = memory.summary()
        run_dir.write_config({**cfg.model_dump(mode="json"), "runtime": runtime})
    workdir = Path(cfg.run.output_dir) / run_id
    launch = LaunchPlan(memory.rollout_batch, memory.mem_fraction_static, memory.memory_saver)
    inputs = EngineInputs(
        cfg.engine, cfg.model, cfg.lora, cfg.store, tokenizer=tokenizer, log_dir=workdir, launch_plan=launch
    )
    with ExitStack() as started:  # on a failure, what was built so far is stopped again
        rewards = build_rewards(cfg)
        started.callback(rewards.close)
        check_leaks(cfg, tokenizer, test_problems, rewards)
        grader = build_grader(cfg.eval, cfg.reward)
        started.callback(grader.close)
        built = build_engine(inputs)
        started.callback(built.close)
        trainer = build_trainer(cfg, tokenizer)
        started.pop_all()  # built: the components own them now
    return RunComponents(
        cfg=cfg,
        run_id=run_id,
        store=store,
        run_dir=run_dir,
        checkpoints=CheckpointStore(store.uri, cfg.store.storage_options),
        workdir=workdir,
        tokenizer=tokenizer,
        built=built,
        trainer=trainer,
        train_problems=train_problems,
        test_problems=test_problems,
        sampler=PromptSampler(train_problems, seed=cfg.run.seed),
        rewards=rewards,
        grader=grader,
        runtime=runtime,
        memory=memory if memory.gpu_total else None,
        writer=StoreWriter(background=cfg.trainer.background_publish),
    )
