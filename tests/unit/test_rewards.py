"""Rewards as TRL users write them: where a completion states its answer, the math reward (math-verify in a
worker process, with a deadline), loading by name / module / file, and scoring a batch with weighted terms
(None skips, async functions under a timeout, errors that name the function and the rows)."""

from __future__ import annotations

import asyncio
import math

import pytest
from pydantic import ValidationError

from lora_rl_core.config import RewardConfig, load_config
from lora_rl_core.errors import RewardError
from lora_rl_core.rewards import (
    BUILTIN_REWARDS,
    MathReward,
    MathVerifier,
    RewardBatch,
    RewardSet,
    RewardTerm,
    extract_answer,
    format_reward,
    load_reward_function,
)
from lora_rl_core.rewards.builtin import answer_then_stop
from lora_rl_core.rewards.score import trim_stops
from lora_rl_core.rewards.verify import check_answer

NOT_CALLABLE = 3
FORMAT = RewardConfig().answer_format  # callers pass `reward.answer_format`: the config is its one source


def length_reward(prompts, completions, **kwargs):
    """A user reward for the loading tests: each completion's length."""
    return [float(len(c)) for c in completions]


@pytest.fixture(scope="module")
def verifier():
    """One verifier for the module, its worker started here (the fixture owns the process, not a test)."""
    with MathVerifier() as v:
        assert v.check(["\\sqrt{2}"], ["#### \\sqrt{2}"], "strict") == [True]  # symbolic: the worker starts here
        yield v


@pytest.mark.parametrize(
    ("text", "strict", "flexible"),
    [
        ("She makes 9 * 2 = $<<9*2=18>>18.\n#### 18", "18", "18"),
        ("#### 1,250", "1,250", "1,250"),
        ("first #### 3 then #### 4 and 5", "4 and 5", "4 and 5"),  # the last ####, to the end of its line
        ("#### 4\nCheck: 5", "4", "4"),
        ("#### none, so \\boxed{7}", "none, so \\boxed{7}", "none, so \\boxed{7}"),
        ("So the answer is \\boxed{\\frac{1}{2}}.", "\\frac{1}{2}", "\\frac{1}{2}"),
        ("\\boxed{1} then \\boxed{42}", "42", "42"),
        ("#### \n\\boxed{3}", "3", "3"),  # an empty #### line states nothing: the box does
        ("16-3-4 = 9 eggs.", None, "9"),
        ("The answer is 34 + 49.", None, None),  # an operand of an expression is no answer
        ("It costs -$5.50", None, "-$5.50"),
        ("", None, None),
    ],
)
def test_where_a_completion_states_its_answer(text, strict, flexible):
    assert extract_answer(text, "strict") == strict
    assert extract_answer(text, "flexible") == flexible


def test_an_unknown_answer_format_is_refused():
    with pytest.raises(ValueError, match=r"unknown answer format 'loose'; use one of strict, flexible"):
        extract_answer("#### 1", "loose")  # type: ignore[arg-type]
    with pytest.raises(ValidationError, match=r"answer_format"):
        RewardConfig(answer_format="loose")  # type: ignore[arg-type]


MATCHES = [
    ("#### 3.50", "3.5"),
    ("#### 1250", "1,250"),
    ("#### $1,250.00", "1250"),
    ("#### 3/4", "0.75"),
    ("#### 1/2", "0.5"),
    ("so \\boxed{\\frac{1}{2}}", "0.5"),
    ("#### 2/3", "0.6666666666666666"),
    ("#### 45%", "45"),
    ("#### 45%", "0.45"),
    ("#### 0.45", "45%"),
    ("#### 45 percent", "0.45"),
    ("#### -3 apples, 4 left", "-3"),  # the number after ####, not the last one
    ("#### \u22123", "-3"),  # a typographic minus
    ("2 + 3 = 5\n#### 5", "5"),
    ("#### €5", "5"),
    ("#### the answer is .5", "0.5"),
    ("#### Yes", " yes "),  # a gold answer with no math in it is compared as text
    ("so \\boxed{\\frac{\\pi}{2}}", "\\frac{\\pi}{2}"),  # symbolic golds: math-verify, on the span only
    ("#### (1, 2]", "(1,2]"),
    ("\\boxed{\\{1, 2\\}}", "{1,2}"),
    ("\\boxed{\\sqrt 2}", "\\sqrt{2}"),
]
MISMATCHES = [
    ("#### 45", "0.45"),
    ("#### 0.67", "0.6666666666666666"),
    ("#### 7", "-7"),
    ("#### 6", "5"),
    ("I do not know", "5"),
    ("the answer is 5", "5"),  # strict: no ####, no box
    ("#### 100.001", "100"),
    ("#### no", "yes"),
    ("#### 76 + 57", "133"),
    ("#### [1, 2]", "(1,2]"),
    ("\\boxed{\\sqrt{3}}", "\\sqrt{2}"),
    ("The area is \\frac{\\pi}{2}", "\\frac{\\pi}{2}"),  # strict: no box
]


def test_the_math_reward_grades_the_stated_answer(verifier):
    reward = MathReward(verifier, "strict")
    completions = [c for c, _ in MATCHES + MISMATCHES]
    golds = [g for _, g in MATCHES + MISMATCHES]
    values = reward(prompts=[""] * len(golds), completions=completions, completion_ids=None, answer=golds)
    assert values == [1.0] * len(MATCHES) + [0.0] * len(MISMATCHES)


# Completions as policies wrote them (issue 31 and the runs before it), with the verdict in each mode.
# (completion, gold, strict, flexible)
ADVERSARIAL = [
    # the restated question: math-verify evaluated `76 + 57` to the gold 133 (the default job's "100 %")
    ("To find the final answer to the equation 76 + 57, we can start by using the algebraic approach.", "133", 0, 0),
    ("To find the final answer to the equation 76 + 57, we can start by", "133", 0, 0),  # cut at the token limit
    ("What is 76 + 57?", "133", 0, 0),
    # an expression as the answer (the word-problems recipe's "answers")
    ("The answer is 34 + 49.", "83", 0, 0),
    ("The answer is 25000 - 8 * 1500.", "13000", 0, 0),
    ("#### 3 * 4", "12", 0, 0),
    ("3 x 4", "12", 0, 0),
    ("#### 25000 - 8 * 1500", "13000", 0, 0),
    # an expression worked out to its value is an answer
    ("76 + 57 = 133", "133", 0, 1),
    ("76 + 57 = 133\n#### 133", "133", 1, 1),
    # the answer followed by another number
    ("#### 133\nThe next one is 134.", "133", 1, 1),
    ("The sum is 133. Check: 133 - 57 = 76", "133", 0, 0),  # flexible: the last number, an operand
    ("The sum is 133, or maybe 134", "133", 0, 0),
    ("The sum is 134, no, 133", "133", 0, 1),
    # #### twice: the last one counts
    ("#### 132\n#### 133", "133", 1, 1),
    ("#### 133\n#### 132", "133", 0, 0),
    # words after the number, units, currency
    ("#### 133 apples", "133", 1, 1),
    ("#### 133.", "133", 1, 1),
    ("The answer is 133 cm.", "133", 0, 1),
    ("#### $1,250", "1250", 1, 1),
    ("He earns $1,250.00 a week", "1250", 0, 1),
    ("#### 12 km/h", "12", 1, 1),
    # negative numbers
    ("#### -7", "-7", 1, 1),
    ("#### -7", "7", 0, 0),
    ("The temperature is -7 degrees", "-7", 0, 1),
    ("So 3 - 10 = -7", "-7", 0, 1),
    ("10 - 3", "-7", 0, 0),
    # thousands commas
    ("#### 1,234,567", "1234567", 1, 1),
    ("It is 1,234 meters.", "1234", 0, 1),
    ("#### 1,23", "123", 0, 0),  # not a thousands group: 1 is stated
    # a truncated completion with a number in it
    ("Let me add them: first 70 + 50 = 120, then 6 + 7 = 13, so", "133", 0, 0),
    ("Let me add them: first 70 + 50 = 120, then 6 + 7 = 13, so 120 + 13 = 133", "133", 0, 1),
    # no answer at all
    ("I am not sure.", "133", 0, 0),
    ("", "133", 0, 0),
]


@pytest.mark.parametrize(("completion", "gold", "strict", "flexible"), ADVERSARIAL)
def test_adversarial_completions_from_real_rollouts(completion, gold, strict, flexible):
    assert (check_answer(gold, completion, "strict"), check_answer(gold, completion, "flexible")) == (
        bool(strict),
        bool(flexible),
    )


def test_the_math_reward_in_flexible_mode_reads_the_last_number(verifier):
    reward = MathReward(verifier, "flexible")
    completions = ["The answer is 5", "5 + 0", "#### 4 and then 5", "x = 5 apples"]
    assert reward(prompts=[""] * 4, completions=completions, answer=["5"] * 4) == [1.0, 0.0, 0.0, 1.0]


def test_the_math_reward_reads_conversational_completions_and_skips_rows_without_gold(verifier):
    completions = [[{"role": "assistant", "content": "#### 4"}], [{"role": "assistant", "content": "#### 4"}]]
    reward = MathReward(verifier, "strict")
    assert reward(prompts=["", ""], completions=completions, answer=["4", None]) == [1.0, None]
    with pytest.raises(RewardError, match="needs each row's gold answer.*data.answer_column"):
        reward(prompts=[""], completions=["#### 4"])


def test_an_answer_past_the_deadline_is_not_verified_and_the_worker_is_replaced(monkeypatch):
    from lora_rl_core.rewards import verify
    from tests.support import slow_verify

    # every check takes 0.5 s in the worker (it imports the function by name), past a 0.1 s deadline on any
    # machine: the import of math-verify no longer counts (the worker's initializer does it), so a fast
    # machine answered a plain check within 10 ms and the test failed now and then
    monkeypatch.setattr(verify, "check_answer", slow_verify.check_answer_slowly)
    with MathVerifier(timeout_s=0.1) as slow:
        gold, stated = "\\sqrt{2}", "\\boxed{\\sqrt{2}}"  # symbolic: math-verify, in the worker
        assert slow.check([gold], [stated], "strict") == [False] and slow.timeouts == 1
        slow.timeout_s = 60.0
        assert slow.check([gold], [stated], "strict") == [True]  # a fresh worker answers


def test_numeric_golds_are_graded_without_a_worker_process():
    with MathVerifier() as v:
        assert v.check(["133", "5"], ["#### 133", "#### 6"], "strict") == [True, False]
        assert v._pool is None


def test_format_reward():
    completions = ["#### 5", "####5.", "the answer is 5", "#### five", "#### 3 + 4", "#### 7\n#### x"]
    assert format_reward(prompts=[""] * 6, completions=completions) == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0]


@pytest.mark.parametrize(
    ("completion", "finish", "value"),
    [
        ("41 + 57 = 98\n#### 98", "eos", 1.0),  # the answer line, then end-of-sequence
        ("#### 98\n\n", "stop", 1.0),  # ended by a stop sequence, trailing white space
        ("The answer is \\boxed{98}.", "eos", 1.0),
        ("#### 98 trees", "eos", 1.0),
        ("#### 98", "length", 0.0),  # cut at the limit: `#### 98` may be the start of `#### 986`
        ("#### 16", "length", 0.0),
        ("#### 9\nThe final answer is given as a numerical answer.", "eos", 0.0),  # answer, then ramble
        ("#### 9\nThe total is 41 + 9 = 52.", "length", 0.0),
        ("#### 98, and 41 + 3 = 44", "eos", 0.0),  # another number after the answer
        ("#### 5\n#### 6", "eos", 0.0),  # two answer lines
        ("#### 5 \\boxed{5}", "eos", 0.0),  # two answer markers
        ("", "eos", 0.0),  # empty
        ("####.", "eos", 0.0),  # the instruction restated
        ("#### 34 + 49", "eos", 0.0),  # an expression, no stated number
        ("41 + 57 = 98", "eos", 0.0),  # right, but not in the asked format
        ("\\boxed{98} then more", "eos", 0.0),
    ],
)
def test_answer_then_stop_pays_only_for_an_answer_line_that_ends_the_completion(completion, finish, value):
    assert answer_then_stop(prompts=[""], completions=[completion], finish_reason=[finish]) == [value]
    # TRL's conversational format reads the same
    chat = [{"role": "assistant", "content": completion}]
    assert answer_then_stop(prompts=[""], completions=[chat], finish_reason=[finish]) == [value]


def test_answer_then_stop_needs_the_finish_reason_and_is_built_in(verifier):
    with pytest.raises(RewardError, match="finish_reason"):
        answer_then_stop(prompts=[""], completions=["#### 5"])
    assert load_reward_function("answer_then_stop", verifier, answer_format=FORMAT) is answer_then_stop
    # the leak check's restatements end with the instruction: `####.` states nothing, so nothing leaks
    assert answer_then_stop(
        prompts=["q"], completions=["What is 3 + 4?\nGive the final answer after ####."], finish_reason=["eos"]
    ) == [0.0]


def test_right_answer_then_stop_pays_only_the_right_answer_stated_last_in_a_completion_that_ended(verifier):
    term = load_reward_function("right_answer_then_stop", verifier, answer_format=FORMAT)
    completions = [
        "91 + 75 = 166\n#### 166",  # right, the answer line last, ended: 1
        "91 + 75 = 166\n#### 166\nThe sum is 166.",  # right, then more: 0
        "#### 7",  # the format alone: 0
        "2 + 3 = 5\n#### 5",  # the prompt's example copied: 0
        "91 + 75 = 166",  # right, not in the asked format: 0
        "#### 166",  # right but cut at the limit: 0
        "#### 4",  # no gold answer: no opinion
    ]
    answers = ["166"] * 6 + [None]
    finish = ["eos", "eos", "eos", "stop", "eos", "length", "eos"]
    got = term(prompts=[""] * 7, completions=completions, answer=answers, finish_reason=finish)
    assert got == [1.0, 0.0, 0.0, 0.0, 0.0, 0.0, None]
    with pytest.raises(RewardError, match="finish_reason"):
        term(prompts=[""], completions=["#### 1"], answer=["1"])


def test_reward_text_stops_at_the_first_stop_string_only_where_one_ended_it():
    texts = ["#### 5\nQuestion: more", "#### 5\nQuestion: more", "a END b STOP"]
    reasons = ["stop", "eos", "stop"]
    assert trim_stops(texts, reasons, ["Question:", "STOP", "END"]) == ["#### 5\n", "#### 5\nQuestion: more", "a "]
    assert trim_stops(texts, reasons, []) == texts


def test_load_reward_function_by_name_module_and_file(tmp_path, verifier):
    assert set(BUILTIN_REWARDS) == {"math", "format", "answer_then_stop", "right_answer_then_stop"}
    for answer_format in ("strict", "flexible"):
        math_term = load_reward_function("math", verifier, answer_format=answer_format)
        assert isinstance(math_term, MathReward) and math_term.answer_format == answer_format
    assert load_reward_function("format", verifier, answer_format=FORMAT) is format_reward
    assert (
        load_reward_function("tests.unit.test_rewards:length_reward", verifier, answer_format=FORMAT) is length_reward
    )
    folder = tmp_path / "recipe"
    folder.mkdir()
    (folder / "my_rewards.py").write_text(
        "def shout(prompts, completions, **kw):\n    return [1.0] * len(completions)\n"
    )
    (folder / "run.yaml").write_text("reward:\n  functions:\n    - name: my_rewards.py:shout\n")
    cfg = load_config(folder / "run.yaml")  # a relative file is taken from the config's folder
    assert cfg.reward.files_dir == str(folder) and cfg.reward.functions[0].name == "my_rewards.py:shout"
    fn = load_reward_function(cfg.reward.functions[0].name, verifier, cfg.reward.files_dir, answer_format=FORMAT)
    assert fn(prompts=["a"], completions=["b", "c"]) == [1.0, 1.0]
    with RewardSet.from_config(cfg.reward) as terms:
        assert terms.names == ["shout"]  # logged as rewards/shout/mean, TRL's name for it


@pytest.mark.parametrize(
    ("name", "message"),
    [
        (
            "accuracy",
            r"unknown reward 'accuracy'; use one of: answer_then_stop, format, math, right_answer_then_stop, "
            r"'module\.path:function'",
        ),
        ("mod:", r"unknown reward 'mod:'"),
        ("no_such_pkg_xyz.mod:fn", r"cannot import reward module 'no_such_pkg_xyz\.mod' .*ModuleNotFoundError"),
        ("tests.unit.test_rewards:no_such_fn", r"tests\.unit\.test_rewards has no attribute 'no_such_fn'"),
        ("tests.unit.test_rewards:NOT_CALLABLE", r"is a int, not a function"),
        ("/nowhere/r.py:fn", r"file not found: /nowhere/r\.py"),
    ],
)
def test_load_reward_errors(name, message, verifier):
    with pytest.raises(RewardError, match=message):
        load_reward_function(name, verifier, answer_format=FORMAT)


def batch(completions, **columns):
    n = len(completions)
    return RewardBatch(
        prompts=[f"p{i}" for i in range(n)],
        completions=list(completions),
        completion_ids=[[1, 2]] * n,
        columns={k: list(v) for k, v in columns.items()},
        row_ids=[f"row-{i}" for i in range(n)],
    )


def rewards(*terms, timeout_s=5.0):
    """A set of the given terms; its own verifier never starts (the math terms use the module's)."""
    return RewardSet([RewardTerm(n, f, w) for n, f, w in terms], MathVerifier(), timeout_s=timeout_s)


def test_weighted_terms_see_every_column_and_none_skips(verifier):
    seen = {}

    def by_column(prompts, completions, completion_ids, answer, difficulty, **kw):
        seen.update(prompts=prompts, ids=completion_ids, difficulty=difficulty)
        return [None if d == "skip" else 2.0 for d in difficulty]

    def never(prompts, completions, **kw):
        return [None, None, 0.5]

    with rewards(("math", MathReward(verifier, FORMAT), 1.0), ("mine", by_column, 0.5), ("half", never, 2.0)) as terms:
        scored = terms.score(batch(["#### 5", "#### 4", "x"], answer=["5", None, None], difficulty=["a", "skip", "b"]))
    assert scored.terms == {"math": [1.0, None, None], "mine": [2.0, None, 2.0], "half": [None, None, 0.5]}
    assert scored.totals == [2.0, 0.0, 2.0] and scored.skipped == [False, True, False]
    assert scored.term_means() == {"math": 1.0, "mine": 2.0, "half": 0.5}
    assert seen == {"prompts": ["p0", "p1", "p2"], "ids": [[1, 2]] * 3, "difficulty": ["a", "skip", "b"]}


def test_async_rewards_run_concurrently_and_a_slow_one_fails_the_batch_by_name():
    async def judge(prompts, completions, **kw):
        await asyncio.sleep(0.3)
        return [1.0] * len(completions)

    async def slow(prompts, completions, **kw):
        await asyncio.sleep(30)
        return [1.0] * len(completions)

    with rewards(("a", judge, 1.0), ("b", judge, 1.0), ("c", judge, 1.0)) as terms:
        import time

        start = time.perf_counter()
        assert terms.score(batch(["x", "y"])).totals == [3.0, 3.0]
        assert time.perf_counter() - start < 0.8  # three 0.3 s calls at once
    with (
        rewards(("judge", slow, 1.0), timeout_s=0.2) as terms,
        pytest.raises(RewardError, match=r"reward 'judge' did not answer within 0\.2 s \(reward\.timeout_s\) for rows"),
    ):
        terms.score(batch(["x"]))


def _raises(prompts, completions, **kw):
    raise ValueError("boom\nsecond line")


@pytest.mark.parametrize(
    ("fn", "message"),
    [
        (_raises, r"reward 'custom' raised on rows \['row-0', 'row-1'\]: ValueError: boom$"),
        (lambda prompts, completions, **kw: [1.0, math.nan], r"returned nan for row 1 \(problem row-1\)"),
        (lambda prompts, completions, **kw: ["1.0", 1.0], r"returned '1\.0' for row 0"),
        (lambda prompts, completions, **kw: [1.0], r"returned 1 values for 2 completions"),
        (lambda prompts, completions, **kw: 1.0, r"returned float; it must return a list"),
    ],
)
def test_a_bad_reward_fails_the_batch_naming_it_and_the_rows(fn, message):
    with rewards(("custom", fn, 1.0)) as terms, pytest.raises(RewardError, match=message):
        terms.score(batch(["ok", "bad"]))


def test_reward_set_arguments(verifier):
    with pytest.raises(RewardError, match=r"distinct names"):
        rewards(("m", format_reward, 1.0), ("m", format_reward, 1.0))
    with pytest.raises(RewardError, match=r"weight inf"):
        rewards(("m", format_reward, math.inf))
    with RewardSet.from_config(RewardConfig()) as default:
        assert default.names == ["math"] and default.timeout_s == 60.0
        assert default.terms[0].fn.answer_format == "flexible"  # the config's default, the only one
    with RewardSet.from_config(RewardConfig(answer_format="strict")) as strict:
        assert strict.terms[0].fn.answer_format == "strict"


def test_the_gold_answer_reaches_rewards_as_answer_whatever_its_column(verifier):
    """`data.answer_column: solution`: the `math` reward still finds the gold answer (as `answer`)."""
    from lora_rl_core.data import Problem

    problems = [Problem("2+2?", "4", "p0", {"solution": "4", "level": 1}), Problem("x", None, "p1", {"level": 2})]
    batch_ = RewardBatch.from_problems(problems, ["#### 4", "#### 1"], [[1], [2]], ["eos", "length"])
    assert batch_.columns == {
        "answer": ["4", None],
        "finish_reason": ["eos", "length"],
        "level": [1, 2],
        "solution": ["4", None],
    }
    with RewardSet([RewardTerm("math", MathReward(verifier, FORMAT), 1.0)], MathVerifier(), timeout_s=5.0) as terms:
        assert terms.score(batch_).terms == {"math": [1.0, None]}


def test_a_plain_reward_may_run_its_own_event_loop_and_async_clients_survive_batches():
    """Plain functions run outside the set's event loop (one that wraps an async client with asyncio.run
    works); async functions share one loop across batches (a client bound to it stays usable)."""
    loops = []

    def wraps_async(prompts, completions, **kw):
        return asyncio.run(_one_each(completions))

    async def keeps_its_loop(prompts, completions, **kw):
        loops.append(asyncio.get_running_loop())
        return [0.5] * len(completions)

    with rewards(("wrap", wraps_async, 1.0), ("keep", keeps_its_loop, 1.0)) as terms:
        assert terms.score(batch(["a", "b"])).totals == [1.5, 1.5]
        assert terms.score(batch(["c"])).totals == [1.5]
    assert len(loops) == 2 and loops[0] is loops[1] and loops[0].is_closed()


async def _one_each(completions):
    return [1.0] * len(completions)


def test_a_closed_verifier_refuses_work():
    closed = MathVerifier()
    closed.close()
    with pytest.raises(RuntimeError, match="closed"):
        closed.check(["1"], ["1"], "flexible")
