"""Policy trainer: one PPO-clip update of the LoRA parameters per training step.

Choices: the reference policy is the same model with the adapter disabled
(no second copy); `old_logprobs` are recomputed by the trainer (with one
minibatch per step they equal the current logprobs, so the ratio is 1 and the
update is the on-policy policy gradient); engine `inference_logprobs` are kept
apart and only used for the truncated importance-sampling correction and the
mismatch metric. AdamW on LoRA parameters only, global-norm gradient clipping,
linear warmup. Micro-batches accumulate gradients with weights chosen so the
loss equals the full-batch aggregate (token-mean: tokens / total tokens).

Left out here: FSDP sharding (see the distributed-training issue), value
model / GAE.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from peft import PeftModel

from lora_rl_core.algorithm import (
    entropy_from_logits,
    ppo_clip_loss,
    selective_log_softmax,
    truncated_importance_weights,
)
from lora_rl_core.config import AlgorithmConfig, TrainerConfig


@dataclass
class TrainBatch:
    """Sequences to train on, one row per completion.

    Attributes:
        prompt_ids / completion_ids: token ids per row (lists of different lengths).
        advantages: one float per row (broadcast over its completion tokens).
        inference_logprobs: the engine's per-token logprobs of each completion.
    """

    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    advantages: list[float]
    inference_logprobs: list[list[float]]

    def __len__(self) -> int:
        return len(self.completion_ids)

    def select(self, rows: list[int]) -> TrainBatch:
        """The sub-batch of the given row indices."""
        return TrainBatch(
            *[
                [field[i] for i in rows]
                for field in (self.prompt_ids, self.completion_ids, self.advantages, self.inference_logprobs)
            ]
        )


@dataclass
class PackedBatch:
    """A micro-batch as right-padded tensors; `[b, L-1]` tensors are in the shifted (next-token) frame."""

    input_ids: torch.Tensor  # [b, L] long
    attention_mask: torch.Tensor  # [b, L] long
    targets_BT: torch.Tensor  # [b, L-1] long: input_ids shifted left
    mask_BT: torch.Tensor  # [b, L-1] float: 1 on completion tokens
    advantages_B: torch.Tensor  # [b] float
    inference_logprobs_BT: torch.Tensor  # [b, L-1] float, 0 off the completion


def pack(batch: TrainBatch, pad_id: int, device: torch.device) -> PackedBatch:
    """Right-pad prompt+completion rows into tensors, with the completion mask in the shifted frame."""
    rows = [p + c for p, c in zip(batch.prompt_ids, batch.completion_ids, strict=True)]
    b, width = len(rows), max(len(r) for r in rows)
    ids = torch.full((b, width), pad_id, dtype=torch.long)
    attn = torch.zeros((b, width), dtype=torch.long)
    mask = torch.zeros((b, width - 1))
    inf_lp = torch.zeros((b, width - 1))
    for i, (p, c) in enumerate(zip(batch.prompt_ids, batch.completion_ids, strict=True)):
        ids[i, : len(p) + len(c)] = torch.tensor(p + c)
        attn[i, : len(p) + len(c)] = 1
        # token c[j] sits at input position len(p)+j and is predicted from position len(p)+j-1
        mask[i, len(p) - 1 : len(p) - 1 + len(c)] = 1.0
        inf_lp[i, len(p) - 1 : len(p) - 1 + len(c)] = torch.tensor(batch.inference_logprobs[i][: len(c)])
    return PackedBatch(
        input_ids=ids.to(device),
        attention_mask=attn.to(device),
        targets_BT=ids[:, 1:].to(device),
        mask_BT=mask.to(device),
        advantages_B=torch.tensor(batch.advantages, dtype=torch.float32, device=device),
        inference_logprobs_BT=inf_lp.to(device),
    )


_LOSS_KEYS = frozenset({"loss", "pg_loss"})


class PolicyTrainer:
    """Owns the trainable LoRA policy, its optimizer and scheduler.

    Args:
        model: a PeftModel whose only trainable parameters are the LoRA weights.
        pad_id: the tokenizer's pad token id.
        algorithm / trainer: config sections.
        temperature: rollout sampling temperature; logits are divided by it so trainer
            logprobs match the sampling distribution.
    """

    def __init__(
        self, model: PeftModel, *, pad_id: int, algorithm: AlgorithmConfig, trainer: TrainerConfig, temperature: float
    ) -> None:
        self.model = model
        self.pad_id = pad_id
        self.algo = algorithm
        self.cfg = trainer
        self.temperature = temperature
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            self.params, lr=trainer.lr, betas=trainer.betas, weight_decay=trainer.weight_decay
        )
        warmup = max(1, trainer.warmup_steps)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: min(1.0, (s + 1) / warmup))
        if trainer.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            model.enable_input_require_grads()

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """One training step: `algorithm.num_minibatches` optimizer steps over `batch`.

        Returns:
            metrics: loss, pg_loss, clip_fraction, kl, entropy (nats/token), grad_norm (pre-clip),
            ratio_mean/ratio_max, logprob_mismatch (mean |trainer - inference| logprob), lr,
            train_sequences, train_tokens, train_seconds. An empty batch skips the update.
        """
        start = time.perf_counter()
        if len(batch) == 0:
            return {
                "train_sequences": 0.0,
                "train_tokens": 0.0,
                "train_seconds": 0.0,
                "lr": self.scheduler.get_last_lr()[0],
            }
        old_logprobs = self._old_logprobs(batch) if self.algo.num_minibatches > 1 else None
        sums: dict[str, float] = {}
        chunks = list(_split(len(batch), self.algo.num_minibatches))
        for rows in chunks:
            mb = batch.select(rows)
            mb_old = [old_logprobs[i] for i in rows] if old_logprobs is not None else None
            for k, v in self._minibatch_update(mb, mb_old).items():
                sums[k] = max(sums.get(k, v), v) if k == "ratio_max" else sums.get(k, 0.0) + v / len(chunks)
        self.scheduler.step()
        tokens = sum(len(c) for c in batch.completion_ids)
        return {
            **sums,
            "train_sequences": float(len(batch)),
            "train_tokens": float(tokens),
            "train_seconds": time.perf_counter() - start,
            "lr": self.scheduler.get_last_lr()[0],
        }

    def _minibatch_update(self, mb: TrainBatch, old: list[torch.Tensor] | None) -> dict[str, float]:
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        total_tokens = sum(len(c) for c in mb.completion_ids)
        metrics: dict[str, float] = {}
        for rows in _micro_rows(mb, self.cfg.micro_batch_size):
            micro = mb.select(rows)
            tokens = sum(len(c) for c in micro.completion_ids)
            weight = tokens / total_tokens if self.algo.loss_aggregation == "token-mean" else len(rows) / len(mb)
            micro_old = [old[i] for i in rows] if old is not None else None
            for k, v in self._micro_backward(micro, micro_old, weight).items():
                if k == "ratio_max":
                    metrics[k] = max(metrics.get(k, v), v)
                else:  # losses combine like the backward pass; per-token metrics are token-weighted
                    share = weight if k in _LOSS_KEYS else tokens / total_tokens
                    metrics[k] = metrics.get(k, 0.0) + v * share
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.cfg.max_grad_norm)
        self.optimizer.step()
        self.model.eval()
        return {**metrics, "grad_norm": float(grad_norm)}

    def _micro_backward(self, micro: TrainBatch, old: list[torch.Tensor] | None, weight: float) -> dict[str, float]:
        packed = pack(micro, self.pad_id, self.device)
        logits = self._logits(packed)  # [b, L-1, V]
        logprobs_BT = selective_log_softmax(logits, packed.targets_BT)
        old_BT = logprobs_BT.detach() if old is None else _frame(old, packed.mask_BT)
        ref_BT = self._ref_logprobs(packed) if self.algo.kl_coef > 0 else None
        weights_BT = None
        if self.algo.tis_cap is not None:
            weights_BT = truncated_importance_weights(
                old_BT, packed.inference_logprobs_BT, packed.mask_BT, cap=self.algo.tis_cap
            )
        loss, m = ppo_clip_loss(
            logprobs_BT,
            old_BT,
            packed.advantages_B,
            packed.mask_BT,
            clip_eps_low=self.algo.clip_eps_low,
            clip_eps_high=self.algo.clip_eps_high,
            aggregation=self.algo.loss_aggregation,
            importance_weights_BT=weights_BT,
            ref_logprobs_BT=ref_BT,
            kl_coef=self.algo.kl_coef,
        )
        (loss * weight).backward()
        with torch.no_grad():
            n = packed.mask_BT.sum().clamp(min=1)
            m["entropy"] = float((entropy_from_logits(logits.detach()) * packed.mask_BT).sum() / n)
            diff = (logprobs_BT.detach() - packed.inference_logprobs_BT).abs() * packed.mask_BT
            m["logprob_mismatch"] = float(diff.sum() / n)
            m["loss"] = float(loss)
        return m

    def _logits(self, packed: PackedBatch) -> torch.Tensor:
        out = self.model(input_ids=packed.input_ids, attention_mask=packed.attention_mask, use_cache=False)
        return out.logits[:, :-1].float() / self.temperature

    @torch.no_grad()
    def _ref_logprobs(self, packed: PackedBatch) -> torch.Tensor:
        with self.model.disable_adapter():
            return selective_log_softmax(self._logits(packed), packed.targets_BT)

    @torch.no_grad()
    def _old_logprobs(self, batch: TrainBatch) -> list[torch.Tensor]:
        """Per-row completion logprobs under the current policy (before any update of this step)."""
        result: list[torch.Tensor] = [torch.empty(0)] * len(batch)
        for rows in _micro_rows(batch, self.cfg.micro_batch_size):
            packed = pack(batch.select(rows), self.pad_id, self.device)
            lp = selective_log_softmax(self._logits(packed), packed.targets_BT)
            for j, row in enumerate(rows):
                result[row] = lp[j][packed.mask_BT[j].bool()].cpu()
        return result


def _frame(rows: list[torch.Tensor], mask_BT: torch.Tensor) -> torch.Tensor:
    """Scatter per-row completion logprobs back into the `[b, L-1]` shifted frame."""
    out = torch.zeros_like(mask_BT)
    for i, lp in enumerate(rows):
        out[i, mask_BT[i].bool()] = lp.to(out.device)
    return out


def _split(n: int, parts: int) -> Iterator[list[int]]:
    """Split range(n) into `parts` contiguous, nearly equal, non-empty chunks."""
    parts = min(parts, n)
    bounds = [round(i * n / parts) for i in range(parts + 1)]
    for lo, hi in zip(bounds, bounds[1:], strict=False):
        yield list(range(lo, hi))


def _micro_rows(batch: TrainBatch, size: int) -> Iterator[list[int]]:
    """Row indices in micro-batches of `size`, rows sorted by length so padding stays small."""
    order = sorted(range(len(batch)), key=lambda i: len(batch.prompt_ids[i]) + len(batch.completion_ids[i]))
    for i in range(0, len(order), size):
        yield order[i : i + size]
