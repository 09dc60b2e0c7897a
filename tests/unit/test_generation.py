"""Generation batch: the inverse-CDF sampler draws from the right distribution; shared prefill of repeated
prompts, and rows that leave the batch when they end, give the same tokens and logprobs as plain HF generation."""

from __future__ import annotations

import warnings

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, GenerationConfig, LogitsProcessorList

from lora_rl_core.engines import SamplingParams
from lora_rl_core.engines.embedded.generation import (
    _CACHE_KWARGS,
    InverseCdfSampler,
    cache_kwarg,
    generate_batch,
    left_pad,
    shared_prefill,
)

PAD, EOS = 0, 2


def _sample(sampler: InverseCdfSampler, logits_V: torch.Tensor, n: int) -> torch.Tensor:
    scores = sampler(torch.zeros(n, 1, dtype=torch.long), logits_V.expand(n, -1).clone())
    assert torch.isfinite(scores).sum(dim=-1).eq(1).all(), "exactly one finite score per row"
    return scores.argmax(dim=-1)


def test_sampler_matches_softmax_distribution() -> None:
    torch.manual_seed(0)
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0, -30.0])
    for temperature in (1.0, 0.7):
        counts = torch.bincount(_sample(InverseCdfSampler(temperature), logits, 200_000), minlength=5)
        expected = torch.softmax(logits / temperature, dim=-1)
        # 200k draws: the standard error of each frequency is below 0.0012
        assert torch.allclose(counts / counts.sum(), expected, atol=0.005), (temperature, counts)


def test_sampler_never_draws_filtered_or_zero_probability_tokens() -> None:
    torch.manual_seed(1)
    logits = torch.tensor([3.0, 2.5, 0.0, -1.0, float("-inf"), 1.0])
    top_k = _sample(InverseCdfSampler(1.0, top_k=2), logits, 20_000)
    assert set(top_k.tolist()) == {0, 1}
    top_p = _sample(InverseCdfSampler(1.0, top_p=0.5), logits, 20_000)
    assert set(top_p.tolist()) == {0}  # p(token 0) = 0.53 already covers top_p = 0.5
    plain = _sample(InverseCdfSampler(1.0), logits, 20_000)
    assert 4 not in plain.tolist()


def test_sampler_rejects_greedy_temperature() -> None:
    with pytest.raises(ValueError, match="temperature > 0"):
        InverseCdfSampler(0.0)


def test_sampler_is_reproducible_from_the_seed() -> None:
    logits = torch.randn(49_152)
    torch.manual_seed(7)
    a = _sample(InverseCdfSampler(1.0), logits, 64)
    torch.manual_seed(7)
    b = _sample(InverseCdfSampler(1.0), logits, 64)
    assert torch.equal(a, b)


@pytest.fixture(scope="module")
def models(tiny_model_dir):
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    peft = get_peft_model(
        AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32),
        LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False),
        adapter_name="a1",
    ).eval()
    return base, peft


PROMPTS = [[5, 6, 7, 8, 9], [5, 6, 7, 8, 9], [10, 11], [5, 6, 7, 8, 9], [10, 11], [12, 13, 14]]


def _logprobs(tokens_BT, step_logits, temperature=0.0):
    """Logprobs `[B, T]` of `tokens_BT` under each step's raw logits `[B, V]` / temperature (0: 1), as the
    engine records them."""
    temp = temperature if temperature > 0 else 1.0
    return torch.stack(
        [
            torch.log_softmax(logits.float() / temp, -1).gather(1, tokens_BT[:, t : t + 1]).squeeze(1)
            for t, logits in enumerate(step_logits)
        ],
        dim=1,
    )


def _plain_generate(model, prompts, adapters, max_new_tokens=6, eos=EOS, processors=None):
    ids, mask = left_pad(prompts, PAD)
    kwargs = {"adapter_names": adapters} if adapters else {}
    config = GenerationConfig(
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=PAD,
        eos_token_id=[eos],
        bos_token_id=None,
        return_dict_in_generate=True,
        output_logits=True,
    )
    with torch.no_grad():
        out = model.generate(
            input_ids=ids, attention_mask=mask, generation_config=config, logits_processor=processors, **kwargs
        )
    return out.sequences[:, ids.shape[1] :], out.logits


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("with_adapters", [False, True])
def test_rows_that_end_leave_the_batch_and_nothing_else_changes(models, temperature, with_adapters) -> None:
    """Rows ending at different steps leave the decode batch (fewer rows computed), and every row's tokens and
    its logprobs up to its end equal HF `generate`'s, which computes every row to the end; sampled with a seed
    too (`generate` with the same inverse-CDF sampler: the same uniforms, one per row and step)."""
    base, peft = models
    model = peft if with_adapters else base
    adapters = ["a1", "a1", "__base__", "a1", "__base__", "a1"] if with_adapters else None
    params = SamplingParams(max_new_tokens=8, temperature=temperature, seed=11)

    def reference(eos: int) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        torch.manual_seed(11)
        processors = LogitsProcessorList([InverseCdfSampler(temperature)]) if temperature > 0 else None
        return _plain_generate(model, PROMPTS, adapters, 8, eos=eos, processors=processors)

    free, _ = reference(eos=-1)  # no row ends: the end token is one that row 0 writes at step 2
    end = int(free[0, 2])
    want, want_logits = reference(eos=end)
    lengths = [int((row == end).nonzero()[0]) + 1 if (row == end).any() else 8 for row in want]
    assert len(set(lengths)) > 1 and min(lengths) < max(lengths)  # rows end at different steps
    rows_computed: list[int] = []
    hook = (peft.get_base_model() if with_adapters else base).register_forward_pre_hook(
        lambda _m, _a, kwargs: rows_computed.append(kwargs["input_ids"].shape[0]), with_kwargs=True
    )
    try:
        tokens, logprobs = generate_batch(model, PROMPTS, adapters, params, pad_id=PAD, eos_ids=[end])
    finally:
        hook.remove()
    assert torch.equal(tokens, want)
    want_logprobs = _logprobs(want, want_logits, temperature)
    for i, n in enumerate(lengths):  # up to its end a row's logprobs are generate's; after it, 0
        torch.testing.assert_close(logprobs[i, :n], want_logprobs[i, :n], atol=1e-4, rtol=1e-4)
        assert not logprobs[i, n:].any()
    assert rows_computed[-1] == sum(1 for n in lengths if n == max(lengths))  # the last step: the longest rows


@pytest.mark.parametrize("with_adapters", [False, True])
def test_shared_prefill_equals_plain_generation(models, with_adapters: bool) -> None:
    base, peft = models
    model = peft if with_adapters else base
    # rows 0 and 1 share prompt and adapter; row 3 has the same prompt under another adapter
    adapters = ["a1", "a1", "a1", "__base__", "__base__", "a1"] if with_adapters else None
    greedy = SamplingParams(max_new_tokens=6, temperature=0.0)
    tokens, logprobs = generate_batch(model, PROMPTS, adapters, greedy, pad_id=PAD, eos_ids=[EOS])
    ref_tokens, ref_logits = _plain_generate(model, PROMPTS, adapters)
    assert torch.equal(tokens, ref_tokens)
    assert logprobs.shape == tokens.shape and bool((logprobs < 0).all())  # no row ends early here
    torch.testing.assert_close(logprobs, _logprobs(ref_tokens, ref_logits), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("adapter", ["a1", "__base__"])
def test_one_adapter_batch_equals_the_mixed_batch_path(models, adapter: str) -> None:
    """A batch naming one adapter runs PEFT's plain forward (active adapter, or adapters disabled for the
    base model); its tokens and logits equal PEFT's per-row routing of the same batch."""
    _, peft = models
    greedy = SamplingParams(max_new_tokens=6, temperature=0.0)
    tokens, logprobs = generate_batch(peft, PROMPTS, [adapter] * len(PROMPTS), greedy, pad_id=PAD, eos_ids=[EOS])
    ref_tokens, ref_logits = _plain_generate(peft, PROMPTS, [adapter] * len(PROMPTS))
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(logprobs, _logprobs(ref_tokens, ref_logits), atol=1e-4, rtol=1e-4)
    if adapter == "__base__":  # and the adapter really was off: the base model's own output
        base_tokens, _ = _plain_generate(models[0], PROMPTS, None)
        assert torch.equal(tokens, base_tokens)


def test_shared_prefill_runs_each_distinct_prompt_once(models) -> None:
    base, peft = models
    ids, mask = left_pad(PROMPTS, PAD)
    seen: list[int] = []
    handle = base.register_forward_pre_hook(
        lambda _m, args, kwargs: seen.append(kwargs["input_ids"].shape[0]), with_kwargs=True
    )
    try:
        cache = shared_prefill(base, ids, mask, None)
    finally:
        handle.remove()
    assert seen == [3]  # three distinct prompts
    assert cache is not None and cache.get_seq_length() == ids.shape[1] - 1
    assert cache.layers[0].keys.shape[0] == len(PROMPTS)
    # the same prompt under two adapters is two prefills; all-distinct rows need none
    assert shared_prefill(peft, ids, mask, ["a1", "__base__", "a1", "a1", "a1", "a1"]) is not None
    distinct, distinct_mask = left_pad([[5, 6], [7, 8]], PAD)
    assert shared_prefill(base, distinct, distinct_mask, None) is None


def test_sampled_generation_with_shared_prefill_follows_the_seed(models) -> None:
    base, _ = models
    params = SamplingParams(max_new_tokens=6, temperature=1.0, seed=3)
    a, _ = generate_batch(base, PROMPTS, None, params, pad_id=PAD, eos_ids=[EOS])
    b, _ = generate_batch(base, PROMPTS, None, params, pad_id=PAD, eos_ids=[EOS])
    assert torch.equal(a, b)
    assert not torch.equal(a[0], a[1]) or not torch.equal(a[1], a[3])  # samples of one prompt differ


@pytest.mark.parametrize("with_adapters", [False, True])
def test_generation_uses_the_current_cache_api(models, with_adapters: bool) -> None:
    """Shared prefill and `generate` pass the KV cache by the name this transformers takes (`cache` since
    5.24): no FutureWarning (`past_key_values` is deprecated) on every step of `make run`."""
    base, peft = models
    model = peft if with_adapters else base
    adapters = ["a1", "a1", "__base__", "__base__", "a1", "a1"] if with_adapters else None
    params = SamplingParams(max_new_tokens=4, temperature=1.0, seed=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # the fixture's PEFT set-up warns on its own: not here
        tokens, _ = generate_batch(model, PROMPTS, adapters, params, pad_id=PAD, eos_ids=[EOS])
    assert tokens.shape[0] == len(PROMPTS)


def test_cache_kwarg_is_what_the_model_forward_takes(models, monkeypatch) -> None:
    class Older(torch.nn.Module):  # transformers < 5.24: the cache is `past_key_values`
        def forward(self, input_ids, past_key_values=None):
            return input_ids

    base, peft = models
    assert cache_kwarg(Older()) == "past_key_values"
    assert cache_kwarg(peft) == cache_kwarg(base)  # a PeftModel: its base model's name
    monkeypatch.setitem(_CACHE_KWARGS, Older, "cache")  # decided once per class: the next call reads the table
    assert cache_kwarg(Older()) == "cache"
