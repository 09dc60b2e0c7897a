"""The one place that builds what a training run uses: its inputs and plan (`prepare_run`), then run files,
engine and trainer (`build_run`), or what an evaluation uses (`build_evaluation`).

The order is: the inputs (`lora_rl_core.run.inputs.load_inputs`: store, data, tokenizer, rewards, grader), the
plan (`lora_rl_core.plan.make_plan`: every `auto` resolved, the memory plan), together `prepare_run`, each built
once per process; then `build_run(prepared, run_id)` builds the engine and the trainer.
The phases (`lora_rl_core.run.phases`) and resume (`lora_rl_core.run.resume`) are functions over the
`RunComponents`. Nothing here runs a phase, and nothing here knows about Prefect: the flow's tasks keep the
components of open runs in `tasks.registry`.
"""

from __future__ import annotations

import logging
import random
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
from lora_rl_core.plan import RunPlan, make_plan
from lora_rl_core.rewards import RewardSet
from lora_rl_core.run.inputs import RunInputs, load_inputs
from lora_rl_core.run.rundir import RunDir
from lora_rl_core.run.state import PolicyState, Restored
from lora_rl_core.run.writer import StoreWriter
from lora_rl_core.runtime import configure_threads
from lora_rl_core.store import AdapterStore, validate_run_id
from lora_rl_core.trainer import Trainer, build_trainer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PreparedRun:
    """A run's plan and inputs, made once per process before anything trains (`prepare_run`); `close()` stops
    the inputs' worker processes where no run was built from them (a built run owns them)."""

    plan: RunPlan
    inputs: RunInputs

    def close(self) -> None:
        """Stop the reward terms' and the grader's worker processes."""
        self.inputs.close()

    def __enter__(self) -> PreparedRun:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def prepare_run(cfg: RunConfig, *, train: bool = True) -> PreparedRun:
    """The run's inputs (`load_inputs`: store, data, tokenizer, rewards, grader, and their checks), then its plan
    (`make_plan`): what `build_run` (or, with `train=False`, `build_evaluation`) builds from. No engine or
    trainer is started and nothing is written.

    Raises:
        StoreError / DataError / RewardError / ModelError / ConfigError / EngineError: as `load_inputs` and
        `make_plan` (what was built is closed again).
    """
    inputs = load_inputs(cfg, train=train)
    try:
        return PreparedRun(make_plan(cfg, tokenizer=inputs.tokenizer, problems=inputs.train, train=train), inputs)
    except BaseException:
        inputs.close()
        raise


def start_run(cfg: RunConfig, run_id: str) -> RunComponents:
    """A run's components from its config: `prepare_run`, then `build_run` (scripts, tests, benchmarks).

    Raises:
        as `prepare_run` and `build_run`.
    """
    prepared = prepare_run(cfg)
    try:
        return build_run(prepared, run_id)
    except BaseException:
        prepared.close()
        raise


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
    """Everything one training run uses in this process. Build with `build_run`; `close()` when done.

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
        trainer: the policy LoRA and the optimizer (`build_trainer`).
        sampler: the training prompts' order.
        writer: writes train records, checkpoints and adapter versions to the store, in step order, on a
            background thread (`trainer.background_publish`) or at once.
        policy: the version rollouts use (mutable; `lora_rl_core.run.versions.sync` moves it).
        restored: what the run resumed from (`lora_rl_core.run.resume.restore` sets it).
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
    policy: PolicyState = field(default_factory=PolicyState)
    restored: Restored = Restored()

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
        """Wait for the store writes still queued and stop the writer's thread, then stop the trainer's worker
        processes, then the engine (its worker thread, or its HTTP clients) and what was started for it
        (`engine.launch`'s SGLang server, Ray actors)."""
        with ExitStack() as stack:  # closes in reverse order, each one even if an earlier one raised
            stack.callback(self.inputs.close)
            stack.callback(self.built.close)
            stack.callback(self.trainer.close)
            stack.callback(self.writer.close)


def build_run(prepared: PreparedRun, run_id: str) -> RunComponents:
    """Build the components of run `run_id` from its plan and inputs (`prepare_run`): set CPU threads, build the
    engine, write the config snapshot `run.json` (the config and the plan with what Ray replicas resolved on
    their hosts: `runtime_summary`, once), build the trainer, and seed Python's and torch's RNGs with
    `run.seed`. The components own the inputs from then on (`close`).

    The engine comes from the engine registry (`lora_rl_core.engines.registry.build_engine`) with what it
    starts: with `engine.launch.enabled` an SGLang server (log: `<workdir>/sglang.log`), with
    `engine.ray_replicas` Ray actors (SGLang logs `<workdir>/sglang-<i>.log`). If a later part fails, what was
    already built is closed or stopped again (the inputs stay the caller's).

    Raises:
        StoreError: bad run id, or the store cannot be written.
        ModelError / EngineError / TrainerWorkerError: what could not be built.
    """
    plan, inputs = prepared.plan, prepared.inputs
    cfg = plan.config
    if plan.trainer is None:
        raise ValueError("build_run needs a training plan (prepare_run(..., train=True))")
    run_id = validate_run_id(run_id)
    configure_threads()
    store = inputs.store
    run_dir = RunDir(store.uri, run_id, cfg.store.storage_options)
    random.seed(cfg.run.seed)
    torch.manual_seed(cfg.run.seed)
    workdir = plan.workdir(run_id)
    with ExitStack() as started:  # on a failure, what was built so far is stopped again
        built = build_engine(engine_inputs(plan, inputs.tokenizer, workdir, inputs.store))
        started.callback(built.close)
        run_dir.write_config({**cfg.model_dump(mode="json"), "plan": runtime_summary(plan, built)})
        trainer = build_trainer(plan.trainer, pad_id=inputs.tokenizer.pad_token_id)
        started.pop_all()  # built: the components own them now
    return RunComponents(
        plan=plan,
        run_id=run_id,
        run_dir=run_dir,
        checkpoints=CheckpointStore(store.uri, cfg.store.storage_options),
        workdir=workdir,
        inputs=inputs,
        prompt=PromptStyle.of(cfg.data, cfg.rollout),
        built=built,
        trainer=trainer,
        sampler=PromptSampler(inputs.train, seed=cfg.run.seed),
        writer=StoreWriter(background=cfg.trainer.background_publish),
    )


def build_evaluation(prepared: PreparedRun) -> BuiltEngine:
    """The engine for evaluating adapters of the plan's store on its held-out problems (`lora-rl eval`), from
    the engine registry as `build_run` builds it (a launched server logs to the working directory); the caller
    closes it, then the prepared inputs.

    Raises:
        ModelError / EngineError: what could not be built.
    """
    configure_threads()
    inputs = prepared.inputs
    return build_engine(engine_inputs(prepared.plan, inputs.tokenizer, Path.cwd(), inputs.store))
