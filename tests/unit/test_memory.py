"""The GPU memory plan (`lora_rl_core.memory`): what fits beside a colocated SGLang, decided before step 1."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from lora_rl_core.config import LoRAConfig, ModelConfig
from lora_rl_core.config.load import config_from_dict
from lora_rl_core.errors import ConfigError
from lora_rl_core.memory import GIB, SAFETY_BYTES, ModelShape, plan_memory
from lora_rl_core.plan.gpus import sglang_shares_trainer_gpu

CONFIGS = Path(__file__).resolve().parents[2] / "benchmarks" / "model_configs"


@pytest.fixture(scope="module")
def shapes(tmp_path_factory) -> dict[str, ModelShape]:
    out = {}
    for name in ("1.5b", "7b"):
        folder = tmp_path_factory.mktemp(name)
        shutil.copy(CONFIGS / f"qwen2.5-{name}.json", folder / "config.json")
        out[name] = ModelShape.of(ModelConfig(name_or_path=str(folder)), LoRAConfig())
    return out


def _cfg(mode: str = "sync", tokens: int = 256, launch: dict | None = None, **trainer) -> object:
    return config_from_dict(
        {
            "rollout": {"prompts_per_step": 16, "group_size": 8, "max_new_tokens": tokens, "mode": mode},
            "engine": {"type": "sglang", "launch": {"enabled": True, **(launch or {})}},
            "trainer": trainer,
        }
    )


def _plan(cfg, shape, gib: float = 79.1, saver: bool = True, prompt_tokens: int = 150):
    total = int(gib * GIB)
    return plan_memory(
        cfg,
        shape,
        prompt_tokens=prompt_tokens,
        gpu_free=total,
        gpu_total=total,
        colocated=True,
        saver_available=saver,
        mode=cfg.rollout.mode,
    )


def test_shapes_are_counted_from_the_config(shapes):
    assert 7.5e9 < shapes["7b"].params < 7.7e9 and 1.5e9 < shapes["1.5b"].params < 1.6e9
    # rank 16 on the 7 linear modules of 28 layers: 16 x (in + out) each
    assert shapes["7b"].lora_params == 16 * 28 * (3584 * 4 + 512 * 2 + 3584 + 3584 + (3584 + 18944) * 3)
    assert shapes["7b"].kv_bytes_per_token() == 2 * 28 * 512 * 2


def test_a_7b_model_with_the_default_config_fits_one_80gb_gpu(shapes):
    plan = _plan(_cfg(), shapes["7b"])
    assert plan.colocated
    # micro-batch 16 would need ~57 GiB of activations: halved to 8 instead of recomputing every layer
    assert plan.micro_batch_size == 8 and not plan.gradient_checkpointing
    # KV cache and activations fit side by side: no release and re-allocation every step
    assert not plan.memory_saver and plan.kv_cache >= plan.kv_needed
    assert 0.25 < plan.mem_fraction_static < 0.95
    budget = int(79.1 * GIB)
    assert plan.engine_fixed + plan.kv_cache + plan.trainer_resident + plan.activations < budget


def test_ppo_at_7b_counts_its_critic_and_still_fits_one_80gb_gpu(tmp_path, shapes):
    """PPO's critic (`algorithm.advantage: gae`): its adapter and value head, with gradients and AdamW state, are
    resident beside the policy's; the default PPO config at 7B (16 x 8 x 256) fits one 80 GB GPU."""
    shutil.copy(CONFIGS / "qwen2.5-7b.json", tmp_path / "config.json")
    ppo = ModelShape.of(ModelConfig(name_or_path=str(tmp_path)), LoRAConfig(), LoRAConfig())
    assert ppo.critic_params == shapes["7b"].lora_params + 3584 + 1  # the same adapter shape, and the head
    cfg = config_from_dict(
        {
            "rollout": {"prompts_per_step": 16, "group_size": 8, "max_new_tokens": 256, "mode": "sync"},
            "engine": {"type": "sglang", "launch": {"enabled": True}},
            "algorithm": {"advantage": "gae"},
        }
    )
    grpo_plan, ppo_plan = _plan(_cfg(), shapes["7b"]), _plan(cfg, ppo)
    assert ppo_plan.trainer_resident - grpo_plan.trainer_resident == ppo.critic_params * 16  # float32 x4
    assert ppo_plan.micro_batch_size >= 4 and ppo_plan.kv_cache >= ppo_plan.kv_needed
    assert ppo_plan.engine_fixed + ppo_plan.kv_cache + ppo_plan.trainer_resident + ppo_plan.activations < int(
        79.1 * GIB
    )


def test_the_memory_saver_is_used_where_it_buys_a_larger_micro_batch(shapes):
    plan = _plan(_cfg(), shapes["7b"], gib=70.0)
    budget = int(70.0 * GIB)
    assert plan.memory_saver and plan.micro_batch_size == 8 and not plan.gradient_checkpointing
    # each phase fits on its own, not both together: the KV cache is released while training
    assert plan.engine_fixed + plan.kv_cache + plan.trainer_resident < budget
    assert plan.engine_fixed + plan.trainer_resident + plan.activations < budget
    assert plan.engine_fixed + plan.kv_cache + plan.trainer_resident + plan.activations > budget
    without = _plan(_cfg(), shapes["7b"], gib=70.0, saver=False)
    assert not without.memory_saver and without.micro_batch_size == 4
    async_plan = _plan(_cfg("async"), shapes["7b"], gib=70.0)  # SGLang is busy while training: never released
    assert not async_plan.memory_saver and async_plan.rollout_batch == 256


def test_checkpointing_turns_on_where_a_small_micro_batch_does_not_fit(shapes):
    halved = _plan(_cfg(micro_batch_size=16), shapes["7b"], gib=60.0)
    assert halved.micro_batch_size == 4 and not halved.gradient_checkpointing
    plan = _plan(_cfg(micro_batch_size=16), shapes["7b"], gib=50.0)  # not even 4 sequences: recompute instead
    assert plan.gradient_checkpointing and 1 <= plan.micro_batch_size <= 16
    explicit = _plan(_cfg(micro_batch_size=16, gradient_checkpointing=False), shapes["1.5b"])
    assert explicit.micro_batch_size == 16 and not explicit.gradient_checkpointing


def test_a_run_that_cannot_fit_says_so_naming_the_settings(shapes):
    with pytest.raises(ConfigError) as err:
        _plan(_cfg(), shapes["7b"], gib=24.0)
    message = str(err.value)
    assert "does not fit the GPU" in message and "7.6B" in message
    # only the settings that would change it: the micro-batch is 1 already, the fraction is the plan's own
    assert "rollout.max_new_tokens" in message and "placement: split" in message
    assert "trainer.micro_batch_size" not in message and "mem_fraction_static" not in message
    with pytest.raises(ConfigError, match="activations") as err:
        _plan(_cfg(micro_batch_size=128, gradient_checkpointing=False), shapes["7b"])
    assert "trainer.micro_batch_size" in str(err.value) and "trainer.gradient_checkpointing: auto" in str(err.value)
    hand_set = _cfg("async", launch={"mem_fraction_static": 0.9})
    with pytest.raises(ConfigError) as err:
        _plan(hand_set, shapes["7b"])
    assert "engine.launch.mem_fraction_static" in str(err.value) and "rollout.mode: sync" in str(err.value)


def test_on_a_cpu_auto_checkpointing_is_off():
    plan = plan_memory(
        _cfg(), None, prompt_tokens=0, gpu_free=0, gpu_total=0, colocated=False, saver_available=False, mode="sync"
    )
    assert plan.gradient_checkpointing is False and plan.micro_batch_size == 16 and plan.mem_fraction_static is None


def test_sglang_on_another_gpu_is_not_colocated(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    cfg = _cfg()
    assert sglang_shares_trainer_gpu(cfg, torch.device("cuda", 0))
    assert not sglang_shares_trainer_gpu(cfg, torch.device("cuda", 1))
    split = config_from_dict(
        {"engine": {"type": "sglang", "launch": {"enabled": True, "env": {"CUDA_VISIBLE_DEVICES": "1"}}}}
    )
    assert sglang_shares_trainer_gpu(split, torch.device("cuda", 1))
    assert not sglang_shares_trainer_gpu(split, torch.device("cuda", 0))
    assert not sglang_shares_trainer_gpu(cfg, torch.device("cpu"))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert sglang_shares_trainer_gpu(
        config_from_dict(
            {"engine": {"type": "sglang", "launch": {"enabled": True, "env": {"CUDA_VISIBLE_DEVICES": "3"}}}}
        ),
        torch.device("cuda", 1),
    )


@pytest.mark.parametrize("saver", [True, False], ids=["memory-saver", "no-memory-saver"])
@pytest.mark.parametrize("shape_name", ["1.5b", "7b"])
def test_longer_completions_are_refused_before_step_1_never_planned_past_the_gpu(shapes, shape_name, saver):
    """Raising `rollout.max_new_tokens` on one 80 GB GPU (the default batch, 16 x 8, trainer and SGLang side by
    side): every accepted length is planned within the GPU (the trainer's resident weights and activations, the
    KV cache, SGLang's copy and overhead, less the safety margin), and past the largest one the plan refuses
    with one message naming the settings to change, instead of a run that fails at step N (issue 34, item 5;
    the largest accepted length is the one to run for 3 steps on a GPU)."""
    total = int(79.18 * GIB)
    accepted, refused = [], None
    for tokens in range(256, 32768 + 1, 128):
        cfg = _cfg(mode="sync", tokens=tokens)
        try:
            plan = _plan(cfg, shapes[shape_name], gib=79.18, saver=saver)
        except ConfigError as exc:
            refused = (tokens, str(exc))
            break
        # with the memory saver the KV cache is freed while the trainer's activations live, else both stay
        phases = max(plan.activations, plan.kv_cache) if plan.memory_saver else plan.activations + plan.kv_cache
        used = plan.trainer_resident + plan.engine_fixed + phases
        assert used <= total - SAFETY_BYTES, (tokens, used / GIB)
        # the KV cache comes back after every train phase, beside the trainer's weights
        assert plan.trainer_resident + plan.engine_fixed + plan.kv_cache <= total - SAFETY_BYTES, tokens
        # SGLang's static share (its weights and the KV cache) is what the fraction gives it
        assert plan.mem_fraction_static * total + 2**20 >= plan.kv_cache + shapes[shape_name].weight_bytes()
        assert plan.kv_cache >= plan.kv_needed  # the whole rollout batch fits SGLang's KV cache
        accepted.append(tokens)
    assert accepted[:3] == [256, 384, 512] and refused is not None
    assert "does not fit the GPU" in refused[1] and "rollout.max_new_tokens" in refused[1]
    assert "the trainer's and SGLang's weights leave" in refused[1] or "of activations" in refused[1]
    # without the saver SGLang keeps only the batch's own cache where half again would leave no micro-batch
    # room: a 7B still takes 3072 new tokens (it was refused while the cache was always 1.5 x the batch's)
    assert (
        accepted[-1]
        >= {(True, "1.5b"): 6144, (True, "7b"): 6144, (False, "1.5b"): 6144, (False, "7b"): 3072}[saver, shape_name]
    )


def test_a_fraction_that_leaves_the_trainer_no_room_is_refused(shapes):
    """`engine.launch.mem_fraction_static` set by hand, beside a trainer: a fraction whose KV cache does not fit
    beside both models' weights is refused naming it; null (SGLang's own, ~0.84) is refused on a shared GPU."""
    cfg = _cfg(launch={"mem_fraction_static": 0.9})
    with pytest.raises(ConfigError, match="SGLang's KV cache takes .* and the trainer's and SGLang's weights leave"):
        _plan(cfg, shapes["7b"], gib=79.18)
    cfg = _cfg(launch={"mem_fraction_static": 0.5})
    assert _plan(cfg, shapes["7b"], gib=79.18).mem_fraction_static == pytest.approx(0.5, abs=0.01)
    cfg = _cfg(launch={"mem_fraction_static": None})
    with pytest.raises(ConfigError, match="engine.launch.mem_fraction_static: null"):
        _plan(cfg, shapes["7b"], gib=79.18)


def test_the_plan_says_why_the_kv_cache_is_or_is_not_released(shapes):
    """The run log and run.json name the reason, in the plan's own terms (not a generic one)."""
    one_gpu = _plan(_cfg(), shapes["7b"])  # 80 GB: micro-batch 16 does not fit even with the cache released
    assert one_gpu.memory_saver_reason == "releasing the KV cache would buy nothing: micro-batch 8 either way"
    smaller = _plan(_cfg(), shapes["7b"], gib=70.0)
    assert (
        smaller.memory_saver_reason == "releasing the KV cache while training buys micro-batch 8 (else micro-batch 4)"
    )
    assert _plan(_cfg("async"), shapes["7b"], gib=70.0).memory_saver_reason.startswith("rollout.mode async")
    long = _cfg(tokens=6144)  # the KV cache alone leaves no room for any micro-batch beside it
    assert _plan(long, shapes["7b"], gib=79.18).memory_saver_reason == (
        "releasing the KV cache while training is needed: no micro-batch fits beside the KV cache; released, "
        "micro-batch 1 with recomputation"
    )
    assert _plan(_cfg(), shapes["7b"], saver=False).memory_saver_reason == (
        "torch_memory_saver is not installed beside SGLang"
    )


@pytest.mark.parametrize(("shape_name", "want"), [("1.5b", 32), ("7b", 8)])
def test_auto_micro_batch_is_the_largest_that_fits_beside_the_kv_cache(shapes, shape_name, want):
    """`trainer.micro_batch_size: auto` starts from the batch's rows up to 64 and halves to fit: on one 80 GB GPU,
    with the default job's prompts (~60 tokens) and 256 new tokens, a 1.5B trains in micro-batches of 32 and a 7B
    of 8, both beside SGLang's KV cache (no memory saver): the plans of the arms measured on an H100
    (benchmarks/results/gpu_scale/s40-one-gpu/: 1.5b-1gpu-mb32, 7b-1gpu-default). Twice the chosen micro-batch
    does not fit, and a set number is where the plan starts instead."""
    plan = _plan(_cfg(), shapes[shape_name], prompt_tokens=60)
    assert plan.micro_batch_size == want and not plan.memory_saver and not plan.gradient_checkpointing
    with pytest.raises(ConfigError):
        _plan(_cfg(micro_batch_size=2 * want, gradient_checkpointing=False), shapes[shape_name], prompt_tokens=60)
    assert _plan(_cfg(micro_batch_size=4), shapes[shape_name], prompt_tokens=60).micro_batch_size == 4


def test_auto_micro_batch_without_a_gpu_to_plan_is_16_or_the_batch():
    from lora_rl_core.config import TrainerConfig

    assert TrainerConfig().micro_batch_start(128, on_gpu=False) == 16
    assert TrainerConfig().micro_batch_start(128, on_gpu=True) == 64
    assert TrainerConfig().micro_batch_start(12, on_gpu=True) == 12
    assert TrainerConfig(micro_batch_size=8).micro_batch_start(128, on_gpu=True) == 8
    with pytest.raises(ValueError, match="micro_batch_size"):
        TrainerConfig(micro_batch_size=0)


@pytest.mark.parametrize(("shape_name", "checkpointing"), [("7b", True), ("1.5b", False), ("7b", False)])
def test_auto_micro_batch_still_halves_when_checkpointing_is_set(shapes, shape_name, checkpointing):
    """Setting `gradient_checkpointing` (as the out-of-memory error advises) keeps the `auto` micro-batch halving
    to fit instead of starting at 64 and refusing; a set micro-batch with set checkpointing is taken as set."""
    plan = _plan(_cfg(gradient_checkpointing=checkpointing), shapes[shape_name], prompt_tokens=60)
    assert plan.gradient_checkpointing is checkpointing and 1 <= plan.micro_batch_size < 64
    assert plan.engine_fixed + plan.kv_cache + plan.trainer_resident + plan.activations < int(79.1 * GIB)
    bigger = _plan(_cfg(gradient_checkpointing=True), shapes[shape_name], prompt_tokens=60).micro_batch_size
    assert bigger >= plan.micro_batch_size  # recomputation never leaves room for fewer sequences
