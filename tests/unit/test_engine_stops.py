"""Stop sequences on the embedded engine: generation halts at the token that completes a stop string or is a
stop token id (fewer forward passes, the stop's tokens and logprobs kept, `finish_reason` `stop`), EOS ends a
completion as `eos`, the limit as `length`; a stop string begun in the prompt does not count.

Sampling is seeded: one request (or one batch) draws the same tokens with and without stops up to where the
stops end it, so the run without stops is the reference. Two tokenizers: the tiny model's own, whose decoding
puts spaces between tokens (transformers' `StopStringCriteria` cannot read its vocabulary: `DecodedStops`
matches), and the same vocabulary with a fusing decoder (`StopStringCriteria` matches)."""

from __future__ import annotations

import pytest
import torch
from tokenizers import decoders
from transformers import AutoModelForCausalLM, AutoTokenizer, StopStringCriteria

from lora_rl_core.engines import Completion, EmbeddedEngine, GenerationRequest, SamplingParams
from lora_rl_core.engines.embedded.generation import DecodedStops, stop_match
from lora_rl_core.engines.embedded.peft_model import finish_points
from tests.support.embedded_engine import tiny_tokenizer

EOS = 2  # <|im_end|>
SAMPLED = SamplingParams(max_new_tokens=24, temperature=1.0, seed=11)


@pytest.fixture
def fused_tokenizer(tiny_model_dir):
    """The tiny vocabulary decoded without spaces between tokens (a fresh copy: the shared one stays as is)."""
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tok.backend_tokenizer.decoder = decoders.Fuse()
    return tok


def counted_engine(model_dir, tokenizer, eos: list[int] | None = None) -> tuple[EmbeddedEngine, list[int]]:
    """An engine over the tiny model and a list that grows by one per forward pass of the model."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if eos is not None:
        model.generation_config.eos_token_id = eos
    calls: list[int] = []
    model.register_forward_pre_hook(lambda *_: calls.append(1))
    return EmbeddedEngine(model, tokenizer, max_batch_size=8), calls


def run(engine: EmbeddedEngine, calls: list[int], prompt: list[int], params: SamplingParams) -> tuple[Completion, int]:
    calls.clear()
    (done,) = engine.generate([GenerationRequest(prompt, None, params)])
    return done, len(calls)


def first_new(tokens: list[int], start: int) -> int:
    """The first index >= `start` whose token did not occur before it (and is no special token)."""
    return next(i for i in range(start, len(tokens)) if tokens[i] > 3 and tokens[i] not in tokens[:i])


@pytest.fixture
def prompt(tiny_model_dir) -> list[int]:
    return tiny_tokenizer(tiny_model_dir)("What is 3 + 4?")["input_ids"]


def test_stop_string_halts_generation_and_keeps_its_token(tiny_model_dir, prompt) -> None:
    tok = tiny_tokenizer(tiny_model_dir)
    engine, calls = counted_engine(tiny_model_dir, tok)
    with engine:
        full, full_calls = run(engine, calls, prompt, SAMPLED)
        assert (full.finish_reason, len(full.completion_ids)) == ("length", 24) and full_calls == 24
        k = first_new(full.completion_ids, 3)
        stop = tok.decode([full.completion_ids[k]])
        cut, cut_calls = run(engine, calls, prompt, SamplingParams(**{**SAMPLED.__dict__, "stop": (stop,)}))
    assert isinstance(stop_match(tok, (stop,)), DecodedStops)  # this tokenizer: matched by decoding
    assert cut.finish_reason == "stop"
    assert cut.completion_ids == full.completion_ids[: k + 1]  # the stop's token is kept
    assert cut.logprobs == pytest.approx(full.logprobs[: k + 1], abs=1e-5)
    assert cut_calls == k + 1 < full_calls  # halted: no forward pass past the stop


def test_stop_string_of_several_tokens_with_transformers_matching(tiny_model_dir, fused_tokenizer, prompt) -> None:
    engine, calls = counted_engine(tiny_model_dir, fused_tokenizer)
    with engine:
        full, _ = run(engine, calls, prompt, SAMPLED)
        ids = full.completion_ids
        pair = [fused_tokenizer.decode(ids[i - 1 : i + 1]) for i in range(len(ids))]
        k = next(i for i in range(4, len(ids)) if pair[i] not in fused_tokenizer.decode(ids[:i]))
        stop = pair[k]  # two tokens' text, first completed at k
        cut, cut_calls = run(engine, calls, prompt, SamplingParams(**{**SAMPLED.__dict__, "stop": ("zzz", stop)}))
    assert not isinstance(stop_match(fused_tokenizer, (stop,)), DecodedStops)  # transformers' StopStringCriteria
    assert (cut.finish_reason, cut.completion_ids) == ("stop", ids[: k + 1])
    assert cut_calls == k + 1


def test_stop_string_begun_in_the_prompt_does_not_end_the_completion(tiny_model_dir, fused_tokenizer, prompt) -> None:
    engine, calls = counted_engine(tiny_model_dir, fused_tokenizer)
    with engine:
        full, _ = run(engine, calls, prompt, SAMPLED)
        ids = full.completion_ids
        stop = fused_tokenizer.decode([prompt[-1], ids[0]])  # the prompt's last token + the first new one
        cut, _ = run(engine, calls, prompt, SamplingParams(**{**SAMPLED.__dict__, "stop": (stop,)}))
    hf_own = StopStringCriteria(fused_tokenizer, [stop])  # what `generate(stop_strings=...)` would check
    assert bool(hf_own(torch.tensor([prompt + ids[:1]]), None)[0])  # ... and stop at the first token
    text = fused_tokenizer.decode(ids)
    assert stop not in text[:2] and len(cut.completion_ids) > 1
    if stop in text:  # where the completion writes it itself, there it ends
        assert cut.finish_reason == "stop" and fused_tokenizer.decode(cut.completion_ids).endswith(stop)
    else:
        assert (cut.completion_ids, cut.finish_reason) == (full.completion_ids, full.finish_reason)


def test_stop_token_id_eos_and_limit(tiny_model_dir, prompt) -> None:
    tok = tiny_tokenizer(tiny_model_dir)
    engine, calls = counted_engine(tiny_model_dir, tok)
    with engine:
        full, _ = run(engine, calls, prompt, SAMPLED)
        k = first_new(full.completion_ids, 2)
        token = full.completion_ids[k]
        by_id, id_calls = run(engine, calls, prompt, SamplingParams(**{**SAMPLED.__dict__, "stop_token_ids": (token,)}))
        limited, _ = run(engine, calls, prompt, SamplingParams(**{**SAMPLED.__dict__, "max_new_tokens": k}))
    assert (by_id.finish_reason, by_id.completion_ids, id_calls) == ("stop", full.completion_ids[: k + 1], k + 1)
    assert by_id.logprobs == pytest.approx(full.logprobs[: k + 1], abs=1e-5)
    assert (limited.finish_reason, limited.completion_ids) == ("length", full.completion_ids[:k])
    # the same token as one of the model's EOS ids: `eos`; listed as a stop token id too: `stop`
    engine, calls = counted_engine(tiny_model_dir, tok, eos=[EOS, token])
    with engine:
        by_eos, eos_calls = run(engine, calls, prompt, SAMPLED)
        both, _ = run(engine, calls, prompt, SamplingParams(**{**SAMPLED.__dict__, "stop_token_ids": (token,)}))
    assert (by_eos.finish_reason, by_eos.completion_ids, eos_calls) == ("eos", full.completion_ids[: k + 1], k + 1)
    assert (both.finish_reason, both.completion_ids) == ("stop", full.completion_ids[: k + 1])


def test_rows_of_a_batch_end_each_at_their_own_stop(tiny_model_dir) -> None:
    tok = tiny_tokenizer(tiny_model_dir)
    prompts = [tok(f"What is {i} + {2 * i}?")["input_ids"] for i in range(4)]
    engine, calls = counted_engine(tiny_model_dir, tok)
    with engine:
        full = engine.generate([GenerationRequest(p, None, SAMPLED) for p in prompts])
        stop = tok.decode([full[0].completion_ids[first_new(full[0].completion_ids, 2)]])
        params = SamplingParams(**{**SAMPLED.__dict__, "stop": (stop,)})
        cut = engine.generate([GenerationRequest(p, None, params) for p in prompts])
    assert engine.metrics()["batches"] == 2  # each call one batch
    for c, f in zip(cut, full, strict=True):
        text = [tok.decode([t]) for t in f.completion_ids]
        end = text.index(stop) + 1 if stop in text else len(text)
        assert c.completion_ids == f.completion_ids[:end]
        assert c.finish_reason == ("stop" if stop in text else f.finish_reason)
        assert c.logprobs == pytest.approx(f.logprobs[:end], abs=1e-5)
    assert any(c.finish_reason == "length" for c in cut) or max(len(c.completion_ids) for c in cut) < 24


def test_finish_points_take_the_first_end_of_each_row() -> None:
    tokens = torch.tensor(
        [
            [5, 6, 2, 7],  # EOS at 2
            [5, 9, 6, 2],  # stop token id 9 at 1
            [5, 6, 7, 8],  # stop string completed at 2, nothing else: stop
            [5, 2, 7, 8],  # EOS at 1 before the stop string at 3: eos
            [5, 6, 2, 8],  # stop string completed by the EOS token at 2: the string wins (SGLang's order)
            [5, 6, 7, 8],  # nothing: length
            [2, 6, 7, 8],  # an id both EOS and stop token id would be `stop`; EOS alone: eos
        ]
    )
    stop_at = torch.tensor([-1, -1, 2, 3, 2, -1, -1])
    assert finish_points(tokens, [2], (9,), stop_at) == [
        (3, "eos"), (2, "stop"), (3, "stop"), (2, "eos"), (3, "stop"), (4, "length"), (1, "eos"),
    ]  # fmt: skip
    assert finish_points(tokens[:1], [2], (2,), None) == [(3, "stop")]  # EOS listed as a stop token id
    assert finish_points(tokens[5:6], [], (), None) == [(4, "length")]
