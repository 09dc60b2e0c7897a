"""The one place that builds what a training run uses, and the open runs of this process by run id.

`build_run(plan, inputs, run_id)` builds a run from its inputs (`lora_rl_core.run.inputs.load_inputs`: store,
data, tokenizer, rewards, grader, and their checks) and its plan (`lora_rl_core.plan.make_plan`: every `auto`
resolved, the memory plan): the engine (with what it starts), the run's files and the trainer, once per
process; the run stays open under its id (`get_run`) until it is closed. `open_run(cfg, run_id)` makes the
inputs and the plan, then `build_run`. `lora-rl train` makes the inputs and the plan itself (a bad input is one
line, before anything starts) and builds the run before Prefect starts; the flow's first task takes it by id,
or opens it where the flow runs without the CLI (`lora_rl_core.run.resume.resume_run`: a deployment, a retry
from the UI). Prefect tasks get the run id and look the components up here: models, engines and worker
processes cannot cross a task boundary, so every task of a run runs in the process that opened it.
`build_evaluation` builds what `lora-rl eval` uses. Nothing here runs a phase, and nothing here knows about
Prefect; the phases (`lora_rl_core.run.phases`) and resume (`lora_rl_core.run.resume`) are functions over the
`RunComponents`.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from lora_rl_core.checkpoint import CheckpointStore
from lora_rl_core.config import RunConfig, ray_replicas
from lora_rl_core.data import PromptSampler, PromptStyle
from lora_rl_core.engines import BuiltEngine, EngineInputs, RolloutEngine
from lora_rl_core.engines.registry import build_engine
from lora_rl_core.errors import LoraRLError
from lora_rl_core.plan import RunPlan, make_plan
from lora_rl_core.rewards import RewardSet
from lora_rl_core.run.inputs import RunInputs, load_inputs
from lora_rl_core.run.rundir import RunDir
from lora_rl_core.run.state import PendingCheckpoint, PolicyState, Restored
from lora_rl_core.run.writer import StoreWriter
from lora_rl_core.runtime import configure_threads
from lora_rl_core.store import AdapterStore, validate_run_id
from lora_rl_core.trainer import PolicyTrainer, Trainer, policy_model
from lora_rl_core.trainer.workers import TrainerWorkers

log = logging.getLogger(__name__)


def engine_inputs(
    plan: RunPlan, tokenizer: PreTrainedTokenizerBase | None, log_dir: Path | None, store: AdapterStore | None
) -> EngineInputs:
    """What the engine registry builds the run's engine from: the `engine` and `lora` sections, the `model`
    section with the plan's device and dtype (left to each Ray replica's host where the engine has them), the
    adapter store, and the plan's engine section (a launched SGLang's resolved flags, the tensor transport)."""
    cfg, e = plan.config, plan.engine
    model = (
        cfg.model if ray_replicas(cfg.engine) else cfg.model.model_copy(update={"device": e.device, "dtype": e.dtype})
    )
    return EngineInputs(
        cfg.engine,
        model,
        cfg.lora,
        store,
        tokenizer=tokenizer,
        log_dir=log_dir,
        launch=e.launch,
        launch_budget=e.launch_budget,
        tensor_transport=e.tensor_transport,
    )


def runtime_summary(plan: RunPlan, built: BuiltEngine) -> dict[str, Any]:
    """The plan's summary (device, dtypes and why, every choice, the memory plan: `RunPlan.summary`), and under
    `replicas` what each Ray replica resolved on its own host before step 1 (`BuiltEngine.resolved`: its node,
    the model's device and dtype, or its SGLang flags and why), where the run has Ray replicas."""
    summary = plan.summary()
    if built.resolved:
        summary["replicas"] = list(built.resolved)
    return summary


@dataclass
class RunComponents:
    """Everything one training run uses in this process. Build with `build_run` (or `open_run`); `close()` when done.

    Attributes:
        plan: the run's plan (its validated config, every `auto` resolved).
        run_id: the run's id.
        run_dir: the run's own files in the store (phase outputs, config snapshot, fault markers).
        checkpoints: the run's trainer checkpoints.
        workdir: the local folder for the report, plots and launched servers' logs (`<run.output_dir>/<run_id>`).
        inputs: the store, data, tokenizer, reward terms and grader (`RunInputs`; closed with the run).
        prompt: how problems become prompts (`PromptStyle`: the one renderer of rollouts and evaluations).
        built: the engine (`engine`: its own copy of the base model, or clients of remote engines) with what
            was started for it (an SGLang server, Ray actors), from the engine registry.
        trainer: the policy LoRA and the optimizer (in this process, or its ranks: `trainer.backend`).
        sampler: the training prompts' order.
        writer: writes train records, checkpoints and adapter versions to the store, in step order, on a
            background thread (`trainer.background_publish`) or at once.
        began: when `build_run` began (`time.perf_counter()`, seconds): a run's wall time counts its build.
        policy: the version rollouts use (mutable; `lora_rl_core.run.versions.sync` moves it).
        restored: what the run resumed from (`lora_rl_core.run.resume.restore` sets it).
        pending_checkpoints: the checkpoints the trainer's ranks are writing, by step (`run.checkpoints`).
        closed: whether `close()` ran.
    """

    plan: RunPlan
    run_id: str
    run_dir: RunDir
    checkpoints: CheckpointStore
    workdir: Path
    inputs: RunInputs
    prompt: PromptStyle
    built: BuiltEngine
    trainer: Trainer
    sampler: PromptSampler
    writer: StoreWriter
    began: float
    policy: PolicyState = field(default_factory=PolicyState)
    restored: Restored = Restored()
    pending_checkpoints: dict[int, PendingCheckpoint] = field(default_factory=dict)
    closed: bool = field(default=False, repr=False)

    @property
    def cfg(self) -> RunConfig:
        """The run's config, as validated (the plan's; never rewritten)."""
        return self.plan.config

    @property
    def store(self) -> AdapterStore:
        """The adapter store (versions are published here)."""
        return self.inputs.store

    @property
    def rewards(self) -> RewardSet:
        """The reward terms (`RewardSet`: it owns the math verifier's worker processes)."""
        assert self.inputs.rewards is not None  # a training run's inputs have them (`load_inputs(train=True)`)
        return self.inputs.rewards

    @property
    def runtime(self) -> dict[str, Any]:
        """The plan's summary with the Ray replicas' answers (`runtime_summary`)."""
        return runtime_summary(self.plan, self.built)

    @property
    def engine(self) -> RolloutEngine:
        """The engine rollouts, syncs and evaluations use."""
        return self.built.engine

    @contextmanager
    def engine_memory_released(self) -> Iterator[None]:
        """Free the KV cache of the SGLang servers this run launched with the memory saver (the memory plan's
        `memory_saver`: the trainer shares their GPU and needs that memory) for the block, then take the KV
        cache back (the trainer gave its cached CUDA blocks back at the end of its step, on every rank:
        `TrainerPlan.empty_cache_after_step`).

        A block that raised still gives the KV cache back where it can, but its own error is the one raised: a
        resume that fails after a failed update (the trainer's out-of-memory error leaves its blocks cached)
        is logged, never raised in its place.

        Raises:
            EngineError: a server refused the release, or the resume after a block that succeeded.
        """
        servers = [s for s in self.built.servers if s.memory_saver]
        for server in servers:
            server.release_memory()
        failed = True
        try:
            yield
            failed = False
        finally:
            for server in servers:
                try:
                    server.resume_memory()
                except Exception as exc:
                    if not failed:
                        raise
                    log.warning("taking the KV cache back after the failed update failed too: %s", exc)

    def close(self) -> None:
        """Forget the run (`get_run`), wait for the store writes still queued and stop the writer's thread, then
        stop the trainer's worker processes, then the engine (its worker thread, or its HTTP clients) and what
        was started for it (`engine.launch`'s SGLang server, Ray actors), then the inputs' worker processes.
        A second call does nothing."""
        with _LOCK:
            if self.closed:
                return
            self.closed = True
            if _OPEN.get(self.run_id) is self:
                del _OPEN[self.run_id]
        with ExitStack() as stack:  # closes in reverse order, each one even if an earlier one raised
            stack.callback(self.inputs.close)
            stack.callback(self.built.close)
            stack.callback(self.trainer.close)
            stack.callback(self.writer.close)

    def __enter__(self) -> RunComponents:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_OPEN: dict[str, RunComponents] = {}
_LOCK = threading.Lock()


def open_run(cfg: RunConfig, run_id: str) -> RunComponents:
    """Run `run_id` from its validated config: its inputs (`load_inputs`), its plan (`make_plan`), then
    `build_run`. For a flow that runs without the CLI, scripts, tests and benchmarks; `lora-rl train` makes the
    inputs and the plan itself, to check them before it starts anything.

    Raises:
        as `load_inputs`, `make_plan` and `build_run` (what was built is closed again).
    """
    inputs = load_inputs(cfg)
    try:
        plan = make_plan(cfg, tokenizer=inputs.tokenizer, problems=inputs.train)
    except BaseException:
        inputs.close()
        raise
    return build_run(plan, inputs, run_id)  # the run owns the inputs (it closes them, also on a failure)


def build_run(plan: RunPlan, inputs: RunInputs, run_id: str) -> RunComponents:
    """Build run `run_id` from its plan and inputs (`make_plan`, `load_inputs`), once, and keep it open in this
    process under its id (`get_run`) until `close()`: CPU threads, the engine, the config snapshot `run.json`
    (the config and the plan with what Ray replicas resolved on their hosts: `runtime_summary`), the trainer
    (`trainer.backend`: in this process, `local` FSDP2 worker processes or Ray actors), with Python's and torch's
    RNGs seeded with `run.seed` first. The run owns the inputs: it closes them, and so does a failure here.

    The engine comes from the engine registry (`lora_rl_core.engines.registry.build_engine`) with what it
    starts: with `engine.launch.enabled` an SGLang server (log: `<workdir>/sglang.log`), with
    `engine.ray_replicas` Ray actors (SGLang logs `<workdir>/sglang-<i>.log`). If a later part fails, what was
    built is closed or stopped again.

    Raises:
        StoreError: bad run id, or the store cannot be written. LoraRLError: a run of that id is already open
            in this process.
        ModelError / EngineError / TrainerWorkerError: what could not be built.
    """
    began, cfg = time.perf_counter(), plan.config
    with ExitStack() as started:  # on a failure, what was built so far is stopped again
        started.enter_context(inputs)
        if plan.trainer is None:
            raise ValueError("build_run needs a training plan: make_plan(..., train=True)")
        run_id = validate_run_id(run_id)
        _check_not_open(run_id)
        configure_threads()
        run_dir = RunDir(inputs.store.uri, run_id, cfg.store.storage_options)
        random.seed(cfg.run.seed)
        torch.manual_seed(cfg.run.seed)
        workdir = plan.workdir(run_id)
        built = started.enter_context(build_engine(engine_inputs(plan, inputs.tokenizer, workdir, inputs.store)))
        run_dir.write_config({**cfg.model_dump(mode="json"), "plan": runtime_summary(plan, built)})
        t = plan.trainer
        trainer: Trainer
        if t.backend == "ray":
            from lora_rl_core.trainer.ray_actors import RayTrainer  # lazy: Ray only when asked for

            trainer = RayTrainer(t)
        elif t.backend == "local":
            trainer = TrainerWorkers(t)
        else:
            model, pad_id = policy_model(t, device=t.device, tokenizer=inputs.tokenizer)
            trainer = PolicyTrainer(model, t, pad_id=pad_id)
        started.callback(trainer.close)
        run = RunComponents(
            plan=plan,
            run_id=run_id,
            run_dir=run_dir,
            checkpoints=CheckpointStore(inputs.store.uri, cfg.store.storage_options),
            workdir=workdir,
            inputs=inputs,
            prompt=PromptStyle.of(cfg.data, cfg.rollout),
            built=built,
            trainer=trainer,
            sampler=PromptSampler(inputs.train, seed=cfg.run.seed),
            writer=StoreWriter(background=cfg.trainer.background_publish),
            began=began,
        )
        with _LOCK:  # checked again: another thread may have opened the id meanwhile (the stack closes ours)
            _check_not_open(run_id)
            _OPEN[run_id] = run
            started.pop_all()  # registered: the run owns what was built
    return run


def _check_not_open(run_id: str) -> None:
    if run_id in _OPEN:
        raise LoraRLError(f"run {run_id!r} is already open in this process: close it before opening it again")


def default_run_id(cfg: RunConfig, unique: str) -> str:
    """A run's id when none is given: `run.id`, else `<run.name>-<first 8 characters of unique>` (the flow run's
    id in a flow; random for `lora-rl train`, which passes it on to the flow, so that a retry resumes it)."""
    return cfg.run.id or f"{cfg.run.name}-{unique[:8]}"


def get_run(run_id: str) -> RunComponents:
    """The components of run `run_id`, open in this process (`build_run`).

    Raises:
        LoraRLError: this process has not opened the run (a Prefect task ran in another process than the flow).
    """
    try:
        return _OPEN[run_id]
    except KeyError:
        raise LoraRLError(
            f"run {run_id!r} is not open in this process: its tasks must run in the flow's process, after open_run"
        ) from None


def is_open(run_id: str) -> bool:
    """Whether run `run_id` is open in this process."""
    return run_id in _OPEN


def close_run(run_id: str) -> None:
    """Close run `run_id` (`RunComponents.close`); nothing happens if it is not open."""
    run = _OPEN.get(run_id)
    if run is not None:
        run.close()


def build_evaluation(plan: RunPlan, inputs: RunInputs) -> BuiltEngine:
    """The engine for evaluating adapters of the plan's store on its held-out problems (`lora-rl eval`), from
    the engine registry as `build_run` builds it (a launched server logs to the working directory); the caller
    closes it, then the inputs.

    Raises:
        ModelError / EngineError: what could not be built.
    """
    configure_threads()
    return build_engine(engine_inputs(plan, inputs.tokenizer, Path.cwd(), inputs.store))
