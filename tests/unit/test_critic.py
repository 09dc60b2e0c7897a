"""PPO's critic (`algorithm.advantage: gae`): a second LoRA adapter and a value head on the policy's own base,
trained beside the policy, checkpointed with it and never published."""

from __future__ import annotations

import json
import math
import warnings

import pytest
import torch
from torch.testing import assert_close

from lora_rl_core.checkpoint import SHARDED, CheckpointStore, CheckpointTarget
from lora_rl_core.config import RunConfig
from lora_rl_core.errors import ConfigError
from lora_rl_core.models import load_model
from lora_rl_core.plan import make_plan
from lora_rl_core.records import TrainBatch
from lora_rl_core.trainer import PolicyTrainer
from lora_rl_core.trainer.build import policy_model
from lora_rl_core.trainer.critic import CRITIC, VALUE_HEAD

VOCAB = 64


def ppo_config(model_dir, *, critic: dict | None = None, **algorithm) -> RunConfig:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return RunConfig.model_validate(
            {
                "model": {"name_or_path": str(model_dir), "dtype": "float32", "device": "cpu"},
                "lora": {"rank": 4, "alpha": 8},
                "algorithm": {"advantage": "gae", "gamma": 1.0, "lam": 0.95, **algorithm},
                "critic": {"lora": {"rank": 2, "alpha": 4}, "lr": 1e-2, **(critic or {})},
                "trainer": {"lr": 1e-2, "micro_batch_size": 2, "steps": 4},
                "run": {"seed": 3},
            }
        )


def build(cfg: RunConfig) -> PolicyTrainer:
    plan = make_plan(cfg).trainer
    assert plan is not None and plan.backend == "in-process"
    torch.manual_seed(cfg.run.seed)  # as the run seeds it before building
    model, pad_id = policy_model(plan, device=plan.device)
    return PolicyTrainer(model, plan, pad_id=pad_id)


def make_batch(rows: int, seed: int) -> TrainBatch:
    """Random prompts and completions, rewards 0/1, random inference logprobs (group advantages unused)."""
    g = torch.Generator().manual_seed(seed)
    sizes = [
        (int(torch.randint(2, 7, (1,), generator=g)), int(torch.randint(1, 6, (1,), generator=g))) for _ in range(rows)
    ]
    prompts = [torch.randint(1, VOCAB, (p,), generator=g).tolist() for p, _ in sizes]
    completions = [torch.randint(1, VOCAB, (c,), generator=g).tolist() for _, c in sizes]
    inference = [(-3 * torch.rand(c, generator=g)).tolist() for _, c in sizes]
    return TrainBatch(prompts, completions, [0.0] * rows, inference, rewards=[float(i % 2) for i in range(rows)])


def head_weight(trainer: PolicyTrainer) -> torch.Tensor:
    head = trainer.model.base_model.model.get_submodule(VALUE_HEAD).modules_to_save[CRITIC]
    return head.weight.detach().clone()


def policy_weights(trainer: PolicyTrainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in zip(trainer.param_names, trainer.params, strict=True)}


def test_critic_pretrains_alone_then_both_train(tiny_model_dir):
    trainer = build(ppo_config(tiny_model_dir, critic={"pretrain_steps": 1}))
    assert trainer.critic is not None
    assert torch.count_nonzero(head_weight(trainer)) == 0  # zeros: the critic predicts 0 before it trains
    critic_before = [p.detach().clone() for p in trainer.critic.params]
    policy_before = policy_weights(trainer)

    first = trainer.train_step(make_batch(6, 1))
    assert first["policy_trained"] == 0.0 and "grad_norm" not in first
    assert all(torch.equal(policy_before[n], w) for n, w in policy_weights(trainer).items())
    assert torch.count_nonzero(head_weight(trainer)) > 0  # the head moved off zero
    assert first["value_mean"] == pytest.approx(0.0, abs=1e-6)  # the values before this step's update
    assert first["value_loss"] > 0 and first["critic_grad_norm"] > 0 and first["critic_seconds"] > 0
    assert 0.0 <= first["value_clip_fraction"] <= 1.0

    second = trainer.train_step(make_batch(6, 2))
    assert second["policy_trained"] == 1.0 and second["grad_norm"] > 0
    assert any(not torch.equal(policy_before[n], w) for n, w in policy_weights(trainer).items())
    lora_b = [p for n, p in zip(trainer.critic.param_names, trainer.critic.params, strict=True) if "lora_B" in n]
    assert any(torch.count_nonzero(p) > 0 for p in lora_b)  # the critic's LoRA learns once the head is nonzero
    assert any(not torch.equal(a, b) for a, b in zip(critic_before, trainer.critic.params, strict=True))
    assert second["value_mean"] != 0.0  # the critic predicts something now
    assert -10.0 < second["explained_variance"] <= 1.0


def test_one_copy_of_the_base_serves_both_adapters(tiny_model_dir):
    cfg = ppo_config(tiny_model_dir)
    trainer = build(cfg)
    base, _ = load_model(cfg.model)
    hidden = base.get_input_embeddings().weight.shape[1]
    frozen = sum(p.numel() for n, p in trainer.model.named_parameters() if ".lora_" not in n and CRITIC not in n)
    assert frozen == sum(p.numel() for p in base.parameters()) + hidden + 1  # + the head's frozen original


def test_the_critic_is_never_published(tiny_model_dir):
    trainer = build(ppo_config(tiny_model_dir))
    trainer.train_step(make_batch(4, 1))
    tensors, config = trainer.adapter_state()
    assert tensors and not [k for k in tensors if VALUE_HEAD in k or CRITIC in k]
    assert config["r"] == 4 and not config.get("modules_to_save")


def test_checkpoint_round_trip_restores_the_critic(tiny_model_dir, tmp_path):
    cfg = ppo_config(tiny_model_dir, critic={"pretrain_steps": 2})
    trainer = build(cfg)
    trainer.train_step(make_batch(6, 1))
    state = trainer.state_dict()
    assert state["meta"]["critic"]["updates"] == 1
    assert [k for k in state["tensors"] if k.startswith("critic/params/") and VALUE_HEAD in k]
    # the run's path: the trainer writes its part itself; the store gives back the same state
    trainer.save_checkpoint(CheckpointTarget(f"file://{tmp_path}", "critic", 1))
    files = {name: entry for report in trainer.written_checkpoints(wait=True) for name, entry in report.files.items()}
    store = CheckpointStore(f"file://{tmp_path}")
    store.save("critic", 1, {"trainer": SHARDED}, shards=files)
    written = store.load("critic", 1)["trainer"]
    assert written["meta"] == json.loads(json.dumps(state["meta"]))
    assert written["tensors"].keys() == state["tensors"].keys()
    assert all(torch.equal(written["tensors"][k], v) for k, v in state["tensors"].items())

    other = build(cfg.model_copy(update={"run": cfg.run.model_copy(update={"seed": 11})}))  # another init
    other.load_state_dict(state)
    assert other.critic is not None and other.critic.updates == 1 and other.critic.pretraining
    assert torch.equal(head_weight(other), head_weight(trainer))
    for a, b in zip(trainer.critic.params, other.critic.params, strict=True):
        assert torch.equal(a, b)
    # both continue alike: the restored AdamW moments and scheduler give the same update
    batch = make_batch(6, 2)
    torch.manual_seed(0)
    want = trainer.train_step(batch)
    torch.manual_seed(0)
    got = other.train_step(batch)
    assert got["value_loss"] == pytest.approx(want["value_loss"], rel=1e-5)
    assert torch.allclose(head_weight(other), head_weight(trainer), atol=1e-6)


def test_a_checkpoint_without_a_critic_is_refused(tiny_model_dir):
    grpo = RunConfig.model_validate(
        {
            "model": {"name_or_path": str(tiny_model_dir), "dtype": "float32", "device": "cpu"},
            "lora": {"rank": 4, "alpha": 8},
            "run": {"seed": 3},
        }
    )
    state = build(grpo).state_dict()
    with pytest.raises(ValueError, match="no critic state"):
        build(ppo_config(tiny_model_dir)).load_state_dict(state)


def test_a_checkpoint_whose_critic_has_another_rank_is_refused_before_any_weight_is_copied(tiny_model_dir):
    """The policy's state fits and the critic's names do too, but not its shapes (`critic.lora.rank`): refused
    naming the critic's parameter, and the policy's weights are not overwritten first."""
    state = build(ppo_config(tiny_model_dir)).state_dict()
    other = build(ppo_config(tiny_model_dir, critic={"lora": {"rank": 4, "alpha": 8}}))
    before = [p.detach().clone() for p in other.params]
    with pytest.raises(
        ValueError,
        match=r"trainer state's critic/params/\S+ is \[2, \d+\], this critic's \[4, \d+\]"
        r": the checkpoint was written with another critic.lora.rank",
    ):
        other.load_state_dict(state)
    assert all(torch.equal(a, b) for a, b in zip(other.params, before, strict=True))


def test_critic_lora_matching_nothing_names_the_field(tiny_model_dir):
    cfg = ppo_config(tiny_model_dir, critic={"lora": {"rank": 2, "target_modules": ["nonexistent_proj"]}})
    with pytest.raises(ConfigError, match=r"critic\.lora\.target_modules"):
        build(cfg)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"algorithm": {"advantage": "grpo"}, "critic": {"lr": 1e-3}}, "critic.lr is set but algorithm.advantage"),
        ({"algorithm": {"advantage": "gae"}, "critic": {"pretrain_steps": 4}}, "critic.pretrain_steps"),
        ({"algorithm": {"advantage": "gae", "gamma": 1.5}}, "gamma"),
        ({"algorithm": {"advantage": "gae", "lam": -0.1}}, "lam"),
        ({"algorithm": {"advantage": "gae"}, "critic": {"value_clip": 0}}, "value_clip"),
    ],
)
def test_bad_critic_settings_are_refused(overrides, message):
    with pytest.raises(ValueError, match=message):
        RunConfig.model_validate({"trainer": {"steps": 4}, **overrides})


def test_plan_resolves_the_critic_and_moves_the_kl_into_the_reward(tiny_model_dir):
    cfg = ppo_config(tiny_model_dir, kl_coef=0.05, critic={"lr": None, "lora": None})
    plan = make_plan(cfg)
    assert plan.trainer is not None and plan.trainer.critic is not None
    assert plan.trainer.critic.lr == pytest.approx(10 * cfg.trainer.lr)
    assert plan.trainer.critic.lora == cfg.lora
    assert plan.trainer.loss.kl_coef == 0.0 and plan.trainer.critic.kl_coef == 0.05
    assert plan.choices["critic.lr"].reason.startswith("10 x trainer.lr")


def test_kl_in_the_reward_is_reported(tiny_model_dir):
    trainer = build(ppo_config(tiny_model_dir, kl_coef=0.1, critic={"pretrain_steps": 1}))
    trainer.train_step(make_batch(4, 1))
    metrics = trainer.train_step(make_batch(4, 2))  # the policy moved in step 2's update only: KL 0 before it
    assert metrics["kl_in_reward"] == pytest.approx(0.0, abs=1e-6)
    metrics = trainer.train_step(make_batch(4, 3))
    assert metrics["kl_in_reward"] != 0.0 and metrics["kl"] == 0.0  # in the reward, not the loss


@pytest.mark.slow
@pytest.mark.spawn
def test_two_fsdp_ranks_train_the_critic_like_one_process_and_resume_in_one(tiny_model_dir):
    """Two CPU ranks (the base sharded, both adapters and the head whole on each) give the same policy and
    critic as one process, and their checkpoint resumes in one process (2 ranks -> 1)."""
    from lora_rl_core.config import LocalBackend
    from lora_rl_core.trainer.workers import TrainerWorkers

    cfg = ppo_config(tiny_model_dir, critic={"pretrain_steps": 1})
    single = build(cfg)
    trainer = cfg.trainer.model_copy(update={"backend": LocalBackend(world_size=2, device="cpu")})
    plan = make_plan(cfg.model_copy(update={"trainer": trainer})).trainer
    assert plan is not None
    # the third: rows only the critic trains on (`value_only`)
    third = TrainBatch(**{**vars(make_batch(5, 3)), "value_only": [True, True, False, True, False]})
    batches = [make_batch(6, 1), make_batch(5, 2), third]
    with TrainerWorkers(plan, timeout_s=120) as workers:
        for batch in batches:
            got, want = workers.train_step(batch), single.train_step(batch)
            assert got["value_loss"] == pytest.approx(want["value_loss"], rel=1e-3, abs=1e-6)
            assert got.get("pg_loss", 0.0) == pytest.approx(want.get("pg_loss", 0.0), rel=1e-3, abs=1e-6)
        state = workers.state_dict()
    ours = single.state_dict()["tensors"]
    critic_keys = [k for k in ours if k.startswith("critic/params/")]
    assert critic_keys and any(VALUE_HEAD in k for k in critic_keys)
    for key in critic_keys + [k for k in ours if k.startswith("params/")]:
        assert torch.allclose(state["tensors"][key], ours[key], atol=1e-4), key
    resumed = build(cfg)
    resumed.load_state_dict(state)
    assert resumed.critic is not None and resumed.critic.updates == 3 and not resumed.critic.pretraining
    assert torch.allclose(head_weight(resumed), head_weight(single), atol=1e-4)


def test_critic_epochs_take_that_many_optimizer_steps_per_training_step(tiny_model_dir):
    trainer = build(ppo_config(tiny_model_dir, critic={"epochs": 3}))
    trainer.train_step(make_batch(6, 1))
    assert trainer.critic is not None
    steps = {float(trainer.critic.optimizer.state[p]["step"]) for p in trainer.critic.params}
    assert steps == {3.0}  # three passes of the critic, one of the policy
    assert {float(trainer.optimizer.state[p]["step"]) for p in trainer.params} == {1.0}


def _policy_update(model_dir, batch: TrainBatch) -> dict[str, torch.Tensor]:
    trainer = build(ppo_config(model_dir, lam=1.0))
    before = policy_weights(trainer)
    trainer.train_step(batch)
    return {n: w - before[n] for n, w in policy_weights(trainer).items()}


def test_a_value_only_row_shapes_the_advantages_but_adds_no_policy_loss(tiny_model_dir):
    """A completion cut at the limit under `truncation: mask` (`value_only`): the critic trains on it and the
    whitening counts it, the policy's loss does not. Before its first update the critic predicts 0 whatever the
    tokens, so the policy's update cannot depend on the value-only row's tokens, only on its length and reward;
    the same row in the policy's loss changes the update."""
    batch = make_batch(4, 5)
    other = list(batch.completion_ids)
    other[0] = [(t % (VOCAB - 1)) + 1 for t in (x + 7 for x in other[0])]  # other tokens, same length
    swapped = TrainBatch(batch.prompt_ids, other, batch.advantages, batch.inference_logprobs, rewards=batch.rewards)
    value_only = [True, False, False, False]
    a = _policy_update(tiny_model_dir, TrainBatch(**{**vars(batch), "value_only": value_only}))
    b = _policy_update(tiny_model_dir, TrainBatch(**{**vars(swapped), "value_only": value_only}))
    assert all(torch.allclose(a[n], b[n], atol=1e-7) for n in a)
    assert any(float(d.abs().max()) > 0 for d in a.values())  # the other rows trained the policy
    c = _policy_update(tiny_model_dir, batch)
    d = _policy_update(tiny_model_dir, swapped)
    assert any(not torch.allclose(c[n], d[n], atol=1e-7) for n in c)  # in the loss, its tokens count


def test_a_batch_of_value_only_rows_trains_the_critic_and_leaves_the_policy(tiny_model_dir):
    trainer = build(ppo_config(tiny_model_dir))
    policy_before, head_before = policy_weights(trainer), head_weight(trainer)
    batch = make_batch(4, 2)
    metrics = trainer.train_step(TrainBatch(**{**vars(batch), "value_only": [True] * 4}))
    assert all(torch.equal(policy_before[n], w) for n, w in policy_weights(trainer).items())
    assert not torch.equal(head_weight(trainer), head_before)
    assert metrics["train_sequences"] == 0 and metrics["value_only_sequences"] == 4
    assert metrics["policy_trained"] == 0.0 and "grad_norm" not in metrics


def test_many_value_only_rows_leave_the_policy_rows_advantages_at_unit_scale(tiny_model_dir):
    """Two completions that ended (reward 1, 2 tokens each) among six cut at the limit (`value_only`, reward 0,
    4 tokens each). Before its first update the critic predicts 0, so with gamma = lam = 1 each token's
    advantage is its row's reward. The mean is every token's, 4 / 28 = 1/7: the cut rows stay in the baseline.
    The scale is the policy rows' mean square about it, 4 x (6/7)^2 / 3 = 48/49: their advantages are
    (6/7) / sqrt(48/49) = 6 / sqrt(48) = 0.866, not 2.40 (a std over every token, 168 / 1323, would give that)."""
    trainer = build(ppo_config(tiny_model_dir, lam=1.0))
    assert trainer.critic is not None
    critic = trainer.critic
    seen = {}
    targets = critic.targets

    def record(*args, **kwargs):
        out, metrics = targets(*args, **kwargs)
        seen.update(out)
        return out, metrics

    critic.targets = record  # type: ignore[method-assign]
    rows = 8
    batch = TrainBatch(
        [[5, 6]] * rows,
        [[7, 8]] * 2 + [[9, 10, 11, 12]] * 6,
        [0.0] * rows,
        [[-1.0, -1.0]] * 2 + [[-1.0] * 4] * 6,
        rewards=[1.0, 1.0] + [0.0] * 6,
        value_only=[False, False] + [True] * 6,
    )
    trainer.train_step(batch)
    assert sorted(seen) == list(range(rows))
    for i in (0, 1):
        assert_close(seen[i].advantages, torch.full((2,), 6 / math.sqrt(48)), rtol=1e-5, atol=1e-6)
    for i in range(2, rows):
        assert_close(seen[i].advantages, torch.full((4,), -1 / math.sqrt(48)), rtol=1e-5, atol=1e-6)
    policy = torch.cat([seen[i].advantages for i in (0, 1)])
    assert float(policy.pow(2).sum() / (policy.numel() - 1)) == pytest.approx(1.0, rel=1e-5)
