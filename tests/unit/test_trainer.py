"""PolicyTrainer on the tiny Llama with a LoRA adapter: packing, micro-batching, update direction, metrics."""

from __future__ import annotations

import json
import math
from typing import Literal

import pytest
import torch
from peft.tuners.lora import LoraLayer
from transformers import AutoModelForCausalLM, AutoTokenizer

from lora_rl_core.algorithm import token_logprobs
from lora_rl_core.config import AlgorithmConfig, LoRAConfig, ModelConfig, TrainerConfig
from lora_rl_core.errors import ConfigError
from lora_rl_core.lora import adapter_state, apply_lora
from lora_rl_core.records import TrainBatch
from lora_rl_core.trainer import PolicyTrainer, pack
from lora_rl_core.trainer.reduce import m2po_batch_keep
from lora_rl_testing.plans import trainer_plan

VOCAB = 64  # random token ids stay below this; the tiny tokenizer has 78 tokens


@pytest.fixture(scope="module")
def pad_id(tiny_model_dir) -> int:
    return AutoTokenizer.from_pretrained(tiny_model_dir).pad_token_id


@pytest.fixture
def make_trainer(tiny_model_dir, pad_id):
    """Build a trainer on a fresh tiny model; the same arguments give the same initial LoRA weights."""

    def make(
        *, lr: float = 1e-3, micro_batch_size: int = 16, max_grad_norm: float = 1.0, nonzero_b: bool = False, **algo
    ) -> PolicyTrainer:
        torch.manual_seed(0)
        base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
        model = apply_lora(base, LoRAConfig(rank=4))
        if nonzero_b:  # default init has B = 0, so A gets no gradient in the first step
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    torch.nn.init.normal_(p, std=0.05)
        trainer = TrainerConfig(lr=lr, micro_batch_size=micro_batch_size, max_grad_norm=max_grad_norm)
        return PolicyTrainer(model, trainer_plan(algorithm=AlgorithmConfig(**algo), trainer=trainer), pad_id=pad_id)

    return make


def lora_weights(trainer: PolicyTrainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_" in n}


def random_batch(advantages: list[float], seed: int = 0) -> TrainBatch:
    """One row per advantage: random prompt (2-6) and completion (1-5) token ids, zero inference logprobs."""
    g = torch.Generator().manual_seed(seed)
    lengths = [
        (int(torch.randint(2, 7, (1,), generator=g)), int(torch.randint(1, 6, (1,), generator=g))) for _ in advantages
    ]
    prompts = [torch.randint(1, VOCAB, (p,), generator=g).tolist() for p, _ in lengths]
    completions = [torch.randint(1, VOCAB, (c,), generator=g).tolist() for _, c in lengths]
    return TrainBatch(prompts, completions, list(advantages), [[0.0] * len(c) for c in completions])


def completion_logprob(trainer: PolicyTrainer, batch: TrainBatch) -> float:
    packed = pack(batch, trainer.pad_id, trainer.device)
    with torch.no_grad():
        logprobs = trainer._logprobs(packed)
    return float((logprobs * packed.mask_BT).sum())


def test_pack_places_completion_in_shifted_frame():
    prompts, completions = [[11, 12, 13], [21, 22, 23, 24, 25]], [[31, 32, 33, 34], [41, 42]]
    inference = [[-0.1, -0.2, -0.3, -0.4], [-0.5, -0.6]]
    packed = pack(TrainBatch(prompts, completions, [1.0, -1.0], inference), pad_id=0, device=torch.device("cpu"))
    assert packed.mask_BT.sum(dim=1).tolist() == [4.0, 2.0]
    assert packed.frame_start == 2  # the shortest prompt's last token: no logits before it
    for i, (p, c) in enumerate(zip(prompts, completions, strict=True)):
        positions = list(range(len(p) - 1 - packed.frame_start, len(p) - 1 - packed.frame_start + len(c)))
        assert packed.mask_BT[i].nonzero().flatten().tolist() == positions
        assert packed.targets_BT[i, positions].tolist() == c
        torch.testing.assert_close(packed.inference_logprobs_BT[i, positions], torch.tensor(inference[i]))
    assert (packed.inference_logprobs_BT[packed.mask_BT == 0] == 0).all()
    assert packed.advantages_B.tolist() == [1.0, -1.0]


def test_pack_right_pads():
    packed = pack(
        TrainBatch([[5, 6], [5, 6, 7, 8]], [[9], [9, 9]], [0.0, 0.0], [[0.0], [0.0, 0.0]]),
        pad_id=0,
        device=torch.device("cpu"),
    )
    assert packed.input_ids.tolist() == [[5, 6, 9, 0, 0, 0], [5, 6, 7, 8, 9, 9]]
    assert packed.attention_mask.tolist() == [[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1]]
    assert packed.frame_start == 1  # the frame drops input position 0, which predicts no completion token
    assert packed.targets_BT.tolist() == [[9, 0, 0, 0], [7, 8, 9, 9]]
    assert packed.mask_BT.tolist() == [[1, 0, 0, 0], [0, 0, 1, 1]]


def test_frame_logprobs_equal_each_row_alone(make_trainer):
    """The trainer's completion logprobs of a right-padded batch, with logits only from the frame start on
    (`logits_to_keep`), equal those of each row's own full forward without padding."""
    trainer = make_trainer(nonzero_b=True)
    batch = random_batch([1.0, -1.0, 0.5, 2.0, 1.5, -0.5], seed=3)
    packed = pack(batch, trainer.pad_id, trainer.device)
    assert packed.frame_start > 0 and (packed.input_ids == trainer.pad_id).any()
    with torch.no_grad():
        cut = trainer._logprobs(packed)
        for i, (p, c) in enumerate(zip(batch.prompt_ids, batch.completion_ids, strict=True)):
            ids = torch.tensor([p + c])
            alone = token_logprobs(trainer.model(input_ids=ids).logits[:, :-1].float(), ids[:, 1:])[0]
            want = alone[len(p) - 1 :]
            torch.testing.assert_close(cut[i][packed.mask_BT[i].bool()], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-sum"])
def test_micro_batches_match_full_batch(make_trainer, aggregation):
    # no clipping, so a wrongly scaled accumulated gradient shows in the grads (Adam would hide it in the weights)
    small = make_trainer(micro_batch_size=1, max_grad_norm=1e6, nonzero_b=True, loss_aggregation=aggregation)
    full = make_trainer(micro_batch_size=6, max_grad_norm=1e6, nonzero_b=True, loss_aggregation=aggregation)
    before = lora_weights(full)
    for name, w in lora_weights(small).items():
        torch.testing.assert_close(w, before[name], rtol=0, atol=0)
    batch = random_batch([1, -1, 0.5, -0.5, 2, -2])
    grad_norm_small = small.train_step(batch)["grad_norm"]
    grad_norm_full = full.train_step(batch)["grad_norm"]
    assert grad_norm_small == pytest.approx(grad_norm_full, rel=1e-4)
    for (name, p_small), p_full in zip(small.model.named_parameters(), full.model.parameters(), strict=True):
        if p_small.requires_grad:
            torch.testing.assert_close(p_small.grad, p_full.grad, rtol=1e-4, atol=1e-6, msg=name)
    after_small, after_full = lora_weights(small), lora_weights(full)
    for name, w in after_full.items():
        assert torch.allclose(after_small[name], w, atol=1e-5), name
        assert not torch.equal(w, before[name]), f"{name} did not move"


def test_train_step_updates_lora_and_reports_metrics(make_trainer):
    trainer = make_trainer()
    batch = random_batch([1.0, -1.0, 0.5])
    before = lora_weights(trainer)
    metrics = trainer.train_step(batch)
    after = lora_weights(trainer)
    assert any(not torch.equal(after[n], before[n]) for n in before)
    for key in ("loss", "grad_norm", "entropy", "clip_fraction"):
        assert math.isfinite(metrics[key]), key
    assert metrics["grad_norm"] > 0
    assert metrics["entropy"] > 0
    assert metrics["clip_fraction"] == 0.0  # one minibatch: ratio is exactly 1
    assert metrics["ratio_mean"] == pytest.approx(1.0)
    assert metrics["train_sequences"] == 3.0
    lengths = batch.row_lengths()  # one micro-batch of 3 rows, right-padded to the longest
    assert metrics["padding_fraction"] == pytest.approx(1 - sum(lengths) / (3 * max(lengths)))
    assert metrics["train_tokens"] == float(sum(len(c) for c in batch.completion_ids))


def test_positive_advantage_raises_completion_logprob(make_trainer):
    trainer = make_trainer(lr=1e-2)
    batch = random_batch([1.0])
    start = completion_logprob(trainer, batch)
    for _ in range(3):
        trainer.train_step(batch)
    assert completion_logprob(trainer, batch) > start + 0.1


def test_negative_advantage_lowers_completion_logprob(make_trainer):
    trainer = make_trainer(lr=1e-2)
    batch = random_batch([-1.0])
    start = completion_logprob(trainer, batch)
    for _ in range(3):
        trainer.train_step(batch)
    assert completion_logprob(trainer, batch) < start - 0.1


def test_kl_is_zero_at_start_then_positive(make_trainer):
    trainer = make_trainer(lr=1e-2, kl_coef=0.1)
    batch = random_batch([1.0, -1.0])
    assert trainer.train_step(batch)["kl"] == 0.0  # default init: the adapter is a no-op, policy == reference
    for _ in range(2):
        kl = trainer.train_step(batch)["kl"]
    assert kl > 0


def test_two_minibatches(make_trainer):
    trainer = make_trainer(lr=1e-2, num_minibatches=2)
    batch = random_batch([1.0, -1.0, 2.0, -2.0])
    before = lora_weights(trainer)
    metrics = trainer.train_step(batch)
    assert isinstance(metrics["clip_fraction"], float)
    assert 0.0 <= metrics["clip_fraction"] <= 1.0
    assert metrics["ratio_mean"] != pytest.approx(1.0, abs=1e-6)  # 2nd minibatch is off-policy after the 1st update
    assert metrics["train_tokens"] == float(sum(len(c) for c in batch.completion_ids))
    assert any(not torch.equal(w, before[n]) for n, w in lora_weights(trainer).items())


def test_empty_batch_skips_update(make_trainer):
    trainer = make_trainer()
    before = lora_weights(trainer)
    metrics = trainer.train_step(TrainBatch([], [], [], []))
    assert metrics["train_sequences"] == 0
    assert metrics["train_tokens"] == 0
    assert not trainer.optimizer.state  # the optimizer never stepped
    for name, w in lora_weights(trainer).items():
        assert torch.equal(w, before[name]), name


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_reported_loss_does_not_depend_on_micro_batch_size(make_trainer, aggregation):
    batch = random_batch([1, -1, 0.5, -0.5, 2, -2])
    small, full = (make_trainer(micro_batch_size=m, loss_aggregation=aggregation).train_step(batch) for m in (1, 6))
    assert small["loss"] == pytest.approx(full["loss"], abs=1e-5)


def test_more_minibatches_than_rows_keeps_metric_scale(make_trainer):
    batch = random_batch([1.0])
    one, two = (make_trainer(num_minibatches=n).train_step(batch) for n in (1, 2))
    assert two["ratio_mean"] == pytest.approx(1.0)
    assert two["entropy"] == pytest.approx(one["entropy"], rel=1e-4)


def test_state_dict_resumes_exactly_in_a_fresh_trainer(make_trainer):
    first = make_trainer(lr=1e-2, nonzero_b=True)
    for seed in (1, 2):
        first.train_step(random_batch([1, -1, 0.5], seed=seed))
    saved = first.state_dict()
    json.dumps(saved["meta"])  # metadata is plain JSON; tensors go to safetensors
    keys = saved["tensors"].keys()
    assert "rng/rank0/cpu" in keys and {k.split("/")[0] for k in keys} == {"params", "optimizer", "rng"}
    last = random_batch([2, -2, 1], seed=3)
    want = first.train_step(last)
    second = make_trainer(lr=1e-2)  # other initial weights, no optimizer state
    second.load_state_dict(saved)
    got = second.train_step(last)
    assert got["loss"] == want["loss"] and got["lr"] == want["lr"]
    for name, w in lora_weights(first).items():
        torch.testing.assert_close(lora_weights(second)[name], w, rtol=0, atol=0, msg=name)


def test_load_state_dict_rejects_another_adapter_shape(make_trainer, tiny_model_dir, pad_id):
    saved = make_trainer().state_dict()
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    other = PolicyTrainer(
        apply_lora(base, LoRAConfig(rank=4, target_modules=["q_proj"])), trainer_plan(), pad_id=pad_id
    )
    with pytest.raises(ValueError, match="does not fit this model"):
        other.load_state_dict(saved)


def test_load_state_dict_rejects_another_lora_rank_naming_the_parameter(make_trainer, tiny_model_dir, pad_id):
    """The same parameter names with another `lora.rank`: one line naming the parameter, both shapes and the fix,
    and the trainer's own weights untouched."""
    saved = make_trainer().state_dict()
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    other = PolicyTrainer(apply_lora(base, LoRAConfig(rank=8)), trainer_plan(), pad_id=pad_id)
    _refused_leaving_weights(other, saved, r"params/\S+lora_A\S* is \[4, \d+\], this model's \[8, \d+\]: .*lora.rank")


def test_load_state_dict_rejects_a_state_missing_a_parameter_its_meta_lists(make_trainer):
    """A checkpoint in which no rank's file held one parameter: one line naming it, the weights untouched (not a
    bare KeyError from the copy)."""
    trainer = make_trainer()
    saved = trainer.state_dict()
    missing = next(k for k in saved["tensors"] if k.startswith("params/"))
    del saved["tensors"][missing]
    _refused_leaving_weights(trainer, saved, rf"^trainer state has no {missing}, which its meta lists: .*incomplete")


def _refused_leaving_weights(trainer: PolicyTrainer, state: dict, match: str) -> None:
    """`trainer.load_state_dict(state)` raises a ValueError matching `match` and leaves every LoRA weight as it was."""
    before = {k: v.clone() for k, v in lora_weights(trainer).items()}
    with pytest.raises(ValueError, match=match):
        trainer.load_state_dict(state)
    for name, w in lora_weights(trainer).items():
        assert torch.equal(w, before[name]), name


def test_adapter_state_method_matches_lora_adapter_state(make_trainer):
    trainer = make_trainer()
    trainer.train_step(random_batch([1.0, -1.0]))
    tensors, config = trainer.adapter_state()
    want_tensors, want_config = adapter_state(trainer.model)
    assert config == want_config
    assert tensors.keys() == want_tensors.keys()
    for key, value in want_tensors.items():
        assert torch.equal(tensors[key], value), key


# ----------------------------------------------------------------------------- LoRA compute dtype
def bf16_base_trainer(tiny_model_dir, pad_id, compute: Literal["auto", "float32", "bfloat16"]) -> PolicyTrainer:
    """A trainer over the tiny model loaded in bfloat16 (on this CPU: CPU autocast), B nonzero so both LoRA
    factors get gradients, a KL term so the reference forward runs too."""
    torch.manual_seed(0)
    model = apply_lora(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16), LoRAConfig(rank=4))
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.05)
    trainer = TrainerConfig(lora_compute_dtype=compute)
    model_cfg = ModelConfig(device="cpu", dtype="bfloat16")
    plan = trainer_plan(algorithm=AlgorithmConfig(kl_coef=0.1), trainer=trainer, model=model_cfg)
    return PolicyTrainer(model, plan, pad_id=pad_id)


def lora_input_dtypes(trainer: PolicyTrainer) -> set[torch.dtype]:
    """Records the dtype of every input that reaches a `lora_A` (after PEFT's cast, if any)."""
    seen: set[torch.dtype] = set()
    for module in trainer.model.modules():
        if isinstance(module, LoraLayer):
            module.lora_A["default"].register_forward_pre_hook(lambda _m, args: seen.add(args[0].dtype))
    return seen


def test_bf16_lora_compute_keeps_float32_master_weights_and_matches_float32(tiny_model_dir, pad_id):
    """bfloat16 LoRA compute (CPU autocast here): LoRA inputs stay bfloat16 (PEFT's cast off), the LoRA weights,
    their gradients and AdamW's moments stay float32, logprobs are float32. Against float32 LoRA compute over
    the same bfloat16 base: per-token logprobs within 0.02 nats (bf16 keeps 8 mantissa bits: ~0.4 % of a logit;
    measured ~1e-3), the loss within 1e-3 and the gradient norm within 2 %."""
    batch = random_batch([1.0, -1.0, 0.5, -0.5])
    results = {}
    for compute in ("float32", "bfloat16"):
        trainer = bf16_base_trainer(tiny_model_dir, pad_id, compute)
        seen = lora_input_dtypes(trainer)
        packed = pack(batch, trainer.pad_id, trainer.device)
        with torch.no_grad():
            logprobs = trainer._logprobs(packed)
        metrics = trainer.train_step(batch)
        lora = [m for m in trainer.model.modules() if isinstance(m, LoraLayer)]
        assert lora and all(m.cast_input_dtype_enabled == (compute == "float32") for m in lora)
        assert seen == {getattr(torch, compute)}
        assert logprobs.dtype == torch.float32
        assert {p.dtype for p in trainer.params} == {torch.float32}
        assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in trainer.params)
        moments = [v for s in trainer.optimizer.state.values() for k, v in s.items() if k != "step"]
        assert moments and {v.dtype for v in moments} == {torch.float32}
        results[compute] = (logprobs * packed.mask_BT, metrics)
    (lp32, m32), (lp16, m16) = results["float32"], results["bfloat16"]
    torch.testing.assert_close(lp16, lp32, atol=0.02, rtol=0)
    assert m16["loss"] == pytest.approx(m32["loss"], abs=1e-3)
    assert m16["kl"] == pytest.approx(m32["kl"], abs=1e-3)
    assert m16["grad_norm"] == pytest.approx(m32["grad_norm"], rel=0.02)


def test_auto_lora_compute_is_float32_on_a_cpu(tiny_model_dir, pad_id, make_trainer):
    assert TrainerConfig().lora_compute_dtype == "auto"
    for trainer in (make_trainer(), bf16_base_trainer(tiny_model_dir, pad_id, "auto")):  # float32, bfloat16 base
        assert trainer.compute_dtype == torch.float32
        assert all(m.cast_input_dtype_enabled for m in trainer.model.modules() if isinstance(m, LoraLayer))


def test_bf16_lora_compute_over_a_float32_base_is_a_config_error():
    """Refused when the run is planned, before any model is loaded."""
    with pytest.raises(ConfigError, match=r"trainer\.lora_compute_dtype=bfloat16 needs bfloat16 base weights"):
        trainer_plan(
            trainer=TrainerConfig(lora_compute_dtype="bfloat16"), model=ModelConfig(device="cpu", dtype="float32")
        )


def test_an_update_out_of_memory_says_what_to_lower_and_drops_its_gradients(make_trainer, monkeypatch):
    """A CUDA out-of-memory error in the update comes out as one error naming the batch's longest row, the
    micro-batch and the settings that lower the need; with one minibatch (the default) the trainer is left as
    before the step (no half-summed gradients, the scheduler not stepped, eval mode), so a retry starts clean."""
    from lora_rl_core.errors import TrainerOutOfMemoryError

    trainer = make_trainer(micro_batch_size=2)
    batch = random_batch([1.0, -1.0, 0.5, -0.5])
    before = lora_weights(trainer)
    original = PolicyTrainer._micro_backward
    calls = []

    def fails_on_the_second(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore detail")
        return original(self, *args, **kwargs)

    monkeypatch.setattr(PolicyTrainer, "_micro_backward", fails_on_the_second)
    lr = trainer.scheduler.get_last_lr()
    longest = max(len(p) + len(c) for p, c in zip(batch.prompt_ids, batch.completion_ids, strict=True))
    with pytest.raises(TrainerOutOfMemoryError) as err:
        trainer.train_step(batch)
    message = str(err.value)
    assert f"the longest {longest} tokens" in message and "micro-batch 2" in message
    assert "Tried to allocate 2.00 GiB" in message and "more detail" not in message
    assert "rollout.max_new_tokens" in message and "trainer.gradient_checkpointing=true" in message
    assert trainer.scheduler.get_last_lr() == lr
    for name, w in lora_weights(trainer).items():
        assert torch.equal(w, before[name]), name
    assert all(p.grad is None for p in trainer.params) and not trainer.model.training
    monkeypatch.setattr(PolicyTrainer, "_micro_backward", original)
    assert math.isfinite(trainer.train_step(batch)["loss"])  # the next attempt trains


def test_m2po_masks_over_the_whole_batch_across_micro_batches(make_trainer):
    """Issue 45, item 5: M2 is a statistic of the step's whole batch. Two rows trained as two micro-batches:
    row 0's log ratios (trainer over engine) are [0.3, 0], row 1's six zeros. Over the batch M2 = 0.09 / 8 =
    0.011 < 0.04: nothing is masked, where row 0 alone (0.045) would have lost its 0.3 token. With the second
    row's tokens at 0.2, M2 = (0.09 + 6 * 0.04) / 8 = 0.041: the largest, 0.3, is masked, leaving 0.034."""
    trainer = make_trainer(micro_batch_size=1, off_policy_correction={"type": "m2po", "m2_threshold": 0.04})
    assert trainer.loss.clip_eps_low is None and trainer.loss.clip_eps_high is None  # no PPO clip under M2PO
    batch = TrainBatch([[5, 6, 7], [8, 9]], [[11, 12], [13, 14, 15, 16, 17, 18]], [1.0, -1.0], [[0.0] * 2, [0.0] * 6])
    schedules = [trainer._micro_batches(batch.row_lengths(), [0, 1])]
    assert len(schedules[0]) == 2  # one row per micro-batch
    old = trainer._old_logprobs(batch, schedules)

    def with_log_ratios(r0: list[float], r1: list[float]) -> TrainBatch:
        inference = [(old[0] - torch.tensor(r0)).tolist(), (old[1] - torch.tensor(r1)).tolist()]
        return TrainBatch(batch.prompt_ids, batch.completion_ids, batch.advantages, inference)

    keep, stats = m2po_batch_keep(with_log_ratios([0.3, 0.0], [0.0] * 6), old, 0.04)
    assert [k.tolist() for k in (keep[0], keep[1])] == [[True, True], [True] * 6]
    assert stats["m2"] == pytest.approx(0.09 / 8, rel=1e-5) and stats["m2_masked_fraction"] == 0.0
    keep, stats = m2po_batch_keep(with_log_ratios([0.3, 0.0], [0.2] * 6), old, 0.04)
    assert [k.tolist() for k in (keep[0], keep[1])] == [[False, True], [True] * 6]
    assert stats["m2"] == pytest.approx((0.09 + 6 * 0.04) / 8, rel=1e-5)
    assert stats["m2_masked_fraction"] == pytest.approx(1 / 8)
    metrics = trainer.train_step(with_log_ratios([0.3, 0.0], [0.2] * 6))
    assert metrics["m2_masked_fraction"] == pytest.approx(1 / 8) and metrics["clip_fraction"] == 0.0
    assert metrics["is_masked_fraction"] == pytest.approx(1 / 8) and math.isfinite(metrics["loss"])
    # row 1 the critic's alone (`value_only`, PPO's cut row): M2 over row 0's tokens, 0.09 / 2 = 0.045 > 0.04
    value_only = TrainBatch(**{**vars(with_log_ratios([0.3, 0.0], [0.0] * 6)), "value_only": [False, True]})
    keep, stats = m2po_batch_keep(value_only, old, 0.04)
    assert [k.tolist() for k in (keep[0], keep[1])] == [[False, True], [False] * 6]
    assert stats["m2"] == pytest.approx(0.09 / 2, rel=1e-5) and stats["m2_masked_fraction"] == pytest.approx(1 / 2)
