"""PPO's critic on the policy's own frozen base (`algorithm.advantage: gae`): a second LoRA adapter, `critic`,
and a value head `Linear(hidden, 1)` on the last hidden state (divided by sqrt(hidden), `Critic.values_BT`
says why), trained at full rank and saved with the critic's adapter (PEFT `modules_to_save`).

One copy of the base weights serves both adapters, in one process or sharded over FSDP2 ranks: SkyRL, OpenRLHF
and verl load a second model for the critic (15 GB more at 7B). Each adapter takes its own forward and backward
over the shared base; `critic_seconds` in the step's metrics is what the critic's passes cost.

PEFT's pitfalls, and what is done about them:
- `set_adapter` turns `requires_grad` off on the inactive adapter: each optimizer holds its own parameters by
  name (`is_critic_param`), whichever adapter is active, and a backward reaches only the active one's.
- `modules_to_save` wraps only modules that exist when the adapter is added: the head is attached to the model
  before PEFT wraps it (`with_adapters`), after the policy's targets are resolved (so `all-linear` does not
  adapt the head).
- PEFT 0.21 returns the head's original weights in the policy adapter's state dict; the policy's exports leave
  them out (`distributed.peft_adapter_state`), so the critic is never published.

Sources: the critic's value loss and GAE follow verl (`verl/trainer/ppo/core_algos.py`), the value head on the
last hidden state TRL's `AutoModelForCausalLMWithValueHead` and verl's token-classification critic.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from torch import nn

from lora_rl_core import distributed
from lora_rl_core.algorithm.gae import explained_variance, gae_advantages, masked_whiten, token_rewards, value_loss
from lora_rl_core.lora import peft_lora_config
from lora_rl_core.records import TrainBatch
from lora_rl_core.trainer.batching import PackedBatch, frame
from lora_rl_core.trainer.plan import CriticSettings, OptimizerSettings, TrainerPlan

POLICY = "default"
"""The policy adapter's PEFT name (what is published)."""
CRITIC = "critic"
"""The critic adapter's PEFT name (checkpointed, never published)."""
VALUE_HEAD = "value_head"
"""The value head's attribute on the causal LM (`model.value_head`), PEFT's `modules_to_save` of the critic."""


def is_critic_param(name: str) -> bool:
    """Whether the parameter `name` (a PEFT model's) is the critic's: its LoRA weights or its head's copy."""
    return f".{CRITIC}." in name


def with_adapters(model: nn.Module, plan: TrainerPlan) -> PeftModel:
    """`model` wrapped with the policy's LoRA adapter and, with `plan.critic`, the critic's adapter and head.

    Call with the same seed on every rank (the adapters' and head's init). Every adapter's parameters require
    grad on return, so that FSDP2 (`distributed.shard_model`) keeps them whole on every rank; the trainer then
    makes the policy active (`PolicyTrainer`).

    Raises:
        ConfigError: a LoRA's target or exclude modules match no linear module (naming `lora` or `critic.lora`).
    """
    policy_config = peft_lora_config(model, plan.lora)
    critic = plan.critic
    if critic is None:
        return _wrap(model, policy_config)
    critic_config = peft_lora_config(model, critic.lora, section="critic.lora", modules_to_save=[VALUE_HEAD])
    _attach_value_head(model, critic.head_init_std)  # after the targets: `all-linear` must not adapt the head
    peft_model = _wrap(model, policy_config)
    peft_model.add_adapter(CRITIC, critic_config)
    value_head(peft_model).modules_to_save[
        CRITIC
    ].float()  # trained at full rank in float32, like the LoRA weights (the frozen original keeps the base dtype)
    for name, param in peft_model.named_parameters():
        if is_critic_param(name):
            param.requires_grad_(True)
    return peft_model


def value_head(model: PeftModel) -> Any:
    """The value head's PEFT wrapper (`ModulesToSaveWrapper`: the critic's trained copy in use while the critic is
    active, the frozen original otherwise)."""
    base: Any = model.base_model
    return base.model.get_submodule(VALUE_HEAD)


def set_adapter(model: PeftModel, name: str) -> None:
    """Make adapter `name` the active one (PEFT `LoraModel.set_adapter`: its parameters then require grad, the
    other adapter's do not)."""
    base: Any = model.base_model
    base.set_adapter(name)


def _wrap(model: nn.Module, config: LoraConfig) -> PeftModel:
    """`get_peft_model` with a config resolved before the value head was attached."""
    return get_peft_model(model, config, adapter_name=POLICY)


def _attach_value_head(model: Any, init_std: float) -> None:
    """`model.value_head = Linear(hidden, 1)` in the base weights' dtype and device, zeros or normal(0, std)."""
    embeddings = model.get_input_embeddings()
    weight = embeddings.weight
    head = nn.Linear(weight.shape[1], 1, dtype=weight.dtype, device=weight.device)
    with torch.no_grad():
        if init_std > 0:
            head.weight.normal_(0.0, init_std)
        else:
            head.weight.zero_()
        head.bias.zero_()
    setattr(model, VALUE_HEAD, head)


@dataclass
class RowTargets:
    """One row's critic targets, each `[tokens]` float32 on the CPU: the critic's values before the update,
    GAE's returns, and the whitened advantages the policy trains on."""

    values: torch.Tensor
    returns: torch.Tensor
    advantages: torch.Tensor


class Critic:
    """The critic's adapter, head, optimizer and scheduler over a model `with_adapters` built.

    Args:
        model: the PEFT model holding both adapters (sharded or not).
        settings: the critic's (`CriticSettings`). optimizer: the policy's AdamW settings (betas, weight decay,
            warm-up steps are shared; the learning rate and clip are the critic's).
        autocast: the trainer's forward context (the LoRA compute dtype).
    """

    def __init__(
        self,
        model: PeftModel,
        settings: CriticSettings,
        optimizer: OptimizerSettings,
        autocast: Callable[[], contextlib.AbstractContextManager[object]],
    ) -> None:
        self.model = model
        self.settings = settings
        named = [(name, p) for name, p in model.named_parameters() if is_critic_param(name)]
        self.param_names = [name for name, _ in named]
        self.params = [p for _, p in named]
        self.optimizer = torch.optim.AdamW(
            self.params, lr=settings.lr, betas=optimizer.betas, weight_decay=optimizer.weight_decay
        )
        warmup = max(1, optimizer.warmup_steps)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: min(1.0, (s + 1) / warmup))
        self.updates = 0
        self.autocast = autocast
        self.seconds = 0.0
        self._active = False

    @property
    def pretraining(self) -> bool:
        """Whether this step trains the critic alone (`critic.pretrain_steps` not yet done)."""
        return self.updates < self.settings.pretrain_steps

    def state_bytes(self) -> int:
        """The critic's float32 state: adapter and head weights, their gradients and AdamW's two moments."""
        return 4 * sum(p.numel() for p in self.params) * 4

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """The critic's adapter active (its head's copy in use) for the block; the policy's after it. Nested
        blocks switch once: the backward after a forward needs the critic's parameters to still require grad."""
        outermost = not self._active
        if outermost:
            set_adapter(self.model, CRITIC)
            self._active = True
        try:
            yield
        finally:
            if outermost:
                set_adapter(self.model, POLICY)
                self._active = False

    @contextlib.contextmanager
    def timed(self) -> Iterator[None]:
        """Adds the block's wall time to `seconds` (the device's queue is drained first on a GPU, so the time is
        the critic's work, not the policy's before it)."""
        device = next(self.model.parameters()).device
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        try:
            yield
        finally:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            self.seconds += time.perf_counter() - start

    def values_BT(self, packed: PackedBatch) -> torch.Tensor:
        """`[b, F]` float32 values of the frame's positions (the state before each completion token), from the
        last hidden state through the head; with gradient unless called under `torch.no_grad`."""
        with self.active():
            with self.autocast():
                out = self.model(
                    input_ids=packed.input_ids,
                    attention_mask=packed.attention_mask,
                    use_cache=False,
                    logits_to_keep=1,  # the head reads the hidden states: one position of logits is all it makes
                    output_hidden_states=True,
                )
            hidden = out.hidden_states[-1][:, packed.frame_start : -1]  # [b, F, H], after the final norm
            # Adam moves each of the head's H weights by about its lr per step, so the values by about lr x sum|h|:
            # 1.2 at 135M with the default lr (3e-3), 10 at 7B. The head reads h / sqrt(H), which leaves about
            # lr x sqrt(H) x mean|h| (0.07 and 0.2): the critic learns without overshooting the rewards' scale.
            values: torch.Tensor = value_head(self.model)(hidden.float() * hidden.shape[-1] ** -0.5).squeeze(-1)
        return values

    @torch.no_grad()
    def targets(
        self,
        batch: TrainBatch,
        micros: list[tuple[list[int], PackedBatch]],
        old_logprobs: dict[int, torch.Tensor] | None,
        ref_logprobs_BT: Callable[[PackedBatch], torch.Tensor],
    ) -> tuple[dict[int, RowTargets], dict[str, float]]:
        """Values, GAE returns and batch-whitened advantages of this rank's rows (`micros`: its micro-batches,
        packed; a dummy one has no rows), before any update of this step.

        The task's reward goes at each completion's last token; with `kl_coef` > 0 each token's reward also
        loses `kl_coef * (log pi_old - log pi_ref)` (verl `apply_kl_penalty`, k1 estimator). A cut completion
        is not bootstrapped (`gae_advantages`: no value after the last token). The advantages are whitened over
        the whole batch, every rank's rows (verl `compute_gae_advantage_return`: `masked_whiten(advantages,
        response_mask)`, OpenRLHF, SkyRL), with two statistics:
        - the mean over every row's tokens, the rows only the critic trains on (`TrainBatch.value_only`, cut at
          the token limit under `truncation: mask`) included: with a critic that explains little, this mean is
          the batch's baseline, and being cut (reward 0) must be in it for ending to be paid, as a GRPO group's
          mean counts its cut rows (the policy rows' own mean would make ending with a low reward look worse
          than rambling, the failure the value-only rows fixed);
        - the scale from the rows the policy's loss covers alone: their advantages' mean square about that mean
          is 1 (`masked_whiten`'s `scale_mask_BT`). verl, OpenRLHF and SkyRL whiten exactly the tokens in the
          loss, which gives them unit scale; a std taken over every row instead would be shrunk by the cut
          rows' near-0 advantages and scale the few rows that ended by up to sqrt(tokens / their tokens): 5
          ended rows among 59 cut ones got about +5 per token, the step's gradient several times that of a
          step with no cut row. With no `value_only` row both statistics are verl's.

        Returns:
            `{row: RowTargets}` of this rank's rows, and the step's global `value_mean` (before the update),
            `explained_variance` (of those values for the returns), `return_mean`, `kl_in_reward` (mean per
            token; 0 without KL).
        """
        s = self.settings
        rows: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        kl_sum = 0.0
        for micro, packed in micros:
            values_BT = self.values_BT(packed)
            if not micro:
                continue  # a dummy pass: it keeps FSDP2's collectives matched, no row is in it
            kl_BT = None
            if s.kl_coef > 0:
                assert old_logprobs is not None  # the trainer computes them whenever the KL is in the reward
                kl_BT = (frame([old_logprobs[i] for i in micro], packed.mask_BT) - ref_logprobs_BT(packed)) * (
                    packed.mask_BT
                )
                kl_sum += float(kl_BT.sum())
            # in the packed frame: a row's completion starts where its prompt ends; the masked GAE skips the rest
            scores_B = torch.tensor([batch.rewards[i] for i in micro], dtype=torch.float32)
            token_r = token_rewards(scores_B, packed.mask_BT, kl_BT=kl_BT, kl_coef=s.kl_coef)
            advantages, returns = gae_advantages(token_r, values_BT, packed.mask_BT, gamma=s.gamma, lam=s.lam)
            for j, row in enumerate(micro):
                real = packed.mask_BT[j].bool()
                rows[row] = (values_BT[j, real].cpu(), returns[j, real].cpu(), advantages[j, real].cpu())
        order = sorted(rows)
        flat = [torch.cat([rows[i][k] for i in order]) if order else torch.zeros(0) for k in range(3)]
        # 1 on the tokens of the rows the policy's loss covers: they set the whitening's scale
        policy = [torch.full_like(rows[i][2], float(batch.trains_policy(i))) for i in order]
        flat.append(torch.cat(policy) if order else torch.zeros(0))
        gathered = [distributed.all_gather_cat(x) for x in flat]
        (values_N, _), (returns_N, _), (advantages_N, start), (policy_N, _) = gathered
        ones = torch.ones(1, advantages_N.numel())
        whitened_N = (
            masked_whiten(advantages_N[None].cpu(), ones, scale_mask_BT=policy_N[None].cpu())[0]
            if advantages_N.numel()
            else advantages_N
        )
        own = whitened_N[start : start + flat[2].numel()].cpu().split([rows[i][2].numel() for i in order])
        out = {i: RowTargets(rows[i][0], rows[i][1], a) for i, a in zip(order, own, strict=True)}
        tokens = max(1, values_N.numel())
        kl_mean = distributed.all_reduce_sum({"kl": kl_sum})["kl"] / tokens
        metrics = {
            "value_mean": float(values_N.sum()) / tokens,
            "return_mean": float(returns_N.sum()) / tokens,
            "explained_variance": float(explained_variance(values_N[None].cpu(), returns_N[None].cpu(), ones)),
            "kl_in_reward": kl_mean,
        }
        return out, metrics

    def backward(
        self, packed: PackedBatch, targets: list[RowTargets], weight: float, aggregation: str
    ) -> dict[str, torch.Tensor]:
        """The value loss of one micro-batch (`targets`: its rows'; empty for a dummy pass; `aggregation`: the
        policy loss's, which `weight` was made for), its backward scaled by `weight * loss_coef`; its metrics
        as 0-dim tensors on the device."""
        s = self.settings
        with self.active():  # the backward too: a recomputed layer must see the adapter its forward saw
            values_BT = self.values_BT(packed)
            old_BT = frame([t.values for t in targets], packed.mask_BT) if targets else values_BT.detach()
            returns_BT = frame([t.returns for t in targets], packed.mask_BT) if targets else values_BT.detach()
            loss, m = value_loss(
                values_BT, old_BT, returns_BT, packed.mask_BT, value_clip=s.value_clip, aggregation=aggregation
            )
            (loss * s.loss_coef * weight).backward()
        m["value_loss"] = loss.detach() * s.loss_coef
        return m

    def step(self) -> dict[str, float]:
        """One AdamW step of the critic: gradients summed over ranks, clipped to `max_grad_norm`."""
        distributed.sum_gradients(self.params)
        grad_norm = distributed.clip_grad_norm_(self.params, self.settings.max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return {"critic_grad_norm": grad_norm, "critic_lr": float(self.scheduler.get_last_lr()[0])}

    def end_step(self) -> None:
        """After every minibatch of a step: the critic's warm-up counts one step more."""
        self.scheduler.step()
        self.updates += 1
