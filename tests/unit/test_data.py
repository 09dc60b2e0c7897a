"""Unit tests for lora_rl_core.data: loaders, arithmetic problems, sampler, prompts."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from pydantic import ValidationError

from lora_rl_core.config import DataConfig
from lora_rl_core.data import (
    ArithmeticGenerator,
    Problem,
    PromptSampler,
    arithmetic_split,
    build_messages,
    load_problems,
    prompt_instruction,
    render_prompt,
)
from lora_rl_core.errors import DataError

DATA_DIR = Path(__file__).resolve().parents[2] / "data"


# --- loaders: presets and any dataset through `datasets` ---------------------------------------------------


def load(split="test", **data):
    """Problems of a `data` section (defaults: the vendored files under DATA_DIR)."""
    return load_problems(DataConfig(data_dir=str(DATA_DIR), eval_size=None, **data), split, seed=0)


def test_gsm8k_test_loads_all_rows_with_numeric_answers():
    problems = load(source="gsm8k")
    assert len(problems) == 1319
    assert problems[0].answer == "18"
    assert problems[0].id == "gsm8k-test-0"
    assert problems[17].id == "gsm8k-test-17"
    assert problems[0].question.startswith("Janet")
    assert all(re.fullmatch(r"-?[\d,]+", p.answer) for p in problems)
    assert len({p.id for p in problems}) == 1319
    assert problems[0].columns == {"answer": "18"}  # the parsed gold answer reaches rewards as `answer`


@pytest.mark.parametrize(("split", "rows"), [("test", 384), ("train", 1537)])
def test_mawps_loads_all_rows(split, rows):
    problems = load(split, source="mawps")
    assert len(problems) == rows
    assert problems[0].id == f"mawps-{split}-0"


def test_mawps_answer_is_taken_as_is_and_other_columns_travel():
    first = json.loads((DATA_DIR / "mawps" / "test.jsonl").read_text().splitlines()[0])
    problem = load(source="mawps")[0]
    assert problem == Problem(first["question"], first["answer"], "mawps-test-0")
    assert problem.columns == {"answer": first["answer"], "equation_prefix": first["equation_prefix"]}


def test_limit_and_explicit_path():
    cfg = DataConfig(source="gsm8k", data_dir=str(DATA_DIR), train_path=str(DATA_DIR / "gsm8k" / "test.jsonl"))
    problems = load_problems(cfg, "train", seed=0)[:5]
    assert [p.id for p in problems] == [f"gsm8k-test-{i}" for i in range(5)]
    assert [p.id for p in load_problems(cfg.model_copy(update={"eval_size": 3}), "test", seed=0)] == [
        "gsm8k-test-0",
        "gsm8k-test-1",
        "gsm8k-test-2",
    ]


def _write(tmp_path: Path, lines: list[str], name: str = "rows.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def _gsm8k(path: Path) -> list[Problem]:
    return load("train", source="gsm8k", train_path=str(path))


def test_gsm8k_answer_is_after_last_marker_and_blank_lines_skipped(tmp_path):
    rows = [
        json.dumps({"question": "q1", "answer": "a #### 3\nso #### 1,250 "}),
        "",
        json.dumps({"question": "q2", "answer": "#### -4"}),
    ]
    problems = _gsm8k(_write(tmp_path, rows))
    assert problems == [Problem("q1", "1,250", "gsm8k-rows-0"), Problem("q2", "-4", "gsm8k-rows-1")]


def test_missing_file_names_the_path(tmp_path):
    with pytest.raises(DataError, match=r"dataset file not found: .*nope\.jsonl"):
        _gsm8k(tmp_path / "nope.jsonl")


def test_bad_json_names_file_and_line(tmp_path):
    path = _write(tmp_path, [json.dumps({"question": "q", "answer": "1"}), "{not json"])
    with pytest.raises(DataError, match=r"rows\.jsonl:2: invalid JSON"):
        _gsm8k(path)


def test_missing_column_names_the_column_and_the_fix(tmp_path):
    path = _write(tmp_path, [json.dumps({"question": "q", "answer": "#### 1"})])
    with pytest.raises(DataError, match=r"rows\.jsonl has no column 'prompt' .*set data.prompt_column"):
        load("train", source="dataset", path=str(path))


def test_gsm8k_answer_without_marker_names_the_row(tmp_path):
    path = _write(
        tmp_path, [json.dumps({"question": "q", "answer": "#### 1"}), json.dumps({"question": "q", "answer": "42"})]
    )
    with pytest.raises(DataError, match=r"rows\.jsonl, row 1: column 'answer' has no '####'"):
        _gsm8k(path)


def test_non_object_row(tmp_path):
    with pytest.raises(DataError, match=r"rows\.jsonl:1: expected a JSON object, got list"):
        _gsm8k(_write(tmp_path, ["[1, 2]"]))


def test_empty_file(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n")
    with pytest.raises(DataError, match=r"empty\.jsonl"):
        _gsm8k(path)


def test_unknown_source_and_a_dataset_without_a_place_are_config_errors():
    with pytest.raises(ValidationError, match="source"):
        DataConfig(source="svamp")
    with pytest.raises(ValidationError, match="data.path"):
        DataConfig(source="dataset")


@pytest.mark.parametrize("fmt", ["jsonl", "json", "csv", "parquet"])
def test_any_local_file_in_trl_standard_format_with_its_columns(tmp_path, fmt):
    """TRL's standard format: `prompt` text; the answer column is optional; every other column travels."""
    import datasets

    rows = [{"prompt": "2+2?", "answer": "4", "source": "a"}, {"prompt": "3+3?", "answer": "6", "source": "b"}]
    path = tmp_path / f"train.{fmt}"
    table = datasets.Dataset.from_list(rows)
    {"jsonl": lambda: table.to_json(path), "json": lambda: path.write_text(json.dumps(rows)),
     "csv": lambda: table.to_csv(path, index=False), "parquet": lambda: table.to_parquet(path)}[fmt]()  # fmt: skip
    problems = load("train", source="dataset", path=str(path))
    assert [(p.prompt, p.answer, p.columns["source"]) for p in problems] == [("2+2?", "4", "a"), ("3+3?", "6", "b")]
    assert problems[0].id == "train-train-0" and problems[1].columns == {"answer": "6", "source": "b"}


def test_conversational_prompts_and_no_answer_column(tmp_path):
    rows = [{"messages": [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Hi?"}], "lang": "en"}]
    path = _write(tmp_path, [json.dumps(r) for r in rows], "chat.jsonl")
    [problem] = load("train", source="dataset", path=str(path), prompt_column="messages")
    assert problem.prompt == rows[0]["messages"] and problem.answer is None and problem.columns == {"lang": "en"}
    assert problem.question == "Hi?"
    messages = build_messages(problem, system_prompt="ignored: the prompt has its own", instruction="Be short.")
    assert messages == [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Hi?\nBe short."}]


def test_a_malformed_prompt_names_the_row_and_the_column(tmp_path):
    path = _write(tmp_path, [json.dumps({"prompt": "ok"}), json.dumps({"prompt": [{"role": "user"}]})])
    with pytest.raises(DataError, match=r"rows\.jsonl, row 1: column 'prompt' must be text or a list of"):
        load("train", source="dataset", path=str(path))


def test_a_hub_style_folder_with_splits_and_a_missing_split(tmp_path):
    folder = tmp_path / "ds"
    folder.mkdir()
    _write(folder, [json.dumps({"prompt": "a", "answer": "1"})], "train.jsonl")
    _write(folder, [json.dumps({"prompt": "b", "answer": "2"})], "test.jsonl")
    assert [p.prompt for p in load("test", source="dataset", path=str(folder))] == ["b"]
    with pytest.raises(DataError, match=r"cannot load .*ds split 'validation'"):
        load("test", source="dataset", path=str(folder), test_split="validation")


def test_the_prompt_instruction_is_the_sources_own_unless_set():
    from lora_rl_core.config import RolloutConfig

    assert prompt_instruction(DataConfig(), RolloutConfig()) == "Give the final answer after ####."
    assert prompt_instruction(DataConfig(source="dataset", path="x"), RolloutConfig()) == ""
    assert prompt_instruction(DataConfig(source="dataset", path="x"), RolloutConfig(instruction="Think.")) == "Think."


# --- arithmetic ----------------------------------------------------------------


def test_generator_is_deterministic_and_order_free():
    a = ArithmeticGenerator(("+", "-", "*"), 2, seed=7)
    b = ArithmeticGenerator(("+", "-", "*"), 2, seed=7)
    assert a.problems(0, 50) == b.problems(0, 50)
    assert a.problem(37) == b.problems(30, 10)[7]
    assert a.problems(0, 50) != ArithmeticGenerator(("+", "-", "*"), 2, seed=8).problems(0, 50)


@pytest.mark.parametrize("digits", [1, 2, 3, (1, 4)])
def test_generator_answers_are_correct(digits):
    lo, hi = (digits, digits) if isinstance(digits, int) else digits
    seen_ops = set()
    for p in ArithmeticGenerator(("+", "-", "*"), digits, seed=3).problems(0, 200):
        match = re.fullmatch(r"What is (\d+) ([-+*]) (\d+)\?", p.question)
        assert match, p.question
        a, op, b = match.groups()
        assert all(lo <= len(x) <= hi and not x.startswith("0") for x in (a, b))
        assert int(p.answer) == eval(f"{a} {op} {b}")  # noqa: S307 - checked digits only
        seen_ops.add(op)
    assert seen_ops == {"+", "-", "*"}


def test_generator_id_and_single_operation():
    p = ArithmeticGenerator("+", 2, seed=0).problem(5)
    assert p.id == "arith-add-2d-s0-5"
    assert " + " in p.question


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"operations": ("/",)}, r"operations must be a non-empty subset"),
        ({"operations": ()}, r"operations must be a non-empty subset"),
        ({"digits": 0}, r"digits must be an int >= 1"),
        ({"digits": (3, 2)}, r"digits must be an int >= 1"),
        ({"digits": 2.0}, r"digits must be an int >= 1"),
    ],
)
def test_generator_rejects_bad_arguments(kwargs, message):
    with pytest.raises(DataError, match=message):
        ArithmeticGenerator(**kwargs)


def test_split_test_is_fixed_and_disjoint_from_train():
    test = arithmetic_split(("+", "-"), 2, split="test", size=128, seed=0)
    assert test == arithmetic_split(("+", "-"), 2, split="test", size=128, seed=0)
    assert arithmetic_split(("+", "-"), 2, split="test", size=200, seed=0)[:128] == test
    train = arithmetic_split(("+", "-"), 2, split="train", size=2000, seed=0)
    assert len(train) == 2000
    pool = arithmetic_split(("+", "-"), 2, split="test", size=512, seed=0)
    assert not {p.question for p in train} & {p.question for p in pool}


def test_split_train_excludes_test_in_a_small_space():
    # 1-digit "+" has only 81 questions, so the stream repeats them often.
    test = arithmetic_split("+", 1, split="test", size=20, seed=1, test_pool=20)
    train = arithmetic_split("+", 1, split="train", size=300, seed=1, test_pool=20)
    assert not {p.question for p in train} & {p.question for p in test}


def test_split_errors():
    with pytest.raises(DataError, match=r"test size 600 exceeds test_pool=512"):
        arithmetic_split("+", 2, split="test", size=600, seed=0)
    with pytest.raises(DataError, match=r"too few distinct problems"):
        arithmetic_split("+", 1, split="train", size=10, seed=0)  # 512 test draws cover all 81


# --- sampler -------------------------------------------------------------------


def _problems(n: int) -> list[Problem]:
    return [Problem(f"q{i}", str(i), f"p{i}") for i in range(n)]


def test_sampler_epochs_are_permutations_and_reshuffle():
    sampler = PromptSampler(_problems(10), seed=0)
    first, second = sampler.next_batch(10), sampler.next_batch(10)
    assert sorted(p.id for p in first) == sorted(p.id for p in second) == sorted(f"p{i}" for i in range(10))
    assert first != second
    assert sampler.state_dict() == {"epoch": 1, "index": 10, "seed": 0}


def test_sampler_resume_gives_same_batches():
    problems = _problems(7)
    sampler = PromptSampler(problems, seed=3)
    for _ in range(3):
        sampler.next_batch(4)
    state = json.loads(json.dumps(sampler.state_dict()))
    expected = [sampler.next_batch(4), sampler.next_batch(4)]
    resumed = PromptSampler(problems, seed=3)
    resumed.load_state_dict(state)
    assert [resumed.next_batch(4), resumed.next_batch(4)] == expected


def test_sampler_batch_wraps_across_epochs():
    sampler = PromptSampler(_problems(3), seed=0)
    batch = sampler.next_batch(7)
    assert len(batch) == 7
    assert sampler.state_dict() == {"epoch": 2, "index": 1, "seed": 0}


@pytest.mark.parametrize(
    ("state", "message"),
    [
        ({"epoch": 0, "index": 0}, r"must be a dict with keys"),
        ({"epoch": 0, "index": "1", "seed": 0}, r"values must be integers"),
        ({"epoch": 0, "index": 0, "seed": 9}, r"has seed 9 but the sampler has seed 0"),
        ({"epoch": 0, "index": 11, "seed": 0}, r"out of range for 10 problems"),
        ({"epoch": -1, "index": 0, "seed": 0}, r"out of range"),
    ],
)
def test_sampler_rejects_bad_state(state, message):
    with pytest.raises(DataError, match=message):
        PromptSampler(_problems(10), seed=0).load_state_dict(state)


def test_sampler_rejects_empty_and_bad_batch():
    with pytest.raises(DataError, match=r"at least one problem"):
        PromptSampler([], seed=0)
    with pytest.raises(DataError, match=r"batch size must be a positive integer"):
        PromptSampler(_problems(2), seed=0).next_batch(0)


# --- prompts -------------------------------------------------------------------

_WORDS = "<system> <user> <assistant> What is 2 + 3 ? Answer after ####. Be brief."
_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


@pytest.fixture
def tiny_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0} | {w: i + 1 for i, w in enumerate(_WORDS.split())}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")
    tokenizer.chat_template = _TEMPLATE
    return tokenizer, vocab


PROBLEM = Problem("What is 2 + 3 ?", "5", "p0")


def test_build_messages():
    assert build_messages(PROBLEM, system_prompt="Be brief.", instruction="Answer after ####.") == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2 + 3 ?\nAnswer after ####."},
    ]
    assert build_messages(PROBLEM, system_prompt=None, instruction="x") == [
        {"role": "user", "content": "What is 2 + 3 ?\nx"}
    ]


def test_render_prompt_with_chat_template(tiny_tokenizer):
    tokenizer, vocab = tiny_tokenizer
    ids = render_prompt(tokenizer, PROBLEM, system_prompt="Be brief.", instruction="Answer after ####.")
    words = "<system> Be brief. <user> What is 2 + 3 ? Answer after ####. <assistant>".split()
    assert ids == [vocab[w] for w in words]
    assert all(type(i) is int for i in ids)


def test_render_prompt_without_chat_template(tiny_tokenizer):
    tokenizer, vocab = tiny_tokenizer
    tokenizer.chat_template = None
    ids = render_prompt(tokenizer, PROBLEM, system_prompt=None, instruction="Answer after ####.")
    assert ids == [vocab[w] for w in "What is 2 + 3 ? Answer after ####.".split()]


def test_the_math_reward_without_gold_answers_is_refused_before_step_one(tmp_path):
    from lora_rl_core.config import load_config
    from lora_rl_core.run.inputs import check_answers

    path = _write(tmp_path, [json.dumps({"prompt": "Say hi."})], "hi.jsonl")
    cfg = load_config(None, ["data.source=dataset", f"data.path={path}"])
    problems = load_problems(cfg.data, "train", seed=0)
    with pytest.raises(DataError, match=r"the math reward needs gold answers.*column 'answer'.*data.answer_column"):
        check_answers(cfg, problems, [])
    check_answers(load_config(None, ["reward.functions=[{name: format}]"]), problems, [])  # a reward that needs none


def test_the_evaluation_without_gold_answers_needs_a_named_grader(tmp_path):
    from lora_rl_core.config import load_config
    from lora_rl_core.run.inputs import check_answers

    path = _write(tmp_path, [json.dumps({"prompt": "Say hi."})], "hi.jsonl")
    cfg = load_config(None, ["data.source=dataset", f"data.path={path}", "reward.functions=[{name: format}]"])
    problems = load_problems(cfg.data, "train", seed=0)  # the held-out rows, as far as the check goes
    with pytest.raises(
        DataError, match=r"grades against gold answers .*1 problem have none \(first: hi-.*eval\.grader"
    ):
        check_answers(cfg, problems, problems)
    check_answers(cfg.model_copy(update={"eval": cfg.eval.model_copy(update={"grader": "format"})}), problems, problems)
    check_answers(cfg.model_copy(update={"run": cfg.run.model_copy(update={"eval_before_after": False})}), [], problems)
