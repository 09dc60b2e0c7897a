"""A run's inputs, built once per process before its plan (`load_inputs`): the adapter store, the data, the
tokenizer, the reward terms and the evaluation's grader, with the checks made on them before step 1: the store,
data, reward functions, grader and model can be had; the data has the gold answers the `math` reward and the
default grader need; no reward term pays for restating the prompt (the leak check); `rollout.stop_token_ids`
are ids of the tokenizer's vocabulary.
"""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass, field

from transformers import PreTrainedTokenizerBase

from lora_rl_core.config import RunConfig
from lora_rl_core.data import Problem, PromptStyle, load_problems
from lora_rl_core.errors import ConfigError, DataError
from lora_rl_core.models import load_tokenizer
from lora_rl_core.rewards import Grader, RewardSet, build_grader
from lora_rl_core.rewards.grader import NO_GOLD_FIX, missing_text
from lora_rl_core.rewards.leaks import check_reward_leaks
from lora_rl_core.store import AdapterStore


@dataclass(frozen=True)
class RunInputs:
    """What a run (or an evaluation) reads and scores with, built once (`load_inputs`) before its plan is made.
    `close()` stops the reward terms' and the grader's worker processes (a run's components do it for it).

    Attributes:
        store: the adapter store (`store` section).
        tokenizer: the model's tokenizer.
        train / test: the training and held-out problems (`train` empty for an evaluation).
        rewards: the reward terms (`reward` section; None for an evaluation).
        grader: the evaluation's fixed grader (`eval.grader`), apart from the reward terms.
    """

    store: AdapterStore
    tokenizer: PreTrainedTokenizerBase
    train: list[Problem]
    test: list[Problem]
    rewards: RewardSet | None
    grader: Grader
    _by_id: dict[str, Problem] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._by_id.update((p.id, p) for p in self.train)

    def problem(self, problem_id: str) -> Problem:
        """The training problem with id `problem_id` (what a rollout row names).

        Raises:
            DataError: no training problem has that id (the data changed since the rollout was written).
        """
        try:
            return self._by_id[problem_id]
        except KeyError:
            raise DataError(
                f"rollout row names problem {problem_id!r}, which the training data does not have: the data "
                "changed since the rollouts were written; resume with the run's own data"
            ) from None

    def close(self) -> None:
        """Stop the reward terms' and the grader's worker processes."""
        with ExitStack() as stack:
            stack.callback(self.grader.close)
            if self.rewards is not None:
                stack.callback(self.rewards.close)

    def __enter__(self) -> RunInputs:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def load_inputs(cfg: RunConfig, *, train: bool = True) -> RunInputs:
    """Build the store, the problems (`train=False`: the held-out split alone, for an evaluation), the reward
    terms (training only), the grader and the tokenizer, once, and check them: the gold answers the rewards and
    the grader need (`check_answers`), the stop token ids (`check_stop_token_ids`) and, for training, that no
    reward term pays for restating the prompt (`check_leaks`). On a failure, what was built is closed again.

    Raises:
        StoreError: an unknown store protocol or a missing fsspec package.
        DataError: a missing dataset, file, split or column, an empty split, a malformed row, missing answers.
        RewardError: a reward function or grader that cannot be loaded, or a term that pays for the prompt.
        ModelError: the tokenizer cannot be loaded. ConfigError: a stop token id outside the vocabulary.
    """
    store = cfg.store.build()  # an unknown store protocol or a missing fsspec package, before the data loads
    train_problems = load_problems(cfg.data, "train", cfg.run.seed) if train else []
    test_problems = load_problems(cfg.data, "test", cfg.run.seed)
    if train:
        check_answers(cfg, train_problems, test_problems)
    with ExitStack() as built:  # on a failure, the worker processes started so far are stopped again
        # the rewards before the tokenizer: a bad reward name fails without loading a model
        rewards = RewardSet.from_config(cfg.reward) if train else None
        if rewards is not None:
            built.callback(rewards.close)
        grader = build_grader(cfg.eval, cfg.reward)
        built.callback(grader.close)
        tokenizer = load_tokenizer(cfg.model)
        check_stop_token_ids(cfg, tokenizer)
        if rewards is not None:
            check_leaks(cfg, tokenizer, test_problems, rewards)
        built.pop_all()
    return RunInputs(store, tokenizer, train_problems, test_problems, rewards, grader)


def check_stop_token_ids(cfg: RunConfig, tokenizer: PreTrainedTokenizerBase) -> None:
    """`rollout.stop_token_ids` must be ids of the tokenizer's vocabulary (`0 .. len(tokenizer) - 1`, added
    tokens included): an id outside it can never be sampled, so the stop it was meant to be would never come.

    Raises:
        ConfigError: naming `rollout.stop_token_ids`, the ids outside and the vocabulary's size.
    """
    size = len(tokenizer)
    outside = [i for i in cfg.rollout.stop_token_ids if i >= size]
    if outside:
        raise ConfigError(
            f"rollout.stop_token_ids: {outside} outside the tokenizer's vocabulary of {size} ids (0 .. {size - 1}) "
            f"of {cfg.model.name_or_path}: give ids of its tokens (tokenizer.convert_tokens_to_ids)"
        )


def check_answers(cfg: RunConfig, train: list[Problem], test: list[Problem]) -> None:
    """The built-in `math` reward needs gold answers in the training data, and the evaluation's default grader
    in the held-out data: refuse data without them.

    Raises:
        DataError: `math` is a reward term and no training problem has an answer; or the evaluation runs with
            the default grader and a held-out problem has none.
    """
    if any(f.name == "math" for f in cfg.reward.functions) and all(p.answer is None for p in train):
        raise DataError(
            f"the math reward needs gold answers, but the data has no column {cfg.data.answer_column!r}: set "
            "data.answer_column to the column with the answers, or use reward functions that need none"
        )
    missing = [p.id for p in test if p.answer is None]
    if cfg.run.eval_before_after and cfg.eval.grader is None and missing:
        raise DataError(
            f"the evaluation grades against gold answers (eval.grader: null) and {missing_text(missing)} "
            f"{NO_GOLD_FIX}, or set run.eval_before_after=false"
        )


def check_leaks(
    cfg: RunConfig, tokenizer: PreTrainedTokenizerBase, problems: list[Problem], rewards: RewardSet
) -> None:
    """`lora_rl_core.rewards.leaks.check_reward_leaks` over the held-out prompts, worded as the run words them;
    nothing with `reward.leak_check: false`.

    Raises:
        RewardError: a term pays for restating the prompt (naming it, a row and `reward.leak_check`).
    """
    if not cfg.reward.leak_check:
        return
    check_reward_leaks(
        rewards,
        problems,
        instruction=PromptStyle.of(cfg.data, cfg.rollout).instruction,
        tokenize=lambda text: list(tokenizer(text, add_special_tokens=False)["input_ids"]),
    )
