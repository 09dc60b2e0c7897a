"""The sections of a run besides the engine, algorithm and trainer (model, lora, rollout, store, data, reward,
eval, run) and `RunConfig`, which holds them all."""

from __future__ import annotations

import warnings
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from lora_rl_core.config.algorithm import AlgorithmConfig
from lora_rl_core.config.base import FrozenDict, ReadOnlyMapping, RolloutMode, Section
from lora_rl_core.config.engine import EmbeddedEngineConfig, EngineConfig
from lora_rl_core.config.placement import AutoPlacement, PlacementConfig
from lora_rl_core.config.trainer import TrainerConfig


class ModelConfig(Section):
    """Which base model to load and how."""

    name_or_path: str = "smollm2-135m-instruct"
    """A local folder, a Hugging Face hub id, or the offline name `smollm2-135m-instruct`."""
    dtype: Literal["auto", "bfloat16", "float32", "float16"] = "auto"
    """Dtype of the base weights; LoRA weights are always kept in float32. `auto`: bfloat16 on CUDA, and on
    a CPU only where it computes bfloat16 natively (AVX512-BF16 or AMX), else float32 (`lora_rl_core.runtime`)."""
    device: str = "auto"
    """`auto` (cuda when available, else cpu), `cpu`, `cuda`, `cuda:1`, ..."""
    revision: str | None = None
    """Hub revision (branch, tag or commit) when loading by hub id."""
    trust_remote_code: bool = False
    """Passed to transformers; only needed for models with custom code."""


class LoRAConfig(Section):
    """LoRA adapter shape (Hu et al. 2021), applied with PEFT."""

    rank: int = Field(16, gt=0, le=1024)
    """LoRA rank r."""
    alpha: float = Field(32.0, gt=0)
    """LoRA alpha; the update is scaled by alpha / r (alpha / sqrt(r) with rsLoRA)."""
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    """Dropout on the LoRA input during training."""
    target_modules: Literal["all-linear"] | tuple[str, ...] = "all-linear"
    """`all-linear` or module-name suffixes such as `[q_proj, v_proj]`; checked against the model."""
    exclude_modules: tuple[str, ...] = ()
    """Module-name suffixes never adapted (applied after target_modules)."""
    init: Literal["default", "gaussian", "pissa", "olora", "orthogonal", "eva", "loftq", "corda"] = "default"
    """PEFT `init_lora_weights`: `default` = Kaiming A, zero B (the adapter starts as a no-op)."""
    use_rslora: bool = False
    """Rank-stabilised scaling alpha / sqrt(r) (Kalajdzievski 2023)."""

    @field_validator("target_modules")
    @classmethod
    def _non_empty(cls, value: str | tuple[str, ...]) -> str | tuple[str, ...]:
        if isinstance(value, tuple) and not value:
            raise ValueError("must name at least one module, or be 'all-linear'")
        return value


class RolloutConfig(Section):
    """Sampling of completions for training."""

    prompts_per_step: int = Field(8, ge=1)
    """Prompts (groups) per training step."""
    group_size: int = Field(8, ge=1)
    """Completions sampled per prompt (GRPO's G, SGLang's n)."""
    max_new_tokens: int = Field(48, ge=1)
    """Completion length cap in tokens."""
    temperature: float = Field(1.0, gt=0)
    """Sampling temperature (> 0; the logits are divided by it). The trainer divides its logits by the same
    value, so its log-probs are those of the distribution sampled from. 1.0 samples from the policy itself
    (TRL GRPOConfig `temperature`, verl `rollout.temperature`, SGLang `sampling_params.temperature`)."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p. 1.0 = off (the
    default). The trainer's log-probs ignore the truncation, so < 1 makes rollouts slightly off-policy
    (SGLang `sampling_params.top_p`, TRL `top_p`)."""
    top_k: int = Field(0, ge=0)
    """Sample only among the k most likely tokens; 0 = off (the default; SGLang's off is -1, which the HTTP
    clients send for 0). Like top_p, ignored by the trainer's log-probs."""
    system_prompt: str | None = None
    """System message; None keeps the chat template's default."""
    instruction: str | None = None
    """Appended after a newline to each prompt's (last) user message; `""` for none. None = the data source's
    own: `Give the final answer after ####.` for the built-in math sources, none for `data.source: dataset`."""
    mode: RolloutMode | Literal["auto"] = "auto"
    """`sync`: each step samples with the version the previous step published, then trains. `async`: the
    rollouts of the next `algorithm.max_staleness` steps are generated (as Prefect task futures) while a step
    trains, each with the version current when it starts; the trainer drops completions more than
    `max_staleness` versions old and corrects the rest (`algorithm.off_policy_correction`). `auto` (the
    default): `async` where the run's placement gives SGLang and the trainer GPUs of their own (`split`,
    chosen or picked by `placement: auto` on several GPUs: both then stay busy) and `algorithm.max_staleness`
    allows it, else `sync` (`lora_rl_core.plan.placement.rollout_mode`). On one GPU, where rollout and training
    share it, `async` measured 1.5B 4.06 -> 3.76 s and 7B 7.89 -> 8.09 s a step on an H100
    (`benchmarks/results/gpu_scale/README.md`, "One GPU, A/B"), so `auto` stays `sync` there."""
    stop: tuple[str, ...] = ()
    """Stop sequences: a completion ends at the token that completes the first of these strings, which stays in
    it (tokens and logprobs: the policy learns to write it), with `finish_reason` `stop` (end-of-sequence is
    `eos`, the token limit `length`). Generation halts there: no tokens are spent past it. E.g. `["\\n\\n"]`,
    or a base model's `["Question:"]` before it writes the next problem. A bare string is one stop. Rollouts
    and the evaluation use them, on every engine (SGLang `sampling_params.stop`, vLLM and TRL `stop`). Default:
    none."""
    stop_token_ids: tuple[int, ...] = ()
    """Token ids that end a completion as a stop sequence does (`finish_reason` `stop`, the token kept), e.g. a
    chat model's end-of-turn token where it is not an EOS id; the model's EOS ids always end one (`eos`). Each
    must be an id of the tokenizer's vocabulary, checked before step 1 (SGLang `sampling_params.stop_token_ids`).
    Default: none."""

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_strings(cls, value: Any) -> Any:
        stops = [value] if isinstance(value, str) else value
        if not isinstance(stops, list | tuple):
            raise ValueError(f"must be a string or a list of strings, got {value!r}")
        for s in stops:
            if not isinstance(s, str):
                raise ValueError(f"each stop must be a string, got {s!r} (quote it in YAML: '{s}')")
            if not s:
                raise ValueError("a stop must not be an empty string (it would end every completion at once)")
        return list(stops)

    @field_validator("stop_token_ids", mode="before")
    @classmethod
    def _stop_ids(cls, value: Any) -> Any:
        ids = value if isinstance(value, list | tuple) else [value]
        for i in ids:
            if isinstance(i, bool) or not isinstance(i, int) or i < 0:
                raise ValueError(f"each stop token id must be a token id, an integer >= 0, got {i!r}")
        return list(ids)


class StoreConfig(Section):
    """Adapter store (fsspec URI)."""

    uri: str = "file://./runs"
    """fsspec URI of the store's root: `file://./runs` (the default: `runs/` under the working directory),
    `s3://bucket/prefix`, `memory://...` (tests). A run keeps its adapter versions, config snapshot, tags and
    checkpoints under `<uri>/<run_id>/` (docs/DESIGN.md, "Object store layout"). The trainer's ranks write
    their parts of each checkpoint themselves, so with `trainer.backend: local` or `ray` it is a store they
    reach: not `memory://` (this process's own); Ray on several nodes needs S3 or a folder every node shares."""
    storage_options: Annotated[dict[str, Any], ReadOnlyMapping] = FrozenDict()
    """Passed to fsspec (e.g. S3 endpoint_url, key, secret)."""

    def build(self):  # noqa: ANN201 - import cycle avoided
        """Return the `AdapterStore` this section describes."""
        from lora_rl_core.store import AdapterStore

        return AdapterStore(self.uri, storage_options=self.storage_options or None)


class DataConfig(Section):
    """Training and evaluation prompts."""

    source: Literal["arithmetic", "gsm8k", "mawps", "dataset"] = "arithmetic"
    """Where problems come from: `arithmetic` generates them from `run.seed` (the fields below marked
    "Arithmetic generator"); `gsm8k` and `mawps` are presets over the vendored JSONL files (prompt column
    `question`, gold answer `answer`; GSM8K's after its last `####`); `dataset` reads any dataset through
    Hugging Face `datasets` (`path`, `name`, the splits and columns below; TRL's standard and conversational
    prompt formats)."""
    path: str | None = None
    """`dataset`: a hub id (`openai/gsm8k`), a local folder, or a local `.jsonl` / `.json` / `.parquet` / `.csv`
    file (then the train split; give `test_path` for held-out rows) (`datasets.load_dataset`'s `path`)."""
    name: str | None = None
    """`dataset`: the dataset's configuration, e.g. `main` for `openai/gsm8k` (`datasets.load_dataset`'s
    `name`)."""
    train_split: str = "train"
    """`dataset`: the split trained on."""
    test_split: str = "test"
    """`dataset`: the held-out split (evaluation before and after training, `lora-rl eval`)."""
    prompt_column: str = "prompt"
    """`dataset`: the column with the prompt: text (TRL's standard format) or a list of `{"role", "content"}`
    messages (TRL's conversational format, rendered with the tokenizer's chat template)."""
    answer_column: str = "answer"
    """`dataset`: the column with the gold answer, if the dataset has one (a reward may need none; the
    built-in `math` reward does). Reward functions get the gold answer as `answer` whatever its column, and
    every other column by its name."""
    train_path: str | None = None
    """A local file (`.jsonl`, `.json`, `.parquet`, `.csv`) for the train split; default for the presets:
    `<data_dir>/<source>/train.jsonl`. Unused for `arithmetic`."""
    test_path: str | None = None
    """A local file for the held-out split; default for the presets: `<data_dir>/<source>/test.jsonl`.
    Unused for `arithmetic`."""
    data_dir: str = "data"
    """Folder of the vendored datasets (`<data_dir>/<source>/{train,test}.jsonl`); relative paths are taken
    from the working directory."""
    operations: tuple[Literal["+", "-", "*"], ...] = ("+",)
    """Arithmetic generator: operations."""
    digits: int = Field(2, ge=1, le=9)
    """Arithmetic generator: digits per operand."""
    train_size: int = Field(10000, ge=1)
    """Arithmetic generator: training problems."""
    eval_size: int | None = Field(128, ge=1)
    """Held-out problems for accuracy; None = the whole test split."""

    @model_validator(mode="after")
    def _dataset_has_a_place(self) -> DataConfig:
        if self.source == "dataset" and not (self.path or self.train_path):
            raise ValueError("data.source dataset needs data.path (hub id, folder or file) or data.train_path")
        return self


class RewardFunctionConfig(Section):
    """One reward term: a built-in name, `module:function` or `file.py:function`, and its weight."""

    name: str = "math"
    """A built-in reward (`math`: 1.0 when the answer the completion states, `reward.answer_format`, equals the
    gold answer, 0.0 when not, None without one; `format`: 1.0 when the completion states a number after
    `####`; `answer_then_stop`: 1.0 when its one answer line, `#### <number>` or `\\boxed{}`, is its last
    content and it ended there by end-of-sequence or a stop sequence, never cut at the token limit), an importable
    `module.path:function`, or `path/to/file.py:function` (a relative path is taken from the config file's
    folder). A function has TRL's signature `f(prompts, completions, completion_ids, **columns) -> list[float |
    None]`, called once per batch with every other dataset column by name; `async def` functions run
    concurrently. Checked before the run starts (TRL `reward_funcs`)."""
    weight: float = 1.0
    """Multiplier of this term in the summed reward; may be negative (TRL `reward_weights`)."""


class RewardConfig(Section):
    """Reward functions summed into the scalar reward."""

    functions: tuple[RewardFunctionConfig, ...] = (RewardFunctionConfig(),)
    """The terms; the reward of a completion is the sum of `weight * value` over the terms that gave it a value
    (None: the term does not apply; a completion no term scored is not trained on). Each term's mean is logged
    as `rewards/<name>/mean`. Default: `math` with weight 1.0 alone."""
    timeout_s: float = Field(60.0, gt=0)
    """Deadline of one call of an `async def` reward function, seconds (a judge or a remote verifier); past it
    the step fails naming the function. Plain functions run to completion."""
    files_dir: str | None = None
    """Where a relative `path/to/file.py:function` name is found: `load_config` sets the config file's folder;
    None = the working directory."""
    verify_timeout_s: float = Field(5.0, gt=0)
    """The `math` reward: seconds one symbolic answer may take to parse and verify with math-verify (its
    default); an answer past it scores 0.0 and its worker process is replaced."""
    answer_format: Literal["strict", "flexible"] = "flexible"
    """Where the `math` reward reads the answer a completion states (lm-eval's gsm8k filters): `strict`
    (`strict-match`) only after the last `####` or in the last `\\boxed{}`, the format the instruction asks
    for; `flexible` (`flexible-extract`) there, else the last number of the completion. Either way only the
    stated answer is graded: a number that is an operand of an expression (`34 + 49`) is no answer, so
    restating the problem earns nothing. Default `flexible`: a small model that answers right without the
    `####` still gets a learning signal (docs/DESIGN.md, "An honest math reward")."""
    leak_check: bool = True
    """Before step 1, score each held-out prompt restated as a completion (its text, the question, the question
    without its closing `?`) with every term: a term that pays a restatement more than an empty completion on
    more than 5 % of the prompts (`lora_rl_core.rewards.leaks.LEAK_MAX_FRACTION`) stops the run, naming the
    term and a row (a reward the policy could earn by restating the question). `false` skips the check."""


class EvalConfig(Section):
    """Evaluation on the held-out problems (before and after training, `lora-rl eval`)."""

    samples_per_prompt: int = Field(1, ge=1)
    """`n` samples per problem at `temperature`, besides the greedy one; with n > 1 the report gives pass@k
    for k = 1, 2, 4, ... n (the unbiased estimator of Chen et al. 2021, `1 - C(n-c, k) / C(n, k)`) and
    mean@n (the mean success rate over the n samples)."""
    temperature: float = Field(1.0, gt=0)
    """Sampling temperature of the `samples_per_prompt` samples."""
    grader: str | None = None
    """What grades the evaluation, apart from the training reward so that a change to a reward can never move
    the score. None (default): the built-in answer checker against each problem's gold answer, in both of
    lm-eval's gsm8k modes side by side (`strict`: the answer after `####` or in `\\boxed{}`; `flexible`: else
    the last number). Or a reward function by name, as in `reward.functions` (`format`, `module:function`,
    `file.py:function`): a completion succeeds when its value reaches `pass_threshold`. A run's own reward
    functions never grade the evaluation unless named here."""
    pass_threshold: float = 1.0
    """With `grader` naming a function: a completion succeeds when its value reaches this. Also the success
    line of the rollout accuracy in the step metrics (summed training reward)."""


class RunSection(Section):
    """Run identity and outputs."""

    id: str | None = None
    """Run id; default `<run.name>-<flow run id, first 8 characters>` (`lora-rl train`: 8 random hex digits,
    passed to the flow run), so a retry of the Prefect flow run resumes the same run. `lora-rl train --run-id`
    overrides it."""
    name: str = "run"
    """Prefix of the default run id (`RunSection.id`); ignored when `id` is set."""
    seed: int = 0
    """Seeds the arithmetic problems, the prompt order, the LoRA initialisation, Python's and torch's RNGs,
    and each step's sampling seed, so a run with the same seed and config draws the same prompts."""
    output_dir: str = "runs"
    """Local folder of each run's report and logs, `<output_dir>/<run_id>/`: `report.md`, `reward_curve.png`,
    `history.json`, and the logs of the SGLang servers the run launches (`sglang.log`; `sglang-<i>.log` per
    Ray replica, on the replica's node). Rollouts and adapters go to the store (`store.uri`)."""
    eval_before_after: bool = True
    """Greedy accuracy on the held-out split before and after training. Off: no accuracy; the report still
    shows the trained adapter's greedy completions of the first 4 held-out problems."""
    eval_max_new_tokens: int | None = None
    """Token cap for evaluation; default rollout.max_new_tokens."""


CRITIC_LR_FACTOR = 10.0
"""`critic.lr` unset is this many times `trainer.lr` (miles' docs advise a critic learning rate about 10x the
actor's: the value head starts from nothing while the policy only moves a little per step)."""


class CriticConfig(Section):
    """The critic of PPO with GAE (`algorithm.advantage: gae`): its adapter, optimizer and value loss. Set only
    with `algorithm.advantage: gae`. One copy of the base model serves both adapters (SkyRL, OpenRLHF and verl
    load a second copy for the critic). The critic is never published: `adapters pull` and the engines get the
    policy alone."""

    lora: LoRAConfig | None = None
    """The critic's LoRA adapter (every field of `lora`: rank, alpha, dropout, target modules, exclude modules,
    init); None = the same shape as the policy's `lora` section."""
    lr: float | None = Field(None, gt=0)
    """AdamW's learning rate for the critic's adapter and head; None = 10x `trainer.lr` (`CRITIC_LR_FACTOR`).
    The critic warms up like the policy (`trainer.warmup_steps`) and shares its AdamW betas and weight decay."""
    epochs: int = Field(1, ge=1)
    """Passes of the critic over each step's batch, each ending in an optimizer step (verl `critic.ppo_epochs`,
    OpenRLHF `max_epochs`): the critic is a regression onto the step's returns, with no on-policy constraint
    but the value clip, so it may take several steps where the policy takes one. Each pass costs one forward
    and backward of the critic over the batch."""
    pretrain_steps: int = Field(0, ge=0)
    """Steps at the start in which only the critic trains (verl's `trainer.critic_warmup`): the policy's
    adapter stays as it is (each step still publishes it), so its first update sees a critic that has learned
    something. Not `trainer.warmup_steps`, which warms up the learning rate. Fewer than `trainer.steps`."""
    value_clip: float | None = Field(0.5, gt=0)
    """PPO's value clip: a new value further than this from the value before the update counts the larger of
    the clipped and unclipped squared errors (verl `critic.cliprange_value`, OpenRLHF `value_clip`: 0.5).
    None = no clip."""
    loss_coef: float = Field(1.0, gt=0)
    """The value loss's weight in the critic's backward (TRL's `vf_coef`). The critic has an optimizer of its
    own, so this scales its gradient before `max_grad_norm` clips it, and the reported `value_loss`."""
    max_grad_norm: float = Field(1.0, gt=0)
    """The global gradient-norm clip of the critic's adapter and head (verl `critic.grad_clip`: 1.0)."""
    head_init_std: float = Field(0.0, ge=0)
    """The value head's initial weights: 0.0 (the default) = zeros, so the critic predicts 0 until it has
    trained and the first advantages are the returns themselves, with no random baseline added; > 0 = normal
    with this standard deviation (verl's critic, a token-classification head: the model's
    `initializer_range`, 0.02). The bias starts at 0."""


class RunConfig(Section):
    """The whole configuration of one training run."""

    model: ModelConfig = ModelConfig()
    """The base model: what to load, dtype and device."""
    lora: LoRAConfig = LoRAConfig()
    """The adapter's shape: rank, alpha, target modules, initialisation."""
    algorithm: AlgorithmConfig = AlgorithmConfig()
    """The policy-gradient objective: advantage estimator, clipping, KL, staleness."""
    critic: CriticConfig = CriticConfig()
    """PPO's critic (`algorithm.advantage: gae`): its LoRA adapter, learning rate, value clip, pre-training."""
    rollout: RolloutConfig = RolloutConfig()
    """Sampling for training: prompts per step, group size, length and sampling parameters."""
    engine: EngineConfig = EmbeddedEngineConfig()
    """The inference engine(s) that sample rollouts and how adapter versions reach them."""
    store: StoreConfig = StoreConfig()
    """The adapter store that versions and checkpoints are published to."""
    trainer: TrainerConfig = TrainerConfig()
    """Optimisation: steps, optimizer, batch shape, checkpoints, FSDP2 workers."""
    placement: PlacementConfig = AutoPlacement()
    """Which GPUs the trainer and a launched SGLang use: `colocated` (both on every GPU), `split` (SGLang on
    some, the trainer on the rest), `manual`, or `auto` (the default: chosen from the visible GPUs)."""
    data: DataConfig = DataConfig()
    """The training and held-out problems."""
    reward: RewardConfig = RewardConfig()
    """The reward terms."""
    eval: EvalConfig = EvalConfig()
    """Held-out evaluation: greedy accuracy, and pass@k / mean@n with `samples_per_prompt` samples."""
    run: RunSection = RunSection()
    """Run identity, seed, local outputs and evaluation."""

    @model_validator(mode="after")
    def _async_needs_staleness(self) -> RunConfig:
        if self.rollout.mode == "async" and self.algorithm.max_staleness < 1:
            raise ValueError(
                "rollout.mode=async needs algorithm.max_staleness >= 1 (how many steps rollouts may run ahead); "
                "with 0 use rollout.mode=sync"
            )
        if self.rollout.mode == "async" and self.algorithm.correction("async").type == "none":
            warnings.warn(
                "rollout.mode=async with algorithm.off_policy_correction=none trains on stale completions "
                "without importance weights",
                stacklevel=2,
            )
        return self

    @model_validator(mode="after")
    def _critic_needs_gae(self) -> RunConfig:
        default = CriticConfig()
        set_fields = [
            name for name in CriticConfig.model_fields if getattr(self.critic, name) != getattr(default, name)
        ]
        if self.algorithm.advantage != "gae":
            if set_fields:
                raise ValueError(
                    f"critic.{set_fields[0]} is set but algorithm.advantage is {self.algorithm.advantage}: the "
                    "critic is PPO's (algorithm.advantage=gae); set algorithm.advantage=gae or remove critic.*"
                )
        elif self.critic.pretrain_steps >= self.trainer.steps:
            raise ValueError(
                f"critic.pretrain_steps ({self.critic.pretrain_steps}) must be below trainer.steps "
                f"({self.trainer.steps}): the policy would never train"
            )
        return self

    @model_validator(mode="after")
    def _ranks_reach_the_store(self) -> RunConfig:
        if self.store.uri.startswith("memory://") and self.trainer.backend.type != "in-process":
            raise ValueError(
                f"store.uri={self.store.uri} lives in this process's memory, where trainer.backend="
                f"{self.trainer.backend.type}'s ranks cannot write their checkpoint parts: use a file:// or s3:// "
                "store, or trainer.backend=in-process"
            )
        return self

    @model_validator(mode="after")
    def _overlong_buffer_fits(self) -> RunConfig:
        t = self.algorithm.truncation
        if t.type == "overlong-penalty" and t.buffer > self.rollout.max_new_tokens:
            raise ValueError(
                f"algorithm.truncation.buffer is {t.buffer} tokens, longer than rollout.max_new_tokens "
                f"({self.rollout.max_new_tokens}): set a buffer of at most {self.rollout.max_new_tokens} "
                f"(DAPO used a fifth of the limit)"
            )
        return self

    @model_validator(mode="after")
    def _warn_off_recipe(self) -> RunConfig:
        # The default LoRA recipe is near-on-policy (docs/DESIGN.md); say so when a config departs.
        if self.algorithm.num_minibatches > 1 or self.algorithm.max_staleness > 1:
            warnings.warn(
                "algorithm.num_minibatches > 1 or max_staleness > 1 departs from the near-on-policy "
                "LoRA recipe (one minibatch per step, max_staleness 1)",
                stacklevel=2,
            )
        return self

    def rollouts_ahead(self, mode: RolloutMode) -> int:
        """How many steps ahead of the training step rollouts run in `mode` (`rollout.mode` resolved:
        `RunPlan.rollout_mode`): `algorithm.max_staleness` when `async`, 0 when `sync`."""
        return self.algorithm.max_staleness if mode == "async" else 0
