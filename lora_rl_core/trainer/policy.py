"""Policy trainer: one PPO-clip update of the LoRA parameters per training step.

Choices: the reference policy is the same model with the adapter disabled (no second copy); `old_logprobs` are
recomputed by the trainer (with one minibatch per step they equal the current logprobs, so the ratio is 1 and the
update is the on-policy policy gradient); engine `inference_logprobs` are kept apart and only used for the truncated
importance-sampling correction and the mismatch metric. AdamW on LoRA parameters only, global-norm gradient
clipping, linear warmup. Micro-batches accumulate gradients with weights chosen so the loss equals the full-batch
aggregate (token-mean: tokens / total tokens).

Mixed precision (`trainer.lora_compute_dtype`): the LoRA weights, their gradients and the AdamW state are float32
(master weights). In `bfloat16` the model's forward passes (policy, reference, old logprobs) run under
`torch.autocast` and PEFT's input cast to float32 is off (`lora.set_input_dtype_casting`), so the LoRA matmuls run
in bfloat16 on the base model's activations; the logits are turned to float32 before the log-softmax, and the loss
and the backward call are outside autocast.

Sharded training (FSDP2, `lora_rl_core.distributed`): when a process group is up, build the trainer after
`shard_model`; every rank then calls `train_step` with the SAME whole batch and trains on its share. Within each
minibatch the rows, sorted by length, are dealt round-robin to the ranks (balanced tokens; `rank_micro_batches`),
and each rank cuts its rows into micro-batches. Loss weights use the whole minibatch's token / sequence counts,
which every rank knows without an all-reduce because it holds the whole batch; the LoRA gradients are summed over
ranks once per minibatch (`distributed.sum_gradients`: the LoRA weights are replicated, only the base weights
sharded), so the update equals the single-process one. A rank with fewer micro-batches runs zero-weight dummy passes
so that FSDP's collectives stay matched. Metrics are all-reduced: every rank returns the global values. Sending the
whole batch (token-id lists) to every rank costs little and keeps minibatch boundaries identical to a single
process.

Checkpoints: each rank writes its own part (`save_checkpoint`); loaded whole (`load_state_dict`), keyed by parameter
FQN, so a state saved at one world size loads at any other (`trainer.state`).

PPO (`algorithm.advantage: gae`): a critic adapter and value head on the same base (`trainer.critic`). Before the
update, one pass computes its values (and the reference's log-probs when the KL goes in the reward); GAE makes
per-token advantages, whitened over the batch; each micro-batch then takes the policy's backward and the critic's,
and each its own optimizer step. For `critic.pretrain_steps` steps only the critic trains.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import time
import traceback
from typing import Any

import torch
from peft import PeftModel

from lora_rl_core import distributed
from lora_rl_core.algorithm import (
    m2po_weights,
    off_policy_weights,
    ppo_clip_loss,
    token_logprobs,
    token_logprobs_and_entropy,
)
from lora_rl_core.checkpoint import CheckpointTarget, ShardReport
from lora_rl_core.config import M2POCorrection
from lora_rl_core.errors import LoraRLError, TrainerOutOfMemoryError
from lora_rl_core.lora import cpu_copies, peft_config_dict, set_input_dtype_casting
from lora_rl_core.records import TrainBatch
from lora_rl_core.runtime import DTYPES
from lora_rl_core.trainer.batching import (
    PackedBatch,
    dummy_batch,
    frame,
    pack,
    padding_fraction,
    rank_micro_batches,
    split_even,
)
from lora_rl_core.trainer.critic import POLICY, Critic, RowTargets, is_critic_param, set_adapter
from lora_rl_core.trainer.kernels import compile_layers
from lora_rl_core.trainer.plan import TrainerPlan
from lora_rl_core.trainer.reduce import MAX_KEYS, accumulate, all_reduce_metrics, m2po_batch_keep
from lora_rl_core.trainer.shards import ShardWriter
from lora_rl_core.trainer.state import gather_state, load_state, local_state

log = logging.getLogger(__name__)


class PolicyTrainer:
    """Owns the trainable LoRA policy, its optimizer and scheduler.

    Args:
        model: a PeftModel whose only trainable parameters are the LoRA weights; for sharded training,
            already passed through `distributed.shard_model` (the process group decides rank and world size).
        plan: the trainer's plan (`TrainerPlan`: the loss and optimizer settings, every `auto` resolved: the
            LoRA compute dtype, the micro-batch, gradient checkpointing, the off-policy correction).
            Gradient checkpointing and `torch_compile` (each decoder layer compiled) are applied here for an
            in-process trainer; sharded ranks get checkpointing per decoder layer from `shard_model`.
        pad_id: the tokenizer's pad token id.
    """

    def __init__(self, model: PeftModel, plan: TrainerPlan, *, pad_id: int) -> None:
        self.model = model
        self.pad_id = pad_id
        self.plan = plan
        self.loss = plan.loss
        self.temperature = plan.temperature
        trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad and not is_critic_param(n)]
        self.param_names = [name for name, _ in trainable]
        self.params = [p for _, p in trainable]
        self.rank, self.world_size = distributed.rank_and_world_size()
        opt = plan.optimizer
        self.optimizer = torch.optim.AdamW(self.params, lr=opt.lr, betas=opt.betas, weight_decay=opt.weight_decay)
        warmup = max(1, opt.warmup_steps)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: min(1.0, (s + 1) / warmup))
        self.compute_dtype = DTYPES[plan.lora_compute_dtype]
        if self.compute_dtype != torch.float32:
            set_input_dtype_casting(model, enabled=False)  # autocast casts the float32 LoRA weights instead
        if plan.torch_compile:  # the plan allows it in-process only (`choose_compile`)
            layers = compile_layers(model)
            log.info("trainer: %d decoder layers compiled (trainer.torch_compile); step 1 pays the compilation", layers)
        if plan.gradient_checkpointing and plan.world_size == 0:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            model.enable_input_require_grads()
        self._shard_writer: ShardWriter | None = None  # made by the first checkpoint
        self.critic = Critic(model, plan.critic, opt, self._autocast) if plan.critic is not None else None
        if self.critic is not None:
            set_adapter(model, POLICY)  # the policy's adapter active between the critic's passes

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """One training step: `algorithm.num_minibatches` optimizer steps over `batch`.

        Sharded: every rank passes the same whole batch and trains on its share (module docstring).

        Returns:
            metrics (global over ranks): loss, pg_loss, clip_fraction, kl, entropy (nats/token), grad_norm
            (pre-clip), ratio_mean/ratio_max, logprob_mismatch (mean |trainer - inference| logprob), with an
            off-policy correction is_weight_mean/is_weight_max/is_masked_fraction (`off_policy_weights`), lr,
            padding_fraction (of the positions this rank's forwards computed, `batching.padding_fraction`:
            rank 0's share on a sharded trainer, not global),
            train_sequences (the rows the policy's loss covers), value_only_sequences (the critic's alone, where
            the batch has any), train_tokens, train_seconds. An empty batch skips the update; the policy's
            optimizer does not step on a batch without a row for it.
        """
        start = time.perf_counter()
        if len(batch) == 0:
            return {
                "train_sequences": 0.0,
                "train_tokens": 0.0,
                "train_seconds": 0.0,
                "lr": float(self.scheduler.get_last_lr()[0]),
            }
        chunks = list(split_even(len(batch), self.loss.num_minibatches))
        lengths = batch.row_lengths()
        schedules = [self._micro_batches(lengths, rows) for rows in chunks]
        sums: dict[str, float] = {}
        correction = self.loss.off_policy_correction
        m2po = isinstance(correction, M2POCorrection)
        critic = self.critic
        kl_in_reward = critic is not None and critic.settings.kl_coef > 0
        # the policy sits out the critic's warm-up, and a batch whose rows are all the critic's (`value_only`)
        policy_trains = (critic is None or not critic.pretraining) and batch.policy_rows() > 0
        try:
            # one pass before the update where the minibatches need the policy before it, M2PO the whole batch,
            # or the critic's reward its KL
            needs_old = self.loss.num_minibatches > 1 or m2po or kl_in_reward
            old_logprobs = self._old_logprobs(batch, schedules) if needs_old else None
            keep: dict[int, torch.Tensor] | None = None
            m2: dict[str, float] = {}
            if isinstance(correction, M2POCorrection) and old_logprobs is not None:
                keep, m2 = m2po_batch_keep(batch, old_logprobs, correction.m2_threshold)
            targets: dict[int, RowTargets] | None = None
            packed: list[list[PackedBatch] | None] = [None] * len(schedules)  # packed once where reused
            if critic is not None:
                critic.seconds = 0.0
                with critic.timed():
                    ready = [[self._pack(batch, m) for m in ms] for ms in schedules]
                    pairs = [
                        (m, p) for ms, ps in zip(schedules, ready, strict=True) for m, p in zip(ms, ps, strict=True)
                    ]
                    targets, value_metrics = critic.targets(batch, pairs, old_logprobs, self._ref_logprobs)
                packed = list(ready)
                m2.update(value_metrics)
            for rows, micros, ps in zip(chunks, schedules, packed, strict=True):
                update = self._minibatch_update(batch, rows, micros, ps, old_logprobs, keep, targets, policy_trains)
                for k, v in update.items():
                    sums[k] = max(sums.get(k, v), v) if k in MAX_KEYS else sums.get(k, 0.0) + v / len(chunks)
            for _ in range(critic.settings.epochs - 1 if critic is not None else 0):  # the critic's later passes
                for rows, micros, ps in zip(chunks, schedules, packed, strict=True):
                    self._minibatch_update(batch, rows, micros, ps, None, None, targets, policy_trains=False)
            sums.update(m2)
        except torch.OutOfMemoryError as exc:  # raised below, once the frames holding the activations are gone
            out_of_memory: str | None = (str(exc).splitlines() or [type(exc).__name__])[0]
            log.warning("the trainer's update ran out of GPU memory:\n%s", traceback.format_exc())
        else:
            out_of_memory = None
        if out_of_memory is not None:
            self.optimizer.zero_grad(set_to_none=True)  # the half-summed gradients go with the activations
            self.model.eval()
            gc.collect()  # the failed frames' reference cycles, so that their activations can be given back
        if (self.plan.empty_cache_after_step or out_of_memory is not None) and self.device.type == "cuda":
            torch.cuda.empty_cache()  # SGLang takes its KV cache back on this GPU next (the memory saver)
        if out_of_memory is not None:
            raise self._out_of_memory(len(batch), max(lengths), out_of_memory)
        if policy_trains:
            self.scheduler.step()
        if critic is not None:
            critic.end_step()
            sums.update(
                critic_seconds=critic.seconds,
                critic_state_bytes=float(critic.state_bytes()),
                policy_trained=float(policy_trains),
            )
        tokens = sum(len(c) for c in batch.completion_ids)
        return {
            **sums,
            "padding_fraction": padding_fraction(lengths, [m for micros in schedules for m in micros]),
            "train_sequences": float(batch.policy_rows()),
            **({"value_only_sequences": float(len(batch) - batch.policy_rows())} if batch.value_only else {}),
            "train_tokens": float(tokens),
            "train_seconds": time.perf_counter() - start,
            "lr": float(self.scheduler.get_last_lr()[0]),
        }

    def _out_of_memory(self, rows: int, longest: int, detail: str) -> TrainerOutOfMemoryError:
        """The error for an update of `rows` rows that ran out of GPU memory (`detail`: CUDA's first line): the
        batch's longest row in tokens, the micro-batch, and the settings that lower the need."""
        ckpt = self.plan.gradient_checkpointing
        fixes = "rollout.max_new_tokens or trainer.micro_batch_size" + (
            "" if ckpt else ", or set trainer.gradient_checkpointing=true"
        )
        return TrainerOutOfMemoryError(
            f"the trainer ran out of GPU memory in its update ({rows} rows, the longest {longest} tokens, "
            f"micro-batch {self.plan.micro_batch_size}, gradient checkpointing {'on' if ckpt else 'off'}): "
            f"{detail}. Lower {fixes}"
        )

    def profiled_train_step(self, batch: TrainBatch, row_limit: int = 25) -> tuple[dict[str, float], str]:
        """`train_step` under `torch.profiler` (CPU, and CUDA on a GPU): for benchmarks and for finding where a
        train phase goes. Sharded: every rank calls it and profiles its own share.

        Returns:
            the step's metrics, and this rank's report: one line with the wall seconds and the seconds the
            device spent in kernels (`device busy`: far below the wall means the host, launches or waiting on
            other ranks bound the step), then the `row_limit` operators that took the most device time.
        """
        from torch.profiler import ProfilerActivity, profile

        cuda = self.device.type == "cuda"
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=activities) as prof:
            metrics = self.train_step(batch)
            if cuda:
                torch.cuda.synchronize(self.device)
        events = prof.key_averages()
        busy_us = sum(e.self_device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
        sort = "self_cuda_time_total" if cuda else "self_cpu_time_total"
        head = (
            f"rank {self.rank} of {self.world_size}: train {metrics['train_seconds']:.3f} s wall, "
            f"device busy {busy_us / 1e6:.3f} s in kernels"
        )
        return metrics, head + "\n" + events.table(sort_by=sort, row_limit=row_limit, max_name_column_width=70)

    def _micro_batches(self, lengths: list[int], rows: list[int]) -> list[list[int]]:
        """This rank's micro-batches of the minibatch `rows` (`rank_micro_batches`; `lengths`: every row's)."""
        return rank_micro_batches(
            lengths, rows, size=self.plan.micro_batch_size, rank=self.rank, world_size=self.world_size
        )

    def _minibatch_update(
        self,
        batch: TrainBatch,
        rows: list[int],
        micros: list[list[int]],
        packed: list[PackedBatch] | None,
        old: dict[int, torch.Tensor] | None,
        keep: dict[int, torch.Tensor] | None,
        targets: dict[int, RowTargets] | None = None,
        policy_trains: bool = True,
    ) -> dict[str, float]:
        """One optimizer step of the policy (unless `policy_trains` is False) and of the critic (with `targets`)
        over the minibatch `rows`, this rank's `micros` of it (`packed`: them on the device already, None =
        packed here); the minibatch's metrics, global over ranks."""
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        total_tokens = sum(len(batch.completion_ids[i]) for i in rows)
        # the policy's loss leaves the critic's `value_only` rows out: its weights count the other rows alone
        policy_rows = [i for i in rows if batch.trains_policy(i)]
        policy_tokens = max(1, sum(len(batch.completion_ids[i]) for i in policy_rows))
        policy_trains = policy_trains and bool(policy_rows)  # the same on every rank: each has the whole batch
        # Every micro-batch goes to the device before the first forward: a copy from pageable memory waits for
        # the GPU's queue to drain, so packing between backward passes would stall it at each one. Likewise the
        # metrics stay on the device until the minibatch ends. What still waits once per forward is transformers'
        # padding-mask check (tests/gpu/test_trainer_syncs.py).
        packed = packed if packed is not None else [self._pack(batch, micro) for micro in micros]
        sums: dict[str, torch.Tensor] = {}
        token_mean = self.loss.aggregation == "token-mean"
        for micro, micro_packed in zip(micros, packed, strict=True):  # an empty micro is a zero-weight dummy pass
            tokens = sum(len(batch.completion_ids[i]) for i in micro)  # (keeps FSDP collectives matched)
            weight = tokens / total_tokens if token_mean else len(micro) / len(rows)
            if policy_trains:
                ours = [i for i in micro if batch.trains_policy(i)]
                ours_tokens = sum(len(batch.completion_ids[i]) for i in ours)
                policy_weight = ours_tokens / policy_tokens if token_mean else len(ours) / len(policy_rows)
                micro_old = [old[i] for i in micro] if old is not None and micro else None
                micro_keep = [keep[i] for i in micro] if keep is not None else None  # a dummy pass keeps nothing
                advantages = [targets[i].advantages for i in micro] if targets is not None else None
                rows_mask = [batch.trains_policy(i) for i in micro] if batch.value_only and micro else None
                m = self._micro_backward(micro_packed, micro_old, micro_keep, advantages, policy_weight, rows_mask)
                accumulate(sums, m if ours else _zeros(m), policy_weight, ours_tokens / policy_tokens)
            if self.critic is not None and targets is not None:
                with self.critic.timed():
                    rows_targets = [targets[i] for i in micro]
                    m = self.critic.backward(micro_packed, rows_targets, weight, self.loss.aggregation)
                accumulate(sums, m if micro else _zeros(m), weight, tokens / total_tokens)
        metrics = all_reduce_metrics(sums)
        if policy_trains:
            distributed.sum_gradients(self.params)  # the ranks' shares of the minibatch (no-op in one process)
            metrics["grad_norm"] = distributed.clip_grad_norm_(self.params, self.plan.optimizer.max_grad_norm)
            self.optimizer.step()
        if self.critic is not None:
            with self.critic.timed():
                metrics.update(self.critic.step())
        self.model.eval()
        return metrics

    def _pack(self, batch: TrainBatch, micro: list[int]) -> PackedBatch:
        """The micro-batch `micro` of `batch` packed on the device (an empty one: a dummy row)."""
        return pack(batch.select(micro) if micro else dummy_batch(self.pad_id), self.pad_id, self.device)

    def _micro_backward(
        self,
        packed: PackedBatch,
        old: list[torch.Tensor] | None,
        keep: list[torch.Tensor] | None,
        advantages: list[torch.Tensor] | None,
        weight: float,
        rows_mask: list[bool] | None = None,
    ) -> dict[str, torch.Tensor]:
        """Forward, loss and backward of one packed micro-batch (gradients scaled by `weight`; `keep`: M2PO's mask
        of its rows, `m2po_batch_keep`; `advantages`: its rows' per-token GAE advantages, None = the batch's one
        per row; `rows_mask`: False on a row the loss leaves out, a critic's `value_only` row); its metrics as
        0-dim tensors on the device (read once per minibatch)."""
        tau, logits = self.temperature, self._logits(packed)
        logprobs_BT, entropy_BT = token_logprobs_and_entropy(logits, packed.targets_BT, temperature=tau)
        old_BT = logprobs_BT.detach() if old is None else frame(old, packed.mask_BT)
        mask_BT = packed.mask_BT
        if rows_mask is not None:
            mask_BT = mask_BT * torch.tensor(rows_mask, dtype=mask_BT.dtype, device=mask_BT.device)[:, None]
        ref_BT = self._ref_logprobs(packed) if self.loss.kl_coef > 0 else None
        weights_BT, is_metrics = None, dict[str, torch.Tensor]()
        correction = self.loss.off_policy_correction
        if keep is not None:  # M2PO: the whole batch's mask, the kept tokens weighted trainer over sampler
            keep_BT = frame([k.float() for k in keep], packed.mask_BT)
            weights_BT, is_metrics = m2po_weights(old_BT, packed.inference_logprobs_BT, keep_BT, mask_BT)
        elif correction.type != "none":
            weights_BT, is_metrics = off_policy_weights(
                old_BT,
                packed.inference_logprobs_BT,
                mask_BT,
                mode=correction.type,
                **correction.weight_args(),  # the kind's own bounds (cap, floor, geo_low / geo_high)
            )
        loss, m = ppo_clip_loss(
            logprobs_BT,
            old_BT,
            packed.advantages_B if advantages is None else frame(advantages, packed.mask_BT),
            mask_BT,
            importance_weights_BT=weights_BT,
            ref_logprobs_BT=ref_BT,
            clip_eps_low=self.loss.clip_eps_low,
            clip_eps_high=self.loss.clip_eps_high,
            aggregation=self.loss.aggregation,
            kl_coef=self.loss.kl_coef,
        )
        (loss * weight).backward()
        with torch.no_grad():
            n = mask_BT.sum().clamp(min=1)
            m["entropy"] = (entropy_BT * mask_BT).sum() / n
            diff = (logprobs_BT.detach() - packed.inference_logprobs_BT).abs() * mask_BT
            m["logprob_mismatch"] = diff.sum() / n
            m.update(is_metrics)
            m["loss"] = loss.detach()
        return m

    def _logits(self, packed: PackedBatch) -> torch.Tensor:
        """The model's logits `[b, F, V]` (its dtype, not tempered) of the frame: none for the prompt before it."""
        keep = packed.input_ids.shape[1] - packed.frame_start  # positions frame_start .. L-1
        with self._autocast():
            ids, mask = packed.input_ids, packed.attention_mask
            return self.model(input_ids=ids, attention_mask=mask, use_cache=False, logits_to_keep=keep).logits[:, :-1]

    def _logprobs(self, packed: PackedBatch) -> torch.Tensor:
        """The frame's `[b, F]` float32 logprobs of its targets at the sampling temperature (`token_logprobs`)."""
        return token_logprobs(self._logits(packed), packed.targets_BT, temperature=self.temperature)

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        """`torch.autocast` to the LoRA compute dtype (module docstring); nothing when it is float32."""
        if self.compute_dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.compute_dtype)

    @torch.no_grad()
    def _ref_logprobs(self, packed: PackedBatch) -> torch.Tensor:
        with self.model.disable_adapter():
            return self._logprobs(packed)

    @torch.no_grad()
    def _old_logprobs(self, batch: TrainBatch, schedules: list[list[list[int]]]) -> dict[int, torch.Tensor]:
        """This rank's per-row completion logprobs under the current policy (before any update of this step)."""
        result: dict[int, torch.Tensor] = {}
        for micro in (m for micros in schedules for m in micros):
            packed = self._pack(batch, micro)
            lp = self._logprobs(packed)
            for j, row in enumerate(micro):
                result[row] = lp[j][packed.mask_BT[j].bool()].cpu()
        return result

    def close(self) -> None:
        """Stop the compile workers Inductor started for compiled layers (`trainer.torch_compile`); lets callers
        treat `PolicyTrainer` and `TrainerWorkers` alike. A checkpoint write under way finishes first."""
        if self._shard_writer is not None:
            self._shard_writer.close()
        if self.plan.torch_compile:
            from torch._inductor.async_compile import shutdown_compile_workers

            shutdown_compile_workers()

    # ------------------------------------------------------------------ export and checkpoints
    def adapter_state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """The adapter's full weights (PEFT keys, float32 CPU) and JSON-safe PEFT config, like `lora.adapter_state`.

        Raises:
            LoraRLError: called on a rank other than 0 of a sharded trainer (use `gather_adapter_state`).
        """
        tensors, config = _on_rank0(self.gather_adapter_state(), "adapter_state")
        return cpu_copies(tensors), config

    def state_dict(self) -> dict[str, Any]:
        """`gather_state_dict()` of an unsharded trainer (or rank 0), its tensors copied to the CPU.

        Raises:
            LoraRLError: called on a rank other than 0 of a sharded trainer (use `gather_state_dict`).
        """
        state = _on_rank0(self.gather_state_dict(), "state_dict")
        return {**state, "tensors": cpu_copies(state["tensors"])}

    def gather_adapter_state(
        self, adapter_name: str = "default"
    ) -> tuple[dict[str, torch.Tensor], dict[str, Any]] | None:
        """The adapter's full weights (PEFT keys, float32, where they are: not copies,
        `distributed.gather_lora_state`) and JSON-safe PEFT config, like `lora.adapter_state`.

        Sharded: every rank must call it; rank 0 gets the result, other ranks None.
        """
        tensors = distributed.gather_lora_state(self.model, adapter_name)
        if tensors is None:
            return None
        return tensors, peft_config_dict(self.model.peft_config[adapter_name])

    def save_checkpoint(self, target: CheckpointTarget) -> None:
        """Snapshot this rank's part of the state now (`trainer.state.local_state`, CPU copies; no communication)
        and write it to the store in the background (`ShardWriter`); `written_checkpoints` reports the write."""
        self._shard_writer = self._shard_writer or ShardWriter(self.rank)
        self._shard_writer.submit(target, *local_state(self, self.critic, self.world_size))

    def written_checkpoints(self, wait: bool = False) -> list[ShardReport]:
        """This rank's checkpoint writes that ended since the last call (`wait`: all of them, waited for)."""
        return [] if self._shard_writer is None else self._shard_writer.finished(wait)

    def gather_state_dict(self) -> dict[str, Any] | None:
        """Everything needed to resume (`trainer.state.gather_state`: the LoRA weights, AdamW state, scheduler and
        torch RNG of every rank, and the critic's). Sharded: every rank must call it; rank 0 gets the result,
        other ranks None."""
        return gather_state(self, self.critic, self.world_size)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a `state_dict()` saved at any world size (`trainer.state.load_state`). Sharded: every rank
        passes the whole state.

        Raises:
            ValueError: not a trainer state, or its parameters differ (another LoRA rank or target set, or
                another critic).
        """
        load_state(self, self.critic, state, self.rank)


def _zeros(metrics: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A dummy pass's metrics: each zero (its forward and backward only keep FSDP's collectives matched)."""
    return {k: torch.zeros_like(v) for k, v in metrics.items()}


def _on_rank0(value: Any, what: str) -> Any:
    if value is None:
        raise LoraRLError(f"PolicyTrainer.{what}: only rank 0 of a sharded trainer gets it; call gather_{what}")
    return value
