"""Scoring a batch of completions with weighted reward functions written the way TRL users write them.

Each function is called once per batch, with keywords, as TRL's `GRPOTrainer` calls its `reward_funcs`:
`f(prompts=..., completions=..., completion_ids=..., **columns)`, where `columns` are every other column of
the dataset rows (`answer` among them when the dataset has one), each a list over the batch. It returns one
value per completion: a number, or None where it does not apply.

* Plain functions run one after another on the calling thread, outside any event loop (as TRL runs them);
  then the `async def` functions run concurrently, each under `reward.timeout_s`, on an event loop that lives
  as long as the `RewardSet` (an async client a function keeps between batches stays usable).
* A completion's reward is the weighted sum of the values its functions gave (None terms left out, as TRL's
  `nansum`); a completion no function scored is `skipped`: it gets no reward and is not trained on.
* A function that raises, times out, or returns the wrong number of values or a non-finite value fails the
  batch with a `RewardError` naming the function, the row (its problem id) and the cause.

`RewardSet` holds a run's terms and the math verifier's worker processes (`close()` stops them).
"""

from __future__ import annotations

import asyncio
import inspect
import math
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lora_rl_core.errors import RewardError
from lora_rl_core.rewards.load import load_reward_function
from lora_rl_core.rewards.verify import MathVerifier

if TYPE_CHECKING:
    from lora_rl_core.config import RewardConfig
    from lora_rl_core.data import Problem


FINISH_REASON = "finish_reason"
"""The column that tells reward functions why each completion ended: `eos` (the model's end-of-sequence token),
`stop` (a stop sequence, `rollout.stop`) or `length` (cut at `rollout.max_new_tokens`)."""


def trim_stops(texts: Sequence[str], finish_reasons: Sequence[str], stops: Sequence[str]) -> list[str]:
    """Each completion's text as reward functions and graders read it: where a stop string ended it
    (`finish_reason: stop`), cut before the first stop string, as SGLang, vLLM and OpenAI return text (their stop
    trimming). The completion's token ids keep the stop's tokens (the policy learns to write it); other texts are
    unchanged."""
    out = []
    for text, reason in zip(texts, finish_reasons, strict=True):
        cuts = [text.find(s) for s in stops if reason == "stop" and s in text]
        out.append(text[: min(cuts)] if cuts else text)
    return out


@dataclass(frozen=True)
class RewardTerm:
    """One weighted reward function: `name` as the config gives it, its callable and its weight."""

    name: str
    fn: Callable[..., Any]
    weight: float


@dataclass
class RewardBatch:
    """The completions of one batch, as reward functions see them.

    Attributes:
        prompts: per row, the prompt as the dataset gives it (text, or `{"role", "content"}` messages).
        completions: per row, the completion text (standard format) or `[{"role": "assistant", "content"}]`
            (conversational format, when the prompt is messages).
        completion_ids: per row, the completion's token ids.
        columns: every other dataset column, by name, each a list over the rows.
        row_ids: per row, the problem id (for error messages).
    """

    prompts: list[Any]
    completions: list[Any]
    completion_ids: list[list[int]]
    columns: dict[str, list[Any]]
    row_ids: list[str]

    def __len__(self) -> int:
        return len(self.completions)

    @classmethod
    def from_problems(
        cls,
        problems: Sequence[Problem],
        texts: Sequence[str],
        completion_ids: Sequence[Sequence[int]],
        finish_reasons: Sequence[str],
    ) -> RewardBatch:
        """The batch of one completion per entry of `problems` (a problem repeats for each of its samples): the
        completion in its prompt's format (text, or one assistant message), every dataset column by name, the
        gold answer as `answer` whatever column it came from (`data.answer_column`; None where none), and why
        each completion ended as `finish_reason` (`eos`, `stop` or `length`, OpenAI's `finish_reason` with
        end-of-sequence told apart from a stop sequence; it replaces a dataset column of that name)."""
        names = sorted({name for p in problems for name in p.columns} - {"answer", FINISH_REASON})
        return cls(
            prompts=[p.prompt for p in problems],
            completions=[
                t if isinstance(p.prompt, str) else [{"role": "assistant", "content": t}]
                for p, t in zip(problems, texts, strict=True)
            ],
            completion_ids=[list(ids) for ids in completion_ids],
            columns={
                **{name: [p.columns.get(name) for p in problems] for name in names},
                "answer": [p.answer for p in problems],
                FINISH_REASON: list(finish_reasons),
            },
            row_ids=[p.id for p in problems],
        )


@dataclass
class ScoredRewards:
    """What `RewardSet.score` gives for a batch of `N` rows.

    Attributes:
        totals: `[N]` weighted sum of each row's values (0.0 where skipped).
        terms: each function's unweighted values `[N]` by name (None where it did not apply).
        skipped: `[N]` True where no function gave a value (not trained on).
    """

    totals: list[float]
    terms: dict[str, list[float | None]]
    skipped: list[bool]

    def term_means(self) -> dict[str, float]:
        """Each function's mean over the rows it scored (a function that scored none is left out)."""
        out = {}
        for name, values in self.terms.items():
            given = [v for v in values if v is not None]
            if given:
                out[name] = sum(given) / len(given)
        return out


class RewardSet:
    """A run's weighted reward functions, and the math verifier they may share (module docstring).

    Args:
        terms: the weighted functions, distinct names.
        verifier: the math verifier the built-in `math` reward uses; closed with this set.
        timeout_s: deadline of one `async def` function's call, seconds (`reward.timeout_s`).

    Raises:
        RewardError: no terms, duplicate names, or a non-finite weight.
    """

    def __init__(self, terms: Sequence[RewardTerm], verifier: MathVerifier, *, timeout_s: float) -> None:
        names = [t.name for t in terms]
        if not names or len(set(names)) != len(names):
            raise RewardError(f"reward functions need distinct names, at least one; got {names}")
        for term in terms:
            if not isinstance(term.weight, numbers.Real) or not math.isfinite(term.weight):
                raise RewardError(f"reward {term.name!r} has weight {term.weight!r}; it must be a finite number")
        self.terms = list(terms)
        self._plain = [t for t in self.terms if not _is_async(t.fn)]
        self._awaited = [t for t in self.terms if _is_async(t.fn)]
        self.verifier = verifier
        self.timeout_s = timeout_s
        self._loop: asyncio.AbstractEventLoop | None = None

    @classmethod
    def from_config(cls, cfg: RewardConfig) -> RewardSet:
        """The terms of the `reward` section (names resolved by `load_reward_function`).

        Raises:
            RewardError: a name that cannot be resolved, duplicate names, a bad weight.
        """
        verifier = MathVerifier(timeout_s=cfg.verify_timeout_s)
        fns = [
            load_reward_function(f.name, verifier, cfg.files_dir, answer_format=cfg.answer_format)
            for f in cfg.functions
        ]
        return cls(
            [
                RewardTerm(label, fn, f.weight)
                for label, fn, f in zip(_labels(cfg, fns), fns, cfg.functions, strict=True)
            ],
            verifier,
            timeout_s=cfg.timeout_s,
        )

    def close(self) -> None:
        """Stop the math verifier's worker processes and close the event loop of async functions (idempotent)."""
        self.verifier.close()
        loop, self._loop = self._loop, None
        if loop is not None:
            loop.close()

    def __enter__(self) -> RewardSet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def names(self) -> list[str]:
        """The terms' names, in config order."""
        return [t.name for t in self.terms]

    def score(self, batch: RewardBatch) -> ScoredRewards:
        """Every function's values for `batch`, and the weighted totals (module docstring).

        Raises:
            RewardError: a function raised, timed out, or returned the wrong count or a non-finite value.
        """
        values = {t.name: self._call(t, batch) for t in self._plain}  # outside any event loop
        if self._awaited:
            if self._loop is None:
                self._loop = asyncio.new_event_loop()  # one loop for the set: clients a function keeps stay usable
            results = self._loop.run_until_complete(_gather([self._call_async(t, batch) for t in self._awaited]))
            values.update((t.name, v) for t, v in zip(self._awaited, results, strict=True))
        terms = {t.name: values[t.name] for t in self.terms}
        totals, skipped = [], []
        for i in range(len(batch)):
            given = [(t.weight, terms[t.name][i]) for t in self.terms if terms[t.name][i] is not None]
            skipped.append(not given)
            totals.append(sum(w * float(v) for w, v in given if v is not None))
        return ScoredRewards(totals, terms, skipped)

    def _call(self, term: RewardTerm, batch: RewardBatch) -> list[float | None]:
        """A plain function's values, on this thread."""
        try:
            result = term.fn(**_kwargs(batch))
        except Exception as err:  # noqa: BLE001 - a user's function may raise anything: name it and the rows
            raise _failed(term, batch, err) from None
        return _checked(term.name, result, batch.row_ids)

    async def _call_async(self, term: RewardTerm, batch: RewardBatch) -> list[float | None]:
        """An `async def` function's values, under `timeout_s`."""
        try:
            result = await asyncio.wait_for(term.fn(**_kwargs(batch)), self.timeout_s)
        except TimeoutError:
            raise RewardError(
                f"reward {term.name!r} did not answer within {self.timeout_s:g} s (reward.timeout_s) "
                f"for {_rows(batch.row_ids)}"
            ) from None
        except Exception as err:  # noqa: BLE001
            raise _failed(term, batch, err) from None
        return _checked(term.name, result, batch.row_ids)


def _labels(cfg: RewardConfig, fns: list[Callable[..., Any]]) -> list[str]:
    """How each term is named in metrics (`rewards/<label>/mean`): a built-in by its name, a user's function by
    its `__name__` (as TRL logs it), the configured name where two would collide."""
    labels = [
        f.name if ":" not in f.name else getattr(fn, "__name__", f.name)
        for f, fn in zip(cfg.functions, fns, strict=True)
    ]
    return [label if labels.count(label) == 1 else f.name for label, f in zip(labels, cfg.functions, strict=True)]


async def _gather(coroutines: list[Any]) -> list[Any]:
    return list(await asyncio.gather(*coroutines))


def _kwargs(batch: RewardBatch) -> dict[str, Any]:
    """TRL's keywords: every column by name, then the prompts, completions and completion ids."""
    return {
        **batch.columns,
        "prompts": batch.prompts,
        "completions": batch.completions,
        "completion_ids": batch.completion_ids,
    }


def _failed(term: RewardTerm, batch: RewardBatch, err: Exception) -> RewardError:
    where = _rows(batch.row_ids)
    if isinstance(err, RewardError):
        return RewardError(f"reward {term.name!r} on {where}: {err}")
    return RewardError(f"reward {term.name!r} raised on {where}: {_one_line(err)}")


def _is_async(fn: Any) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__)


def _checked(name: str, result: Any, row_ids: list[str]) -> list[float | None]:
    """`result` as one finite float or None per row.

    Raises:
        RewardError: not a sequence of `len(row_ids)` values, or a value that is not a finite number or None.
    """
    if isinstance(result, str | bytes) or not isinstance(result, Sequence):
        raise RewardError(
            f"reward {name!r} returned {type(result).__name__}; it must return a list with one value per completion"
        )
    if len(result) != len(row_ids):
        raise RewardError(f"reward {name!r} returned {len(result)} values for {len(row_ids)} completions")
    out: list[float | None] = []
    for i, value in enumerate(result):
        if value is None:
            out.append(None)
        elif not isinstance(value, numbers.Real) or not math.isfinite(value):
            raise RewardError(
                f"reward {name!r} returned {value!r} for row {i} (problem {row_ids[i]}); "
                "each value must be a finite number, or None where the reward does not apply"
            )
        else:
            out.append(float(value))
    return out


def _rows(row_ids: list[str]) -> str:
    """How an error names the rows of a batch."""
    if len(row_ids) <= 3:
        return f"rows {row_ids}"
    return f"the batch of {len(row_ids)} completions (problems {row_ids[0]} .. {row_ids[-1]})"


def _one_line(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0]}" if lines else type(err).__name__
