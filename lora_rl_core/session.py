"""A run's live objects and the five step phases the flow calls.

`RunSession` holds what must not cross a Prefect task boundary: the trainer's
policy (PeftModel + optimizer), the inference engine, the store, the prompt
sampler and the reward functions. Sessions live in a process-wide registry
keyed by run id; tasks receive the run id and small values (step numbers,
`AdapterRef`s, metric dicts) and look the session up.

Each phase persists its output under `<run.output_dir>/<run_id>/`:
`rollouts/step-NNNNNN.json` (prompts, completions, inference logprobs,
adapter versions) and `scored/step-NNNNNN.json` (plus rewards and
advantages), so a phase can be re-run or inspected.
"""

from __future__ import annotations

import json
import random
import threading
import time
from pathlib import Path
from typing import Any

import fsspec
import torch

from lora_rl_core.algorithm import ADVANTAGE_ESTIMATORS, group_has_signal
from lora_rl_core.checkpoint import CheckpointStore
from lora_rl_core.config import DataConfig, RunConfig
from lora_rl_core.data import Problem, PromptSampler, arithmetic_split, load_dataset, render_prompt, stable_seed
from lora_rl_core.engines import EmbeddedEngine, GenerationRequest, InferenceEngine, SamplingParams
from lora_rl_core.errors import EngineError, LoraRLError
from lora_rl_core.evaluation import evaluate_accuracy
from lora_rl_core.faults import maybe_fail
from lora_rl_core.lora import apply_lora
from lora_rl_core.models import load_model, load_tokenizer, model_dtype, model_folder, resolve_device
from lora_rl_core.rewards import load_reward, score_completions
from lora_rl_core.runtime import configure_threads, cpu_threads
from lora_rl_core.store import AdapterRef, adapter_name, validate_run_id
from lora_rl_core.subscriber import sync_version
from lora_rl_core.trainer import PolicyTrainer, TrainBatch
from lora_rl_core.trainer_workers import TrainerWorkers

_SESSIONS: dict[str, RunSession] = {}
_REGISTRY_LOCK = threading.Lock()


def build_problems(cfg: DataConfig, split: str, seed: int) -> list[Problem]:
    """Training or held-out problems for a data config (arithmetic generator or a JSONL dataset).

    Raises:
        DataError: missing or malformed dataset file.
    """
    if cfg.source == "arithmetic":
        size = cfg.train_size if split == "train" else (cfg.eval_size or 128)
        return arithmetic_split(cfg.operations, cfg.digits, split=split, size=size, seed=seed)
    path = cfg.train_path if split == "train" else cfg.test_path
    limit = cfg.eval_size if split == "test" else None
    return load_dataset(cfg.source, split, path=path, limit=limit, data_dir=cfg.data_dir)


def preflight(cfg: RunConfig) -> None:
    """Check, before any training work, that the data, the reward functions and the model can be had.

    Raises:
        DataError / RewardError / ModelError: with one clear line naming what is wrong.
    """
    build_problems(cfg.data, "train", cfg.run.seed)
    build_problems(cfg.data, "test", cfg.run.seed)
    for f in cfg.reward.functions:
        load_reward(f.name)
    model_folder(cfg.model)


def runtime_info(cfg: RunConfig) -> dict[str, Any]:
    """What the run computes on, for the run log, `run.json` and the report: `{"device", "dtype",
    "dtype_reason", "cpu_threads"}` (the dtype `model.dtype` resolved to on the model's device)."""
    choice = model_dtype(cfg.model)
    return {
        "device": str(resolve_device(cfg.model.device)),
        "dtype": choice.name,
        "dtype_reason": choice.reason,
        "cpu_threads": cpu_threads(),
    }


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


class RunSession:
    """Everything one training run needs in this process. Build with `open_session`."""

    def __init__(self, cfg: RunConfig, run_id: str) -> None:
        self.cfg = cfg
        self.run_id = validate_run_id(run_id)
        self.workdir = Path(cfg.run.output_dir) / run_id
        self.store = cfg.store.build()
        configure_threads()
        self.runtime = runtime_info(cfg)
        self.store.write_run_config(run_id, {**cfg.model_dump(mode="json"), "runtime": self.runtime})
        self.run_url = f"{self.store.uri.rstrip('/')}/{run_id}"
        self._fs, self._run_root = fsspec.core.url_to_fs(self.run_url, **cfg.store.storage_options)
        self.reward_fns = [(f.name, load_reward(f.name), f.weight) for f in cfg.reward.functions]
        self.train_problems = build_problems(cfg.data, "train", cfg.run.seed)
        self.test_problems = build_problems(cfg.data, "test", cfg.run.seed)
        self.sampler = PromptSampler(self.train_problems, seed=cfg.run.seed)
        _seed_everything(cfg.run.seed)
        self.tokenizer = load_tokenizer(cfg.model)
        self.engine = self._build_engine()
        self.trainer = self._build_trainer()
        self.policy_version: int | None = None  # version the engine serves for rollouts
        self._pending: tuple[dict, dict] | None = None  # tensors of the last publish, for the tensor sync path
        self.checkpoints = CheckpointStore(self.store.uri, cfg.store.storage_options)
        self.restored_step = self._restore()

    def _build_engine(self) -> InferenceEngine:
        """The embedded engine (its own copy of the base model) or HTTP clients of remote engines."""
        e = self.cfg.engine
        if e.type != "embedded":
            return e.build_remote()
        model, _ = load_model(self.cfg.model)
        return EmbeddedEngine(
            model,
            self.tokenizer,
            max_batch_size=e.max_batch_size,
            keep_versions=self.cfg.algorithm.max_staleness + 1,
            max_loras_per_batch=e.max_loras_per_batch,
            max_loaded_loras=e.max_loaded_loras,
            eviction_policy=e.eviction_policy,
            max_lora_rank=e.max_lora_rank,
            store=self.store,
            default_timeout_s=e.timeout_s,
        )

    def _build_trainer(self) -> PolicyTrainer | TrainerWorkers:
        """The in-process trainer (`trainer.world_size: 0`) or persistent FSDP2 worker processes."""
        cfg = self.cfg
        if cfg.trainer.world_size >= 1:
            return TrainerWorkers(cfg, world_size=cfg.trainer.world_size, device=cfg.trainer.device)
        model, _ = load_model(cfg.model)
        return PolicyTrainer(
            apply_lora(model, cfg.lora),
            pad_id=self.tokenizer.pad_token_id,
            algorithm=cfg.algorithm,
            trainer=cfg.trainer,
            temperature=cfg.rollout.temperature,
        )

    def close(self) -> None:
        """Stop the trainer workers and the engine's worker thread."""
        self.trainer.close()
        close_engine = getattr(self.engine, "close", None)
        if close_engine is not None:
            close_engine()

    # ------------------------------------------------------------------ resume
    def _restore(self) -> int:
        """Load the newest checkpoint (trainer, RNG) and serve the newest published version; returns the
        checkpoint step (0 when starting fresh)."""
        step = self.checkpoints.latest(self.run_id)
        if step is not None:
            state = self.checkpoints.load(self.run_id, step)
            self.trainer.load_state_dict(state["trainer"])
            torch.set_rng_state(state["torch_rng"])
            random.setstate((state["python_rng"][0], tuple(state["python_rng"][1]), state["python_rng"][2]))
        latest = self.store.latest(self.run_id)
        if latest is not None:
            self.sync(latest)
        return step or 0

    def resume_info(self) -> dict[str, Any]:
        """Where this session starts, and on what: `{"run_id", "restored_step", "policy_version", "runtime"}`."""
        return {
            "run_id": self.run_id,
            "restored_step": self.restored_step,
            "policy_version": self.policy_version,
            "runtime": self.runtime,
        }

    def save_checkpoint(self, step: int) -> None:
        """Checkpoint the trainer (LoRA weights, optimizer, scheduler), RNG states and data cursor after `step`."""
        state = {
            "step": step,
            "trainer": self.trainer.state_dict(),
            "sampler": self.sampler.state_dict(),
            "torch_rng": torch.get_rng_state(),
            "python_rng": random.getstate(),
        }
        self.checkpoints.save(self.run_id, step, state)
        self.checkpoints.prune(self.run_id, keep_last=self.cfg.trainer.keep_checkpoints)

    # ------------------------------------------------------------------ phases
    def publish(self, step: int, metrics: dict[str, float] | None = None) -> AdapterRef:
        """Write the current LoRA weights to the store as version `step` (immutable)."""
        tensors, config = self.trainer.adapter_state()
        ref = self.store.publish(
            self.run_id,
            step,
            tensors=tensors,
            adapter_config=config,
            step=step,
            base_model=self.cfg.model.name_or_path,
            metrics=_floats(metrics or {}),
            # fault injection fires with the data files written and the manifest not yet: the worst moment
            before_manifest=lambda: maybe_fail("publish_adapter", step, self.run_url, self.cfg.store.storage_options),
        )
        self._pending = (tensors, config)
        return ref

    def sync(self, ref: AdapterRef) -> dict[str, Any]:
        """Make version `ref` the one rollouts use: every engine loads it under its versioned name (tensor
        path: the tensors just published; store path: the engines read the sha256-verified version from the
        store), lists it, and retires versions beyond `max_staleness + 1` that no request holds.

        A version that fails verification or loading is skipped: the previous version stays active.
        """
        if self.policy_version is not None and ref.version < self.policy_version:
            return {"adapter": ref.name, "retired": [], "sync_seconds": 0.0, "skipped_older": True}
        use_tensors = self.cfg.engine.sync == "tensor" and self._pending is not None
        tensors, config = self._pending if use_tensors else (None, None)
        result = sync_version(
            self.engine,
            ref,
            tensors=tensors,
            config=config,
            store=self.store,
            keep=self.cfg.algorithm.max_staleness + 1,
        )
        self._pending = None
        if not result.ok:
            if self.policy_version is None:
                raise EngineError(f"sync of {ref.name} failed and no earlier version is serving: {result.error}")
            return {
                "adapter": self.policy_adapter,
                "skipped": ref.name,
                "error": result.error,
                "retired": [],
                "sync_seconds": result.seconds,
            }
        self.policy_version = ref.version
        return {
            "adapter": ref.name,
            "retired": result.retired,
            "sync_seconds": result.seconds,
            "sync_path": result.path,
        }

    @property
    def policy_adapter(self) -> str:
        """The versioned adapter name rollouts must use."""
        if self.policy_version is None:
            raise LoraRLError("no adapter version has been synced to the engine yet (publish and sync version 0 first)")
        return adapter_name(self.run_id, self.policy_version)

    def rollout(self, step: int) -> dict[str, float]:
        """Sample `group_size` completions for each of `prompts_per_step` prompts with the current
        policy adapter; writes `rollouts/step-N.json`. Returns a small summary."""
        maybe_fail("rollout", step, self.run_url, self.cfg.store.storage_options)
        start = time.perf_counter()
        r = self.cfg.rollout
        # The batch is a function of the step (cursor = (step - 1) * prompts), so a resumed run draws the same prompts.
        epoch, index = divmod((step - 1) * r.prompts_per_step, len(self.train_problems))
        self.sampler.load_state_dict({"epoch": epoch, "index": index, "seed": self.sampler.seed})
        problems = self.sampler.next_batch(r.prompts_per_step)
        params = SamplingParams(
            max_new_tokens=r.max_new_tokens,
            temperature=r.temperature,
            top_p=r.top_p,
            top_k=r.top_k,
            seed=stable_seed(self.cfg.run.seed, "rollout", step),
        )
        prompts = [
            render_prompt(self.tokenizer, p, system_prompt=r.system_prompt, instruction=r.instruction) for p in problems
        ]
        requests = [GenerationRequest(ids, self.policy_adapter, params) for ids in prompts for _ in range(r.group_size)]
        completions = self.engine.generate(requests, inline=True)  # the training thread computes (see EmbeddedEngine)
        aborted = [c for c in completions if c.finish_reason == "abort"]
        if aborted:  # a group with missing samples would skew its advantages: fail the phase, let a retry redo it
            reason = aborted[0].abort_reason
            raise EngineError(f"{len(aborted)} of {len(completions)} rollout requests aborted ({reason})")
        rows = [
            {
                "group": i // r.group_size,
                "problem_id": problems[i // r.group_size].id,
                "answer": problems[i // r.group_size].answer,
                "prompt_ids": c.prompt_ids,
                "completion_ids": c.completion_ids,
                "logprobs": c.logprobs,
                "finish_reason": c.finish_reason,
                "adapter": c.adapter,
                "adapter_version": c.adapter_version,
            }
            for i, c in enumerate(completions)
        ]
        self._write_phase("rollouts", step, {"step": step, "sampler": self.sampler.state_dict(), "rows": rows})
        seconds = time.perf_counter() - start
        tokens = sum(len(row["completion_ids"]) for row in rows)
        return {
            "completions": float(len(rows)),
            "completion_tokens": float(tokens),
            "rollout_seconds": seconds,
            "completions_per_second": len(rows) / seconds,
            "completion_length": tokens / len(rows),
            "truncated_fraction": sum(row["finish_reason"] == "length" for row in rows) / len(rows),
        }

    def score(self, step: int) -> dict[str, float]:
        """Reward every completion of step `step` and compute group advantages; writes `scored/step-N.json`."""
        maybe_fail("score", step, self.run_url, self.cfg.store.storage_options)
        start = time.perf_counter()
        rows = self._read_phase("rollouts", step)["rows"]
        texts = [self.tokenizer.decode(row["completion_ids"], skip_special_tokens=True) for row in rows]
        totals, per_fn = score_completions(texts, [row["answer"] for row in rows], self.reward_fns)
        rewards_NG = torch.tensor(totals, dtype=torch.float32).view(-1, self.cfg.rollout.group_size)  # [N, G]
        advantages_NG = ADVANTAGE_ESTIMATORS[self.cfg.algorithm.advantage](rewards_NG)
        signal_N = group_has_signal(rewards_NG)
        for i, row in enumerate(rows):
            row.update(
                reward=totals[i],
                rewards={k: v[i] for k, v in per_fn.items()},
                advantage=float(advantages_NG.view(-1)[i]),
                has_signal=bool(signal_N[row["group"]]),
            )
        self._write_phase("scored", step, {"step": step, "rows": rows})
        correct = per_fn.get("math", totals)
        return {
            "reward_mean": float(rewards_NG.mean()),
            "reward_std": float(rewards_NG.std(unbiased=False)),
            "accuracy": sum(1.0 for c in correct if c >= 1.0) / len(correct),
            "groups_with_signal": float(signal_N.float().mean()),
            "score_seconds": time.perf_counter() - start,
        }

    def train_step(self, step: int) -> dict[str, float]:
        """One policy update on the scored rollouts of `step`, then a checkpoint every `checkpoint_every` steps.

        The trainer holds version `step - 1` here; rows sampled by a version more than `max_staleness`
        behind it are rejected. With `skip_uniform_groups`, only groups whose rewards differ are trained on.
        """
        maybe_fail("train_step", step, self.run_url, self.cfg.store.storage_options)
        rows = self._read_phase("scored", step)["rows"]
        limit = self.cfg.algorithm.max_staleness
        fresh = [r for r in rows if r["adapter_version"] is not None and step - 1 - r["adapter_version"] <= limit]
        used = [r for r in fresh if r["has_signal"] or not self.cfg.algorithm.skip_uniform_groups]
        batch = TrainBatch(
            [r["prompt_ids"] for r in used],
            [r["completion_ids"] for r in used],
            [r["advantage"] for r in used],
            [r["logprobs"] for r in used],
        )
        metrics = self.trainer.train_step(batch)
        if step % self.cfg.trainer.checkpoint_every == 0:
            self.save_checkpoint(step)
        return {**metrics, "stale_rejected": float(len(rows) - len(fresh))}

    def evaluate(self, adapter: str | None) -> dict[str, Any]:
        """Greedy accuracy of `adapter` (None = base model) on the held-out problems."""
        cfg = self.cfg
        return evaluate_accuracy(
            self.engine,
            self.tokenizer,
            self.test_problems,
            adapter=adapter,
            rollout=cfg.rollout,
            max_new_tokens=cfg.run.eval_max_new_tokens or cfg.rollout.max_new_tokens,
        )

    def _write_phase(self, phase: str, step: int, data: dict[str, Any]) -> None:
        """Write a phase's output to `<store>/<run>/<phase>/step-NNNNNN.json` (any machine can read it back)."""
        self._fs.makedirs(f"{self._run_root}/{phase}", exist_ok=True)
        self._fs.pipe_file(f"{self._run_root}/{phase}/step-{step:06d}.json", json.dumps(data).encode())

    def _read_phase(self, phase: str, step: int) -> dict[str, Any]:
        path = f"{self._run_root}/{phase}/step-{step:06d}.json"
        try:
            return json.loads(self._fs.cat_file(path))
        except FileNotFoundError:
            raise LoraRLError(f"{phase} output of step {step} not found at {path}: run that phase first") from None


def _floats(metrics: dict[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in metrics.items() if isinstance(v, int | float)}


def open_session(cfg: RunConfig, run_id: str) -> RunSession:
    """Build (or return the already open) session for `run_id` in this process."""
    with _REGISTRY_LOCK:
        if run_id not in _SESSIONS:
            _SESSIONS[run_id] = RunSession(cfg, run_id)
        return _SESSIONS[run_id]


def get_session(run_id: str) -> RunSession:
    """The open session of `run_id`; LoraRLError if this process has none."""
    try:
        return _SESSIONS[run_id]
    except KeyError:
        raise LoraRLError(f"run {run_id!r} has no open session in this process (open_session first)") from None


def close_session(run_id: str) -> None:
    """Drop the session (models, engine, optimizer) of `run_id` from this process."""
    with _REGISTRY_LOCK:
        session = _SESSIONS.pop(run_id, None)
    if session is not None:
        session.close()
