"""The one place that builds what a training run uses, from its plan: store, run files, rewards, grader, engine
and trainer (`build_run`), or what an evaluation uses (`build_evaluation`).

The order is: the inputs (`lora_rl_core.run.inputs.load_inputs`: data and tokenizer), the plan
(`lora_rl_core.plan.make_plan`: every `auto` resolved, the memory plan), then `build_run(plan, inputs, run_id)`.
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
from lora_rl_core.config import RunConfig
from lora_rl_core.data import Problem, PromptSampler, PromptStyle
from lora_rl_core.engines import BuiltEngine, EngineInputs, RolloutEngine
from lora_rl_core.engines.registry import build_engine
from lora_rl_core.memory import MemoryPlan
from lora_rl_core.plan import RunPlan, make_plan
from lora_rl_core.rewards import Grader, RewardSet, build_grader
from lora_rl_core.run.inputs import RunInputs, build_rewards, check_leaks, load_inputs
from lora_rl_core.run.rundir import RunDir
from lora_rl_core.run.state import PolicyState, Restored
from lora_rl_core.run.writer import StoreWriter
from lora_rl_core.runtime import configure_threads
from lora_rl_core.store import AdapterStore, validate_run_id
from lora_rl_core.trainer import Trainer, build_trainer

log = logging.getLogger(__name__)


def plan_run(cfg: RunConfig, *, train: bool = True) -> tuple[RunPlan, RunInputs]:
    """The run's inputs (`load_inputs`), then its plan (`make_plan`): what `build_run` (or, with `train=False`,
    `build_evaluation`) builds from. Nothing is started and nothing is written.

    Raises:
        DataError / ModelError / ConfigError / EngineError: as `load_inputs` and `make_plan`.
    """
    inputs = load_inputs(cfg, train=train)
    return make_plan(cfg, tokenizer=inputs.tokenizer, problems=inputs.train, train=train), inputs


def start_run(cfg: RunConfig, run_id: str) -> RunComponents:
    """A run's components from its config: `plan_run`, then `build_run` (the flow's `open_run`, scripts, tests).

    Raises:
        as `plan_run` and `build_run`.
    """
    plan, inputs = plan_run(cfg)
    return build_run(plan, inputs, run_id)


def engine_inputs(plan: RunPlan, tokenizer: PreTrainedTokenizerBase | None, log_dir: Path | None) -> EngineInputs:
    """What the engine registry builds the run's engine from: the `engine`, `model`, `lora` and `store` sections
    and the plan's engine section (device, dtype, a launched SGLang's resolved flags, the tensor transport)."""
    cfg, e = plan.config, plan.engine
    return EngineInputs(
        cfg.engine,
        cfg.model,
        cfg.lora,
        cfg.store,
        tokenizer=tokenizer,
        log_dir=log_dir,
        device=e.device,
        dtype=e.dtype,
        launch=e.launch,
        launch_plan=e.launch_plan,
        tensor_transport=e.tensor_transport,
    )


@dataclass
class RunComponents:
    """Everything one training run uses in this process. Build with `build_run`; `close()` when done.

    Attributes:
        plan: the run's plan (its validated config, every `auto` resolved).
        run_id: the run's id.
        store: the adapter store (versions are published here).
        run_dir: the run's own files in the store (phase outputs, config snapshot, fault markers).
        checkpoints: the run's trainer checkpoints.
        workdir: the local folder for the report, plots and launched servers' logs (`<run.output_dir>/<run_id>`).
        inputs: the data and the tokenizer (`RunInputs`).
        prompt: how problems become prompts (`PromptStyle`: the one renderer of rollouts and evaluations).
        built: the engine (`engine`: its own copy of the base model, or clients of remote engines) with what
            was started for it (an SGLang server, Ray actors), from the engine registry.
        trainer: the policy LoRA and the optimizer (`build_trainer`).
        sampler: the training prompts' order.
        rewards: the reward terms (`RewardSet`: it owns the math verifier's worker processes).
        grader: the evaluation's fixed grader (`eval.grader`), apart from the reward terms.
        writer: writes train records, checkpoints and adapter versions to the store, in step order, on a
            background thread (`trainer.background_publish`) or at once.
        policy: the version rollouts use (mutable; `lora_rl_core.run.versions.sync` moves it).
        restored: what the run resumed from (`lora_rl_core.run.resume.restore` sets it).
    """

    plan: RunPlan
    run_id: str
    store: AdapterStore
    run_dir: RunDir
    checkpoints: CheckpointStore
    workdir: Path
    inputs: RunInputs
    prompt: PromptStyle
    built: BuiltEngine
    trainer: Trainer
    sampler: PromptSampler
    rewards: RewardSet
    grader: Grader
    writer: StoreWriter
    policy: PolicyState = field(default_factory=PolicyState)
    restored: Restored = Restored()

    @property
    def cfg(self) -> RunConfig:
        """The run's config, as validated (the plan's; never rewritten)."""
        return self.plan.config

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        """The model's tokenizer."""
        return self.inputs.tokenizer

    @property
    def train_problems(self) -> list[Problem]:
        """The training problems."""
        return self.inputs.train

    @property
    def test_problems(self) -> list[Problem]:
        """The held-out problems."""
        return self.inputs.test

    @property
    def runtime(self) -> dict[str, Any]:
        """The plan's summary (device, dtypes and why, every choice, the memory plan): `RunPlan.summary`."""
        return self.plan.summary()

    @property
    def memory(self) -> MemoryPlan | None:
        """The GPU memory plan (None on a CPU)."""
        return self.plan.memory

    @property
    def engine(self) -> RolloutEngine:
        """The engine rollouts, syncs and evaluations use."""
        return self.built.engine

    def problem(self, problem_id: str) -> Problem:
        """The training problem a rollout row names (`RunInputs.problem`). Raises `DataError` if none has it."""
        return self.inputs.problem(problem_id)

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
            stack.callback(self.rewards.close)
            stack.callback(self.grader.close)
            stack.callback(self.built.close)
            stack.callback(self.trainer.close)
            stack.callback(self.writer.close)


def build_run(plan: RunPlan, inputs: RunInputs, run_id: str) -> RunComponents:
    """Build the components of run `run_id` from its plan: set CPU threads, write the config snapshot
    `run.json` (the config and the plan, once), build the rewards (and check that none pays for a restated
    prompt), the grader, the engine and the trainer, and seed Python's and torch's RNGs with `run.seed`.

    The engine comes from the engine registry (`lora_rl_core.engines.registry.build_engine`) with what it
    starts: with `engine.launch.enabled` an SGLang server (log: `<workdir>/sglang.log`), with
    `engine.ray_replicas` Ray actors (SGLang logs `<workdir>/sglang-<i>.log`). If a later part fails, what was
    already built is closed or stopped again.

    Raises:
        StoreError: bad run id, or the store cannot be opened or written.
        ConfigError / DataError / RewardError / ModelError / EngineError: what could not be built.
    """
    cfg = plan.config
    if plan.trainer is None:
        raise ValueError("build_run needs a training plan (make_plan(..., train=True))")
    run_id = validate_run_id(run_id)
    configure_threads()
    store = cfg.store.build()
    run_dir = RunDir(store.uri, run_id, cfg.store.storage_options)
    run_dir.write_config({**cfg.model_dump(mode="json"), "plan": plan.summary()})
    random.seed(cfg.run.seed)
    torch.manual_seed(cfg.run.seed)
    workdir = plan.workdir(run_id)
    with ExitStack() as started:  # on a failure, what was built so far is stopped again
        rewards = build_rewards(cfg)
        started.callback(rewards.close)
        check_leaks(cfg, inputs.tokenizer, inputs.test, rewards)
        grader = build_grader(cfg.eval, cfg.reward)
        started.callback(grader.close)
        built = build_engine(engine_inputs(plan, inputs.tokenizer, workdir))
        started.callback(built.close)
        trainer = build_trainer(plan.trainer, pad_id=inputs.tokenizer.pad_token_id)
        started.pop_all()  # built: the components own them now
    return RunComponents(
        plan=plan,
        run_id=run_id,
        store=store,
        run_dir=run_dir,
        checkpoints=CheckpointStore(store.uri, cfg.store.storage_options),
        workdir=workdir,
        inputs=inputs,
        prompt=PromptStyle.of(cfg.data, cfg.rollout),
        built=built,
        trainer=trainer,
        sampler=PromptSampler(inputs.train, seed=cfg.run.seed),
        rewards=rewards,
        grader=grader,
        writer=StoreWriter(background=cfg.trainer.background_publish),
    )


@dataclass
class EvalComponents:
    """What an evaluation outside a run uses (`lora-rl eval`): the engine, the grader and the held-out data,
    built as a run builds them. `close()` when done.

    Attributes:
        plan: the evaluation's plan (`make_plan(..., train=False)`: no trainer).
        inputs: the held-out problems and the tokenizer.
        built: the engine with what was started for it.
        grader: the evaluation's fixed grader.
        store: the adapter store (adapters are loaded from it by reference).
    """

    plan: RunPlan
    inputs: RunInputs
    built: BuiltEngine
    grader: Grader
    store: AdapterStore

    def close(self) -> None:
        """Stop the engine and what was started for it, then the grader's workers."""
        with ExitStack() as stack:
            stack.callback(self.grader.close)
            stack.callback(self.built.close)

    def __enter__(self) -> EvalComponents:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def build_evaluation(plan: RunPlan, inputs: RunInputs) -> EvalComponents:
    """The engine (from the engine registry, as `build_run` builds it; a launched server logs to the working
    directory) and the grader for evaluating adapters of `plan`'s store on its held-out problems.

    Raises:
        StoreError / RewardError / ModelError / EngineError: what could not be built.
    """
    cfg = plan.config
    store = cfg.store.build()
    configure_threads()
    grader = build_grader(cfg.eval, cfg.reward)
    try:
        built = build_engine(engine_inputs(plan, inputs.tokenizer, Path.cwd()))
    except BaseException:
        grader.close()
        raise
    return EvalComponents(plan=plan, inputs=inputs, built=built, grader=grader, store=store)
