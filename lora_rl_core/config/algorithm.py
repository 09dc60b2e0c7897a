"""The `algorithm` section: the policy-gradient objective, and its off-policy correction, a section keyed by
`type` (`algorithm.off_policy_correction`: each kind carries only its own bounds)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from lora_rl_core.config.base import RolloutMode, Section, keyed_by_type, refuse_moved_keys


class NoCorrection(Section):
    """`off_policy_correction: none`: no importance weights."""

    type: Literal["none"] = "none"
    """The kind: train on the rollouts as sampled."""

    def weight_args(self) -> dict[str, float]:
        """Keyword arguments of `algorithm.losses.off_policy_weights` for this kind (its bounds)."""
        return {}


class AutoCorrection(Section):
    """`off_policy_correction: auto` (the default): `token-truncate` with `is_cap` 2 in `rollout.mode: async`,
    `none` in sync mode (resolved by the run's plan, `AlgorithmConfig.correction`)."""

    type: Literal["auto"] = "auto"
    """The kind: picked from `rollout.mode`."""


class TruncateCorrection(Section):
    """`token-truncate`: `min(r_t, is_cap)` per token (TIS, Yao et al. 2025; TRL `token_truncate`);
    `sequence-truncate`: the product of a sequence's ratios, truncated the same way (TRL `sequence_truncate`)."""

    type: Literal["token-truncate", "sequence-truncate"]
    """The kind: per token or per sequence."""
    is_cap: float = Field(2.0, gt=0)
    """The truncation C: the largest importance weight (TRL's `vllm_importance_sampling_cap`)."""

    def weight_args(self) -> dict[str, float]:
        """Keyword arguments of `algorithm.losses.off_policy_weights` for this kind (its bounds)."""
        return {"cap": self.is_cap}


class MaskCorrection(Section):
    """`token-mask`: `r_t`, 0 outside `[is_floor, is_cap]` (IcePop; TRL `token_mask`); `sequence-mask`: the
    product of a sequence's ratios, the whole sequence masked the same way (TRL `sequence_mask`)."""

    type: Literal["token-mask", "sequence-mask"]
    """The kind: per token or per sequence."""
    is_cap: float = Field(2.0, gt=0)
    """The largest kept ratio."""
    is_floor: float = Field(0.0, ge=0)
    """The smallest kept ratio; 0 = no lower bound."""

    @model_validator(mode="after")
    def _range(self) -> MaskCorrection:
        if self.is_floor >= self.is_cap:
            raise ValueError(f"need is_floor < is_cap, got {self.is_floor} and {self.is_cap}")
        return self

    def weight_args(self) -> dict[str, float]:
        """Keyword arguments of `algorithm.losses.off_policy_weights` for this kind (its bounds)."""
        return {"cap": self.is_cap, "floor": self.is_floor}


class GeometricMaskCorrection(Section):
    """`geometric-mask`: weight 1, and 0 for a sequence whose geometric-mean ratio is outside
    `[geo_mask_low, geo_mask_high]` (SkyRL's geometric sequence mask; verl's geometric rejection sampling)."""

    type: Literal["geometric-mask"] = "geometric-mask"
    """The kind: sequence rejection without reweighting."""
    geo_mask_low: float = Field(0.99, gt=0)
    """Sequences whose geometric-mean ratio is below this are masked (SkyRL's fully async example: 0.99)."""
    geo_mask_high: float = Field(1.01, gt=0)
    """Sequences whose geometric-mean ratio is above this are masked (SkyRL example: 1.01)."""

    @model_validator(mode="after")
    def _range(self) -> GeometricMaskCorrection:
        if self.geo_mask_low >= self.geo_mask_high:
            raise ValueError(f"need geo_mask_low < geo_mask_high, got {self.geo_mask_low} and {self.geo_mask_high}")
        return self

    def weight_args(self) -> dict[str, float]:
        """Keyword arguments of `algorithm.losses.off_policy_weights` for this kind (its bounds)."""
        return {"geo_low": self.geo_mask_low, "geo_high": self.geo_mask_high}


class M2POCorrection(Section):
    """`m2po`: Second-Moment Trust Policy Optimization (Zheng et al. 2025, "Prosperity before Collapse: How Far
    Can Off-Policy RL Reach with Stale Data on LLMs?", arXiv 2510.01161; AReaL `actor.m2_threshold`). Over the
    whole step's batch (every micro-batch and rank), with `log r_t` the trainer's log-prob of a sampled token
    minus the engine's at the rollout's version: the tokens with the largest `log r_t ** 2` are masked until the
    mean over the rest (M2) is below `m2_threshold`; the kept tokens are weighted by `r_t`, and the PPO clip is
    off (`algorithm.clip_eps_low` / `clip_eps_high` are not used). It tolerates rollouts many versions stale."""

    type: Literal["m2po"] = "m2po"
    """The kind: a mask over the whole batch by the second moment of the log ratios, no PPO clip."""
    m2_threshold: float = Field(0.04, gt=0)
    """tau: the largest mean squared log ratio kept (the paper's scripts and AReaL's example: 0.04)."""

    def weight_args(self) -> dict[str, float]:
        """None: M2PO's mask is a statistic of the whole batch, made by the trainer, not per micro-batch."""
        return {}


OffPolicyCorrectionConfig = Annotated[
    AutoCorrection | NoCorrection | TruncateCorrection | MaskCorrection | GeometricMaskCorrection | M2POCorrection,
    Field(discriminator="type"),
    keyed_by_type("auto"),
]
"""`algorithm.off_policy_correction`, keyed by `type`; a bare kind (`token-mask`) takes that kind's defaults."""
ResolvedCorrection = NoCorrection | TruncateCorrection | MaskCorrection | GeometricMaskCorrection | M2POCorrection
"""An off-policy correction with `auto` resolved (`AlgorithmConfig.correction`)."""


class KeepTruncated(Section):
    """`truncation: keep`: a completion cut at `rollout.max_new_tokens` is trained on like any other."""

    type: Literal["keep"] = "keep"
    """The kind: no special treatment of truncated completions."""


class MaskTruncated(Section):
    """`truncation: mask`: a completion cut at `rollout.max_new_tokens` (`finish_reason: length`) adds no loss
    (TRL `mask_truncated_completions`; DAPO's overlong filtering, Yu et al. 2025, sec. 3.4). It still counts in
    its group's mean and standard deviation: the advantages are computed first, over the whole group, then the
    truncated rows are left out of the update, as TRL computes them (`GRPOTrainer._generate_and_score_completions`
    normalises the rewards, then `compute_loss` multiplies the completion mask by the truncation mask). Under
    `advantage: gae` the critic still trains on it and the batch's advantages are whitened with it
    (`TrainBatch.value_only`): the critic's baseline then counts being cut, as a group's mean does."""

    type: Literal["mask"] = "mask"
    """The kind: truncated completions are left out of the loss."""


class OverlongPenalty(Section):
    """`truncation: overlong-penalty`: DAPO's soft overlong punishment (Yu et al. 2025, eq. 13; verl
    `reward_model.overlong_buffer`): with `L = rollout.max_new_tokens`, a completion of `n` tokens gets
    `-penalty * (n - (L - buffer)) / buffer` added to its reward when `n > L - buffer` (so `-penalty` at the
    limit), and nothing when it is shorter; a completion no reward term scored stays unscored."""

    type: Literal["overlong-penalty"] = "overlong-penalty"
    """The kind: a length penalty over the last `buffer` tokens before the limit."""
    buffer: int = Field(16, ge=1)
    """Tokens before `rollout.max_new_tokens` over which the penalty grows linearly (DAPO's `L_cache`, verl's
    `overlong_buffer.len`); at most `rollout.max_new_tokens`."""
    penalty: float = Field(1.0, gt=0)
    """The penalty at the limit (verl's `overlong_buffer.penalty_factor`), in reward units."""


TRUNCATION_DEFAULT = "mask"
"""The default `algorithm.truncation` kind (docs/DESIGN.md, "Truncated completions", says why)."""
TruncationConfig = Annotated[
    KeepTruncated | MaskTruncated | OverlongPenalty,
    Field(discriminator="type"),
    keyed_by_type(TRUNCATION_DEFAULT),
]
"""`algorithm.truncation`, keyed by `type`: `keep`, `mask` or `overlong-penalty` (with `buffer`, `penalty`)."""


_MOVED = {
    "is_cap": ("off_policy_correction", "token-truncate", "is_cap"),
    "tis_cap": ("off_policy_correction", "token-truncate", "is_cap"),
    "is_floor": ("off_policy_correction", "token-mask", "is_floor"),
    "geo_mask_low": ("off_policy_correction", "geometric-mask", "geo_mask_low"),
    "geo_mask_high": ("off_policy_correction", "geometric-mask", "geo_mask_high"),
}
"""The bounds that moved into the correction they bound (key -> sub-section, kind, field)."""


class AlgorithmConfig(Section):
    """GRPO-family policy optimisation settings."""

    advantage: Literal["grpo", "drgrpo", "rloo", "gae"] = "grpo"
    """Advantage estimator: group-normalised (GRPO), mean-centred (Dr. GRPO), leave-one-out (RLOO), or `gae`:
    PPO's per-token generalised advantage estimation (Schulman et al. 2016) from a learned critic (the `critic`
    section), whitened over the batch. Under `gae`, `kl_coef` puts the per-token KL into the reward (verl's
    `use_kl_in_reward`) instead of the loss. `skip_uniform_groups` applies to it too: a group of equal rewards
    has only the critic's error as a signal, which pushes down everything the policy wrote for that prompt."""
    gamma: float = Field(1.0, ge=0, le=1)
    """GAE's discount gamma per token (`advantage: gae` only; verl, OpenRLHF and SkyRL default to 1.0)."""
    lam: float = Field(1.0, ge=0, le=1)
    """GAE's lambda (`advantage: gae` only): 1.0 = Monte-Carlo returns minus the critic's values, 0.0 = one-step
    TD errors (verl, OpenRLHF and SkyRL default to 1.0)."""
    loss_aggregation: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"] = "token-mean"
    """How per-token losses are reduced to a scalar."""
    clip_eps_low: float = Field(0.2, gt=0, lt=1)
    """PPO clip range below 1 for the importance ratio."""
    clip_eps_high: float = Field(0.28, gt=0)
    """PPO clip range above 1 (DAPO's clip-higher)."""
    kl_coef: float = Field(0.0, ge=0)
    """Weight of the k3 KL penalty to the reference (the base model, adapter disabled). 0 = off."""
    off_policy_correction: OffPolicyCorrectionConfig = AutoCorrection()
    """Importance weights on the policy-gradient term for rollouts sampled by another policy than the trainer's
    (an older version in `rollout.mode: async`, and always the engine's numerics); the ratio is trainer over
    engine log-probs (`lora_rl_core.algorithm.losses.off_policy_weights`). Keyed by `type`, each kind with its
    own bounds: `{type: token-truncate, is_cap: 2}` (TIS), `{type: token-mask, is_cap, is_floor}` (IcePop),
    `sequence-truncate` / `sequence-mask` (TRL), `{type: geometric-mask, geo_mask_low, geo_mask_high}`
    (SkyRL), `{type: m2po, m2_threshold: 0.04}` (M2PO: a mask over the whole batch by the second moment of the
    log ratios, no PPO clip; for rollouts many versions stale), `none`, or `auto` (the default: `token-truncate`
    in async mode, `none` in sync mode); a bare kind
    (`off_policy_correction: token-mask`) takes its defaults. Measured with lag 1 on the arithmetic task
    (H100, 20 seeds; benchmarks/results/gpu-async): `token-truncate` ends 0.5 points below sync on average,
    `none` 2.9 and `sequence-mask` (cap 2) 12.5, two of its eight runs collapsing."""
    truncation: TruncationConfig = Field(TRUNCATION_DEFAULT, validate_default=True)
    """What a completion cut at `rollout.max_new_tokens` does to the update (`finish_reason: length`): `mask`
    (the default: no loss; it still counts in its group's advantages, and under `gae` in the critic's
    training), `keep` (trained on as sampled), or
    `{type: overlong-penalty, buffer: 16, penalty: 1.0}` (DAPO's soft overlong punishment added to the reward).
    A completion that ends at end-of-sequence or a stop sequence is never truncated. `mask` is the default by
    measurement (docs/DESIGN.md, "A policy that answers and stops"): side by side on the word-problems recipe
    (one H100 each, same seed, 25-33 steps) it was the one arm whose accuracy rose while the cut share fell to
    1 %; `overlong-penalty` collapsed to 4-token answers, `keep` stopped without learning the answers."""
    skip_uniform_groups: bool = True
    """Train only on groups whose rewards differ (others have zero group advantage; DAPO's dynamic sampling).
    Under `advantage: gae` the policy and the critic both train on the groups kept. With every group kept
    (`false`, the textbook form) PPO put one run of four on the default task onto the format reward alone,
    and two of four with `critic.epochs: 4`; with them skipped (and cut completions kept for the critic,
    `truncation`), PPO reached 48 % strict on average over 8 GPU seeds against GRPO's 60 %, one seed
    rambling to the token limit (benchmarks/results/ppo-vs-grpo/value-only)."""
    num_minibatches: int = Field(1, ge=1)
    """Optimizer steps per training step; 1 keeps training on-policy."""
    max_staleness: int = Field(1, ge=0)
    """Policy versions a rollout may lag behind the trainer; older completions are dropped. Also how many
    versions stay loaded (`max_staleness + 1`), and in `rollout.mode: async` how many steps ahead rollouts
    run (verl `staleness_threshold`, SkyRL `max_staleness_steps`, TRL `max_staleness`)."""

    @model_validator(mode="before")
    @classmethod
    def _moved(cls, data: Any) -> Any:
        refuse_moved_keys(data, "algorithm", _MOVED)
        return data

    def correction(self, mode: RolloutMode) -> ResolvedCorrection:
        """The off-policy correction in effect for a rollout mode: `auto` resolved to `token-truncate` (cap 2)
        in async mode and `none` in sync mode."""
        c = self.off_policy_correction
        if not isinstance(c, AutoCorrection):
            return c
        return TruncateCorrection(type="token-truncate") if mode == "async" else NoCorrection()
