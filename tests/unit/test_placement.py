"""Several GPUs (issue 33): the placement of trainer ranks and SGLang servers (one per GPU), the per-GPU
memory plan, one launched server per GPU, and a group's requests on one server. No GPU needed: the number
of visible GPUs is an argument of `resolve_placement`, and the HTTP client talks to a mock transport."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from lora_rl_core.config import LoRAConfig, ModelConfig, SGLangLaunchConfig, config_from_dict, load_config
from lora_rl_core.engines.base import GenerationRequest, spread_groups
from lora_rl_core.engines.launch.command import launch_flags
from lora_rl_core.engines.launch.probe import SGLangEnvironment
from lora_rl_core.engines.launch.resolve import resolve_launch
from lora_rl_core.errors import ConfigError
from lora_rl_core.memory import GIB, ModelShape, plan_memory
from lora_rl_core.plan.placement import Placement, resolve_placement, rollout_mode

SGLANG_LAUNCHED = ["engine.type=sglang", "engine.launch.enabled=true", "model.device=cuda"]
CONFIGS = Path(__file__).resolve().parents[2] / "benchmarks" / "model_configs"


def placed(visible: int, *overrides: str):
    return resolve_placement(load_config(None, [*SGLANG_LAUNCHED, *overrides]), visible)


def test_auto_keeps_one_gpu_and_runs_as_configured_without_a_launched_sglang():
    assert placed(1).kind == "as configured" and placed(1).ranks == 0 and placed(1).dp_size == 1
    embedded = resolve_placement(load_config(None, ["model.device=cuda"]), 4)
    assert embedded.kind == "as configured" and embedded.reason == "auto: no SGLang launched here"


def test_auto_on_several_gpus_splits_them_as_measured_fastest():
    p = placed(2)
    assert (p.kind, p.trainer_gpus, p.engine_gpus, p.ranks, p.dp_size) == ("split", (1,), (0,), 0, 1)
    assert p.describe() == "split: trainer in this process on GPU 1; 1 SGLang server on GPU 0"
    assert "split measured fastest" in p.reason
    four = placed(4)
    assert (four.trainer_gpus, four.engine_gpus, four.ranks, four.dp_size) == ((2, 3), (0, 1), 2, 2)


def test_colocated_puts_a_rank_and_a_server_on_each_gpu():
    p = placed(2, "placement=colocated")
    assert (p.kind, p.trainer_gpus, p.engine_gpus, p.ranks, p.dp_size) == ("colocated", (0, 1), (0, 1), 2, 2)
    assert p.shares_gpus and p.describe() == "colocated: 2 trainer ranks on GPUs 0,1; 2 SGLang servers on GPUs 0,1"


@pytest.mark.parametrize(
    ("settings", "why"),
    [
        (["trainer.backend=local", "trainer.backend.world_size=2", "trainer.backend.device=cuda"], "trainer.backend"),
        (["engine.launch.env={CUDA_VISIBLE_DEVICES: '1'}"], "engine.launch.env CUDA_VISIBLE_DEVICES"),
        (["model.device=cuda:1"], "model.device cuda:1"),
    ],
)
def test_auto_keeps_settings_that_place_the_run(settings, why):
    p = placed(4, *settings)
    assert p.kind == "as configured" and why in p.reason and p.trainer_gpus == ()


def test_split_gives_sglang_the_first_gpus_and_the_trainer_the_rest():
    two = placed(2, "placement=split")
    assert (two.trainer_gpus, two.engine_gpus, two.ranks, two.dp_size) == ((1,), (0,), 0, 1)  # trainer in process
    assert not two.shares_gpus
    four = placed(4, "placement=split")
    assert (four.trainer_gpus, four.engine_gpus, four.ranks, four.dp_size) == ((2, 3), (0, 1), 2, 2)
    one_engine = placed(4, "placement={type: split, engine_gpus: 1, gpus: [1, 2, 3]}")
    assert (one_engine.engine_gpus, one_engine.trainer_gpus) == ((1,), (2, 3))


@pytest.mark.parametrize(
    ("visible", "overrides", "message"),
    [
        (1, ["placement=split"], "placement: split needs 2 or more GPUs"),
        (2, ["placement={type: split, engine_gpus: 2}"], r"placement.engine_gpus 2 leaves none of GPUs \[0, 1\]"),
        (2, ["placement={type: colocated, gpus: [0, 5]}"], r"placement.gpus \[5\] are not visible here \(2 GPUs"),
        (
            2,
            ["placement=colocated", "trainer.backend=local"],
            "placement: colocated places the GPUs itself, but trainer.backend local also do",
        ),
        (2, ["placement=colocated", "engine.launch.enabled=false", "engine.urls=[http://h:1]"], "places a launched"),
        (0, ["placement=colocated"], "placement: colocated needs CUDA GPUs; this process sees 0"),
    ],
)
def test_a_placement_that_cannot_hold_is_refused_naming_the_setting(visible, overrides, message):
    with pytest.raises(ConfigError, match=message):
        placed(visible, *overrides)


def test_placement_gpus_must_be_distinct():
    with pytest.raises(ConfigError, match="placement.gpus must be distinct GPU indices"):
        load_config(None, ["placement={type: colocated, gpus: [1, 1]}"])


def test_manual_placement_places_nothing():
    p = placed(4, "placement=manual")
    assert p.kind == "as configured" and p.reason == "placement: manual"


@pytest.fixture(scope="module")
def shape_7b(tmp_path_factory) -> ModelShape:
    folder = tmp_path_factory.mktemp("7b")
    shutil.copy(CONFIGS / "qwen2.5-7b.json", folder / "config.json")
    return ModelShape.of(ModelConfig(name_or_path=str(folder)), LoRAConfig())


def test_the_memory_plan_is_per_gpu(shape_7b):
    """Two colocated GPUs: each holds half the trainer's base weights, the whole LoRA with its AdamW state, a
    whole SGLang server, and the KV cache of half the rollout batch."""
    cfg = config_from_dict(
        {
            "rollout": {"prompts_per_step": 16, "group_size": 8, "max_new_tokens": 256},
            "engine": {"type": "sglang", "launch": {"enabled": True}},
        }
    )
    total = int(79.1 * GIB)
    common = {
        "prompt_tokens": 150,
        "gpu_free": total,
        "gpu_total": total,
        "colocated": True,
        "saver_available": True,
        "mode": "sync",
    }
    one = plan_memory(cfg, shape_7b, **common)
    two = plan_memory(cfg, shape_7b, ranks=2, dp_size=2, shard_weights=True, **common)
    # half the base weights less; the LoRA weights are whole on each rank, with their gradients' all-reduce buffer
    saved = shape_7b.weight_bytes() / 2 - shape_7b.lora_params * 4
    assert one.trainer_resident - two.trainer_resident == pytest.approx(saved, rel=1e-6)
    assert two.kv_needed == one.kv_needed // 2 and two.engine_fixed == one.engine_fixed
    assert two.micro_batch_size >= one.micro_batch_size  # more room per GPU, never less


def test_one_sglang_server_per_gpu_each_on_its_port(monkeypatch, tmp_path):
    """With the placement's GPUs the sglang kind launches one server per GPU (ports `launch.port + i`, each
    its own `CUDA_VISIBLE_DEVICES` and log), side by side, and serves them as one `MultiEngine`; a server that
    does not start stops the others."""
    import dataclasses

    import lora_rl_core.engines.launch.sglang as sglang_kind
    from lora_rl_core.engines.multi import MultiEngine
    from lora_rl_core.engines.records import EngineInputs
    from lora_rl_core.errors import EngineError

    started: list[tuple[int, str, str]] = []
    stopped: list[int] = []

    class Server:
        memory_saver = False

        def __init__(self, index: int) -> None:
            self.index, self.url = index, f"http://127.0.0.1:{30000 + index}"

        def stop(self) -> None:
            stopped.append(self.index)

    def launch(engine, model, lora, log, *, resolved, plan, index):
        started.append((index, resolved.gpus[index], Path(log).name))
        if index == 2:
            raise EngineError("server 2 did not start")
        return Server(index)

    monkeypatch.setattr(sglang_kind, "launch_sglang", launch)
    from lora_rl_core.engines.remote import HTTPEngine

    asked: list[str] = []  # no server listens here: the version each client asks for at connect is answered here
    monkeypatch.setattr(HTTPEngine, "server_version", lambda self: asked.append(self.url) or "0.5.17")
    cfg = load_config(None, SGLANG_LAUNCHED)
    resolved = dataclasses.replace(resolve_launch(SGLangLaunchConfig(), SGLangEnvironment()), gpus=("4", "5"))
    assert resolved.servers == 2 and "--dp-size" not in launch_flags(resolved)
    inputs = EngineInputs(cfg.engine, cfg.model, cfg.lora, log_dir=tmp_path, launch=resolved)
    with sglang_kind.sglang_engine(inputs) as built:
        assert sorted(started) == [(0, "4", "sglang.log"), (1, "5", "sglang-1.log")]
        assert isinstance(built.engine, MultiEngine) and [e.url for e in built.engine.members()] == [
            "http://127.0.0.1:30000",
            "http://127.0.0.1:30001",
        ]
        assert sorted(asked) == ["http://127.0.0.1:30000", "http://127.0.0.1:30001"]
    assert sorted(stopped) == [0, 1]
    started.clear(), stopped.clear()
    three = EngineInputs(
        cfg.engine, cfg.model, cfg.lora, log_dir=tmp_path, launch=dataclasses.replace(resolved, gpus=("4", "5", "6"))
    )
    with pytest.raises(EngineError, match="server 2 did not start"):
        sglang_kind.sglang_engine(three)
    assert sorted(stopped) == [0, 1]  # the ones that started are stopped again


def test_the_launch_command_takes_the_server_port():
    from lora_rl_core.config import sglang_section
    from lora_rl_core.engines.launch.command import sglang_server_command

    cfg = load_config(None, SGLANG_LAUNCHED)
    resolved = resolve_launch(SGLangLaunchConfig(), SGLangEnvironment())
    argv = sglang_server_command(sglang_section(cfg.engine, "test"), cfg.model, cfg.lora, "/m", resolved, port=30001)
    assert argv[argv.index("--port") + 1] == "30001"


def test_spread_groups_keeps_a_group_together_and_balances_groups():
    requests = [GenerationRequest([p, p], None) for p in range(5) for _ in range(4)]  # 5 prompts x 4 samples
    shares = spread_groups(requests, 2, start=1)
    assert [len(s) for s in shares] == [8, 12]  # prompts 1, 3 on worker 0; prompts 0, 2, 4 on worker 1
    for share in shares:
        prompts = {tuple(requests[i].prompt_ids) for i in share}
        assert all(sum(1 for i in share if tuple(requests[i].prompt_ids) == p) == 4 for p in prompts)


def pretend_gpus(monkeypatch, tmp_path, count: int, shape: str) -> tuple:
    """A pretended machine of `count` 80 GB GPUs (physical 4, 5, ...) with SGLang's memory saver installed;
    returns `make_plan` and the overrides of a run of the Qwen2.5 `shape` launching SGLang."""
    import torch

    import lora_rl_core.plan.make as make

    folder = tmp_path / shape
    folder.mkdir()
    shutil.copy(CONFIGS / f"qwen2.5-{shape}.json", folder / "config.json")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (int(79 * GIB), int(79.6 * GIB)))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", ",".join(str(4 + i) for i in range(count)))
    h100 = SGLangEnvironment(memory_saver=True, gpu_total_bytes=int(79.6 * GIB), gpu_count=count)
    monkeypatch.setattr(make, "probe_for_launch", lambda launch: h100)
    overrides = [
        *SGLANG_LAUNCHED,
        f"model.name_or_path={folder}",
        "model.dtype=bfloat16",
        "rollout.prompts_per_step=16",
    ]
    return make.make_plan, overrides


@pytest.fixture
def two_gpus(monkeypatch, tmp_path):
    """Two pretended 80 GB GPUs and a 7B run (`pretend_gpus`)."""
    return pretend_gpus(monkeypatch, tmp_path, 2, "7b")


def test_the_plan_of_a_colocated_two_gpu_run(two_gpus, shape_7b):
    """Two FSDP2 ranks on GPUs 0 and 1, an SGLang server on each, the memory plan per GPU, adapters sent as a
    local folder every server reads; the choices say so."""
    make_plan, overrides = two_gpus
    cfg = load_config(None, [*overrides, "placement=colocated"])
    plan = make_plan(cfg)
    assert plan.trainer is not None and plan.engine.launch is not None
    t = plan.trainer
    assert (t.backend, t.world_size, t.device, t.gpus) == ("local", 2, "cuda", (0, 1))
    assert t.lora_compute_dtype == "bfloat16" and t.empty_cache_after_step == plan.engine.launch.memory_saver
    assert plan.engine.launch.servers == 2 and plan.engine.launch.gpus == ("4", "5")  # physical ids
    assert plan.engine.tensor_transport == "file"
    assert plan.choices["placement"].value == "colocated: 2 trainer ranks on GPUs 0,1; 2 SGLang servers on GPUs 0,1"
    assert plan.choices["trainer.backend"].value == "local"
    assert plan.memory is not None and plan.memory.colocated
    one = plan_memory(
        cfg, shape_7b, prompt_tokens=0, gpu_free=int(79 * GIB), gpu_total=int(79.6 * GIB), colocated=True,
        saver_available=True, mode="sync", ranks=0, dp_size=1,
    )  # fmt: skip
    # a 7B fits each GPU whole beside its SGLang server: no all-gathers (trainer.shard_weights auto)
    assert not plan.trainer.shard_weights and plan.memory.trainer_resident >= one.trainer_resident
    sharded = make_plan(load_config(None, [*overrides, "placement=colocated", "trainer.shard_weights=true"]))
    assert sharded.memory is not None and sharded.memory.trainer_resident < one.trainer_resident  # half the base


def test_the_plan_of_a_split_two_gpu_run(two_gpus):
    """SGLang alone on GPU 0 (physical 4), the trainer in this process on GPU 1, rollouts one step ahead."""
    make_plan, overrides = two_gpus
    plan = make_plan(load_config(None, [*overrides, "placement=split", "rollout.mode=async"]))
    assert plan.trainer is not None and plan.engine.launch is not None and plan.memory is not None
    t = plan.trainer
    assert (t.backend, t.world_size, t.device, t.gpus) == ("in-process", 0, "cuda:1", ())
    assert plan.engine.launch.servers == 1 and plan.engine.launch.gpus == ("4",)
    assert plan.engine.tensor_transport == "file" and not plan.memory.colocated


def test_sglang_on_a_gpu_of_its_own_must_fit_it(shape_7b, tmp_path):
    """Split: SGLang's copy of the model and the KV cache of its share of the batch are checked against one GPU
    before anything starts (a 7B fits an 80 GB GPU; not a 16 GB one, nor 80 GB with 8k-token completions)."""
    from lora_rl_core.memory import check_engine_alone

    cfg = load_config(None, [*SGLANG_LAUNCHED, "rollout.prompts_per_step=16", "rollout.group_size=8"])
    check_engine_alone(cfg, shape_7b, prompt_tokens=150, gpu_total=int(79.2 * GIB), servers=1, mode="sync")
    with pytest.raises(ConfigError, match=r"SGLang does not fit a GPU of its own \(16.0 GiB\): a 7.6B-parameter"):
        check_engine_alone(cfg, shape_7b, prompt_tokens=150, gpu_total=int(16 * GIB), servers=1, mode="sync")
    long = load_config(None, [*SGLANG_LAUNCHED, "rollout.prompts_per_step=64", "rollout.max_new_tokens=8192"])
    with pytest.raises(ConfigError, match="placement.engine_gpus"):
        check_engine_alone(long, shape_7b, prompt_tokens=150, gpu_total=int(79.2 * GIB), servers=1, mode="sync")
    check_engine_alone(
        long, shape_7b, prompt_tokens=150, gpu_total=int(79.2 * GIB), servers=4, mode="sync"
    )  # a quarter each


def test_split_runs_rollouts_ahead_unless_told_otherwise():
    """`rollout.mode: auto` (the default) is async where SGLang and the trainer have GPUs of their own (`split`,
    set or picked by `placement: auto` on several GPUs), else sync; a set mode stays."""

    def resolved(visible: int, *overrides: str) -> tuple[str, str]:
        cfg = load_config(None, [*SGLANG_LAUNCHED, *overrides])
        return rollout_mode(cfg, resolve_placement(cfg, visible))

    def mode(visible: int, *overrides: str) -> str:
        return resolved(visible, *overrides)[0]

    assert load_config(None, []).rollout.mode == "auto"
    assert mode(2, "placement=split") == "async" and mode(4, "placement={type: split, engine_gpus: 1}") == "async"
    assert mode(2) == "async"  # auto on two GPUs: split
    assert mode(1) == "sync" and mode(2, "placement=colocated") == "sync"
    assert mode(2, "placement=split", "rollout.mode=sync") == "sync"  # told otherwise
    assert mode(1, "rollout.mode=async") == "async"
    newest = "auto: algorithm.max_staleness 0 keeps every rollout on the newest version"
    assert resolved(2, "algorithm.max_staleness=0") == ("sync", newest)
    assert mode(2, "algorithm.off_policy_correction=none") == "sync"  # no correction asked: stay on-policy


def test_without_a_trainer_every_gpu_serves():
    """`lora-rl serve` and evaluations (`make_plan(train=False)`): each GPU of the placement gets a server."""
    cfg = load_config(None, SGLANG_LAUNCHED)
    served = resolve_placement(cfg, 2, train=False)
    assert (served.trainer_gpus, served.engine_gpus, served.dp_size) == ((), (0, 1), 2)
    assert served.reason.endswith("no trainer: SGLang on every GPU")
    assert resolve_placement(cfg, 1, train=False).engine_gpus == ()  # one GPU: as configured


def test_serve_refuses_the_port_of_any_server_it_launches():
    from cli.main import _check_port_is_not_sglangs

    cfg = load_config(None, SGLANG_LAUNCHED)
    _check_port_is_not_sglangs(cfg, 30002, servers=2)
    with pytest.raises(
        ConfigError, match=r"one of the 2 SGLang servers it launches \(engine.launch.port 30000 .. 30001\)"
    ):
        _check_port_is_not_sglangs(cfg, 30001, servers=2)


def test_a_32b_shape_on_four_gpus_splits_sglang_over_gpus_where_one_cannot_hold_it(monkeypatch, tmp_path):
    """A 32B copy (65 GB) beside a trainer rank's share does not fit one 80 GB GPU: `engine_tp: auto` picks the
    smallest tensor parallelism that fits, and each server is launched over its GPU group with `--tp-size`."""
    make_plan, overrides = pretend_gpus(monkeypatch, tmp_path, 4, "32b")
    colocated = make_plan(load_config(None, [*overrides, "placement=colocated"]))
    launch = colocated.engine.launch
    assert launch is not None and colocated.trainer is not None and colocated.memory is not None
    assert launch.tp_size > 1 and len(launch.gpus) * launch.tp_size == 4
    assert launch.gpus[0].split(",") == [str(4 + i) for i in range(launch.tp_size)]  # physical ids of a group
    assert "--tp-size" in launch_flags(launch) and colocated.trainer.world_size == 4
    assert colocated.choices["engine.launch.tp_size"].reason.startswith("auto: the smallest")
    assert f"(tp {launch.tp_size})" in colocated.choices["placement"].value
    fixed = make_plan(load_config(None, [*overrides, "placement={type: colocated, engine_tp: 4}"]))
    assert fixed.engine.launch is not None and fixed.engine.launch.gpus == ("4,5,6,7",)
    with pytest.raises(ConfigError, match=r"placement.engine_tp 4 does not divide SGLang's 2 GPUs"):
        make_plan(load_config(None, [*overrides, "placement={type: split, engine_tp: 4}"]))


def test_a_7b_keeps_one_gpu_per_server(two_gpus):
    make_plan, overrides = two_gpus
    plan = make_plan(load_config(None, [*overrides, "placement=colocated"]))
    assert plan.engine.launch is not None and plan.engine.launch.tp_size == 1 and plan.engine.launch.gpus == ("4", "5")


def test_engine_tp_takes_powers_of_two():
    with pytest.raises(ConfigError, match="placement.engine_tp must be 1, 2, 4, 8 or auto, got 3"):
        load_config(None, ["placement={type: colocated, engine_tp: 3}"])


def test_serving_a_32b_splits_it_over_gpus_only_where_one_cannot_hold_it(monkeypatch, tmp_path):
    """Without a trainer every GPU serves: a 32B copy fits an 80 GB GPU (two servers), not a 40 GB one (one
    server over both, `--tp-size 2`)."""
    import torch

    make_plan, overrides = pretend_gpus(monkeypatch, tmp_path, 2, "32b")
    plan = make_plan(load_config(None, overrides), train=False)
    assert plan.engine.launch is not None and plan.engine.launch.gpus == ("4", "5")
    assert plan.engine.launch.tp_size == 1
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (int(39.5 * GIB), int(39.6 * GIB)))
    small = make_plan(load_config(None, overrides), train=False)
    assert small.engine.launch is not None and small.engine.launch.gpus == ("4,5",)
    assert small.engine.launch.tp_size == 2


def test_rollouts_on_sglangs_own_gpus_take_the_largest_tensor_parallelism(monkeypatch, tmp_path):
    """Split: SGLang's GPUs form one tensor-parallel server (decoding is bound by reading the weights, so tp
    shortens each token step where more servers do not; measured on 4 H100s). Colocated keeps the smallest."""
    from lora_rl_core.plan.placement import TP_LARGEST, TP_SMALLEST

    make_plan, overrides = pretend_gpus(monkeypatch, tmp_path, 4, "7b")
    split = make_plan(load_config(None, [*overrides, "placement=split"]))
    launch = split.engine.launch
    assert launch is not None and (launch.tp_size, launch.gpus) == (2, ("4,5",))
    assert split.choices["engine.launch.tp_size"].reason == TP_LARGEST
    assert split.trainer is not None and split.trainer.gpus == (2, 3)
    pinned = make_plan(load_config(None, [*overrides, "placement={type: split, engine_tp: 1}"]))
    assert pinned.engine.launch is not None and pinned.engine.launch.gpus == ("4", "5")
    assert pinned.choices["engine.launch.tp_size"].reason == "placement.engine_tp"
    colocated = make_plan(load_config(None, [*overrides, "placement=colocated"]))
    assert colocated.engine.launch is not None and colocated.engine.launch.tp_size == 1
    assert colocated.choices["engine.launch.tp_size"].reason == TP_SMALLEST


def test_tensor_parallelism_divides_the_attention_heads():
    cfg = load_config(None, [*SGLANG_LAUNCHED])
    p = Placement("split", (8,), tuple(range(8)))
    assert p.tp_choices(cfg, heads=12, largest=True) == [4, 2, 1]  # 8 does not divide 12 heads
    assert p.tp_choices(cfg, heads=40) == [1, 2, 4, 8]
    assert p.tp_choices(cfg) == [1, 2, 4, 8]


def test_auto_rollouts_fall_back_to_sync_where_async_does_not_fit_sglangs_gpu(monkeypatch, tmp_path):
    """Async holds two steps of rollouts in SGLang's KV cache. Under `rollout.mode: auto` a split whose async
    KV cache would not fit SGLang's GPU runs sync instead, saying why; asked for explicitly, async is refused."""
    make_plan, overrides = pretend_gpus(monkeypatch, tmp_path, 2, "7b")
    big = [*overrides, "placement=split", "rollout.prompts_per_step=21", "rollout.max_new_tokens=4096"]
    plan = make_plan(load_config(None, big))
    assert plan.rollout_mode == "sync" and plan.rollouts_ahead() == 0
    assert plan.choices["rollout.mode"].reason == "auto: rollouts one step ahead do not fit SGLang's memory; sync does"
    assert "rollout.mode sync: the GPUs take turns" in plan.choices["placement"].reason
    with pytest.raises(ConfigError, match="SGLang does not fit a GPU of its own"):
        make_plan(load_config(None, [*big, "rollout.mode=async"]))
    small = make_plan(load_config(None, [*overrides, "placement=split"]))
    assert small.rollout_mode == "async" and small.rollouts_ahead() == 1
    assert "take turns" not in small.choices["placement"].reason


def test_ranks_hold_the_base_weights_whole_where_they_fit_and_shard_them_where_not(monkeypatch, tmp_path):
    """`trainer.shard_weights: auto`: a 7B split over 4 80 GB GPUs trains data parallel (no all-gathers), a 32B
    shards; the choice and its reason reach the trainer plan and `run.json`; a setting overrides it."""
    make_plan, overrides = pretend_gpus(monkeypatch, tmp_path, 4, "7b")
    seven = make_plan(load_config(None, [*overrides, "placement=split"]))
    assert seven.trainer is not None and seven.memory is not None
    assert not seven.trainer.shard_weights and not seven.memory.shard_weights
    assert seven.choices["trainer.shard_weights"].reason.startswith("auto: the base weights fit every rank whole")
    assert (
        seven.memory.trainer_resident
        > ModelShape.of(ModelConfig(name_or_path=str(tmp_path / "7b")), LoRAConfig()).weight_bytes()
    )  # the whole base on each GPU
    forced = make_plan(load_config(None, [*overrides, "placement=split", "trainer.shard_weights=true"]))
    assert forced.trainer is not None and forced.trainer.shard_weights
    assert forced.choices["trainer.shard_weights"].reason == "trainer.shard_weights=true"
    make_plan, overrides = pretend_gpus(monkeypatch, tmp_path, 4, "32b")
    big = make_plan(load_config(None, [*overrides, "placement=split"]))
    assert big.trainer is not None and big.trainer.shard_weights
    assert big.choices["trainer.shard_weights"].reason.startswith("auto: whole base weights would leave micro-batch")
