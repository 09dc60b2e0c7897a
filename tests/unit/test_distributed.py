"""FSDP2 training on CPU (gloo) with persistent worker processes, against the in-process trainer.

Tests marked `spawn` (and `slow`) start worker processes (seconds each); the two worker groups are shared
by the module, and each test that trains first resets them to the initial checkpoint, so order does not
matter. The kill test ends the two-rank group; a test that needs it afterwards starts its own.
The config exercises every collective pattern: two minibatches (old-logprob passes), KL to the adapter-
disabled reference, TIS, one-row micro-batches, batches that leave a rank with fewer (or no) rows, and
gradient clipping that is active on every step (so a per-rank instead of global norm would show).
"""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import os
import signal
import time
import warnings
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from peft import get_peft_model_state_dict

from lora_rl_core.checkpoint import SHARDED, CheckpointStore, CheckpointTarget
from lora_rl_core.config import InProcessBackend, LocalBackend, RunConfig
from lora_rl_core.distributed import find_decoder_layers
from lora_rl_core.lora import adapter_state, apply_lora
from lora_rl_core.models import load_model
from lora_rl_core.plan import make_plan
from lora_rl_core.records import TrainBatch
from lora_rl_core.trainer import PolicyTrainer, TrainerPlan, rank_micro_batches
from lora_rl_core.trainer.batching import padding_fraction
from lora_rl_core.trainer.workers import TrainerWorkerError, TrainerWorkers, _serve


def spawn(test):
    """Starts worker processes: `spawn` and `slow`."""
    return pytest.mark.slow(pytest.mark.spawn(test))


VOCAB = 64  # random token ids stay below this; the tiny tokenizer has 78 tokens
METRICS = ("loss", "pg_loss", "kl", "entropy", "grad_norm", "clip_fraction", "ratio_mean", "ratio_max", "lr")


def make_config(model_dir, **model) -> RunConfig:
    with warnings.catch_warnings():  # two minibatches depart from the LoRA recipe: expected here
        warnings.simplefilter("ignore")
        return RunConfig.model_validate(
            {
                "model": {"name_or_path": str(model_dir), "dtype": "float32", "device": "cpu", **model},
                "lora": {"rank": 4, "alpha": 8},
                "algorithm": {
                    "num_minibatches": 2,
                    "kl_coef": 0.05,
                    "off_policy_correction": {"type": "token-truncate", "is_cap": 2.0},
                },
                "trainer": {"lr": 1e-2, "micro_batch_size": 1, "warmup_steps": 2, "max_grad_norm": 0.02},
                "run": {"seed": 3},
            }
        )


def make_batch(rows: int, seed: int) -> TrainBatch:
    """Random prompts (2-6 tokens) and completions (1-5), fixed advantages, random inference logprobs."""
    g = torch.Generator().manual_seed(seed)
    sizes = [
        (int(torch.randint(2, 7, (1,), generator=g)), int(torch.randint(1, 6, (1,), generator=g))) for _ in range(rows)
    ]
    prompts = [torch.randint(1, VOCAB, (p,), generator=g).tolist() for p, _ in sizes]
    completions = [torch.randint(1, VOCAB, (c,), generator=g).tolist() for _, c in sizes]
    advantages = [(-1.0) ** i * (1 + i % 3) / 2 for i in range(rows)]
    inference = [(-3 * torch.rand(c, generator=g)).tolist() for _, c in sizes]
    return TrainBatch(prompts, completions, advantages, inference)


# 8 rows split evenly; 5 rows leave rank 1 a dummy micro-batch; 1 row leaves rank 1 without rows
BATCHES = [make_batch(8, 1), make_batch(8, 2), make_batch(5, 3), make_batch(1, 4)]


def ranks(cfg: RunConfig, world_size: int) -> TrainerPlan:
    """The trainer plan of `cfg` with `world_size` CPU ranks (0: in this process)."""
    backend = LocalBackend(world_size=world_size, device="cpu") if world_size else InProcessBackend()
    trainer = cfg.trainer.model_copy(update={"backend": backend})
    plan = make_plan(cfg.model_copy(update={"trainer": trainer})).trainer
    assert plan is not None
    return plan


def inprocess_trainer(cfg: RunConfig) -> PolicyTrainer:
    model, tokenizer = load_model(cfg.model)
    torch.manual_seed(cfg.run.seed)  # as build_sharded_trainer does
    return PolicyTrainer(apply_lora(model, cfg.lora), ranks(cfg, 0), pad_id=tokenizer.pad_token_id)


def assert_adapters_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], atol: float) -> None:
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert torch.allclose(got[key], value, atol=atol), (key, (got[key] - value).abs().max())


def assert_metrics_close(got: dict[str, float], want: dict[str, float]) -> None:
    for key in METRICS:
        assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-5), key
    assert got["train_tokens"] == want["train_tokens"]


@pytest.fixture(scope="module")
def cfg(tiny_model_dir) -> RunConfig:
    return make_config(tiny_model_dir)


@pytest.fixture(scope="module")
def initial_state(cfg):
    return inprocess_trainer(cfg).state_dict()


@pytest.fixture(scope="module")
def groups(cfg, initial_state):
    """Worker groups started concurrently (start-up is mostly imports): world sizes 2 and 1."""
    sizes = {"two": 2, "one": 1}
    with ThreadPoolExecutor(len(sizes)) as pool:
        futures = {name: pool.submit(TrainerWorkers, ranks(cfg, n), timeout_s=120) for name, n in sizes.items()}
    started = {name: f.result() for name, f in futures.items() if f.exception() is None}
    try:
        assert len(started) == len(sizes), [f.exception() for f in futures.values()]
        yield started
    finally:
        for workers in started.values():
            workers.close()


@pytest.fixture
def workers2(cfg, groups) -> Iterator[TrainerWorkers]:
    """The shared two-rank group; a group of the test's own if the kill test (last in the file) ended it."""
    if not groups["two"]._closed:
        yield groups["two"]
        return
    with TrainerWorkers(ranks(cfg, 2), timeout_s=120) as workers:
        yield workers


@pytest.fixture(scope="module")
def workers1(groups) -> TrainerWorkers:
    return groups["one"]


# ---------------------------------------------------------------------- pure helpers (no processes)
def test_rank_micro_batches_share_rows_and_pad_to_equal_counts():
    lengths = [5, 1, 4, 2, 3, 9, 7]  # length order: rows 1, 3, 4, 2, 0, 6, 5
    rows = list(range(7))
    plans = [rank_micro_batches(lengths, rows, size=3, rank=r, world_size=2) for r in range(2)]
    assert plans == [[[1, 4, 0], [5]], [[3, 2, 6], []]]  # dealt round-robin; rank 1 padded with a dummy
    assert rank_micro_batches(lengths, rows, size=3) == [[1, 3, 4], [2, 0, 6], [5]]  # one process: length order
    assert rank_micro_batches(lengths, [5, 6], size=3) == [[6, 5]]  # only the minibatch's rows


def test_padding_fraction_counts_the_padding_left_inside_each_micro_batch():
    lengths = [10, 4, 6, 10]
    # [1, 2] pads to 6 (2 of 12 positions), [0, 3] needs none, the empty dummy is skipped: 2 of 32
    assert padding_fraction(lengths, [[1, 2], [0, 3], []]) == pytest.approx(2 / 32)
    assert padding_fraction(lengths, [[1, 0]]) == pytest.approx(6 / 20)  # unsorted rows pay more
    assert padding_fraction(lengths, [rows for rows in rank_micro_batches(lengths, [0, 1, 2, 3], size=2)]) == (
        pytest.approx(2 / 32)  # the length-sorted plan is the first one
    )
    assert padding_fraction(lengths, [[]]) == 0.0


def test_rank_micro_batches_gives_empty_plans_to_idle_ranks():
    assert rank_micro_batches([4, 2], [0], size=4, rank=1, world_size=2) == [[]]
    assert rank_micro_batches([4, 2], [0], size=4, rank=0, world_size=2) == [[0]]


def test_find_decoder_layers_finds_the_block_list(cfg):
    model, _ = load_model(cfg.model)
    peft_model = apply_lora(model, cfg.lora)
    assert find_decoder_layers(peft_model) is peft_model.get_base_model().model.layers


def test_worker_loop_reports_errors_and_keeps_serving():
    class Broken:
        def gather_state_dict(self):
            raise ValueError("boom")

    parent, child = multiprocessing.Pipe()
    parent.send(("state_dict", (True,)))  # shared memory
    parent.send(("close", ()))
    _serve(Broken(), child)  # returns on "close"
    status, text = parent.recv()
    assert status == "error" and "ValueError: boom" in text


# ---------------------------------------------------------------------- worker processes
@spawn
def test_sharded_training_matches_single_process(cfg, initial_state, workers1, workers2):
    reference = inprocess_trainer(cfg)
    for workers in (workers1, workers2):
        workers.load_state_dict(initial_state)
    for batch in BATCHES:
        want = reference.train_step(batch)
        for workers in (workers1, workers2):
            assert_metrics_close(workers.train_step(batch), want)
    want_adapter, want_config = adapter_state(reference.model)
    for workers in (workers1, workers2):
        got_adapter, got_config = workers.adapter_state()
        assert got_config == want_config
        assert_adapters_close(got_adapter, want_adapter, atol=1e-5)


@spawn
def test_profiled_step_trains_as_the_plain_step_and_reports_every_rank(cfg, initial_state, workers2):
    reference = inprocess_trainer(cfg)
    workers2.load_state_dict(initial_state)
    want = reference.train_step(BATCHES[0])
    got, report = workers2.profiled_train_step(BATCHES[0], row_limit=5)
    assert_metrics_close(got, want)
    assert "rank 0 of 2: train" in report and "rank 1 of 2: train" in report
    assert report.count("Self CPU") >= 2  # each rank's operator table
    want_adapter, _ = adapter_state(reference.model)
    got_adapter, _ = workers2.adapter_state()
    assert_adapters_close(got_adapter, want_adapter, atol=1e-5)  # the profiled step updated the adapter


@spawn
def test_gathered_adapter_has_peft_keys(cfg, workers2):
    tensors, config = workers2.adapter_state()
    model, _ = load_model(cfg.model)
    unsharded = get_peft_model_state_dict(apply_lora(model, cfg.lora))
    assert tensors.keys() == unsharded.keys()
    for key, value in unsharded.items():
        assert tensors[key].shape == value.shape and tensors[key].dtype == torch.float32, key
    assert config["r"] == 4


@spawn
def test_checkpoint_round_trip(cfg, initial_state, workers1, workers2):
    workers2.load_state_dict(initial_state)
    for batch in BATCHES[:2]:
        workers2.train_step(batch)
    saved = workers2.state_dict()
    assert json.loads(json.dumps(saved["meta"]))["world_size"] == 2
    assert {"rng/rank0/cpu", "rng/rank1/cpu"} <= saved["tensors"].keys()
    want = workers2.train_step(BATCHES[2])
    want_adapter = workers2.adapter_state()[0]
    workers2.load_state_dict(saved)  # the same workers, after training on
    assert workers2.train_step(BATCHES[2])["loss"] == pytest.approx(want["loss"], abs=1e-7)
    assert_adapters_close(workers2.adapter_state()[0], want_adapter, atol=1e-7)
    workers1.load_state_dict(saved)  # other workers, another world size
    assert_metrics_close(workers1.train_step(BATCHES[2]), want)
    assert_adapters_close(workers1.adapter_state()[0], want_adapter, atol=1e-5)
    fresh = inprocess_trainer(cfg)  # a fresh optimizer without state
    fresh.load_state_dict(saved)
    assert_metrics_close(fresh.train_step(BATCHES[2]), want)
    assert_adapters_close(adapter_state(fresh.model)[0], want_adapter, atol=1e-5)


@spawn
def test_each_rank_writes_its_own_checkpoint_part_and_any_world_size_resumes_it(
    tmp_path, cfg, initial_state, workers1, workers2
):
    """`save_checkpoint`: each of two ranks snapshots its part and uploads it itself while the next step
    trains; the parts load whole (the gathered state, to the bit) and resume on one rank."""
    workers2.load_state_dict(initial_state)
    workers2.train_step(BATCHES[0])
    gathered = workers2.state_dict()
    store = CheckpointStore(f"file://{tmp_path}")
    workers2.save_checkpoint(CheckpointTarget(f"file://{tmp_path}", "parts", 1))
    want = workers2.train_step(BATCHES[1])  # trains while the parts upload: the snapshot is of before it
    reports = workers2.written_checkpoints(wait=True)
    assert sorted((r.step, r.rank, r.error) for r in reports) == [(1, 0, None), (1, 1, None)]
    files = {name: entry for r in reports for name, entry in r.files.items()}
    assert sorted(files) == [f"rank-0000{r}.{ext}" for r in (0, 1) for ext in ("json", "safetensors")]
    assert workers2.written_checkpoints() == []  # each write is reported once
    store.save("parts", 1, {"trainer": SHARDED}, shards=files)
    loaded = store.load("parts", 1)["trainer"]
    assert loaded["meta"] == json.loads(json.dumps(gathered["meta"]))
    assert loaded["tensors"].keys() == gathered["tensors"].keys()
    assert all(torch.equal(loaded["tensors"][k], v) for k, v in gathered["tensors"].items())
    workers1.load_state_dict(loaded)
    assert_metrics_close(workers1.train_step(BATCHES[1]), want)


@spawn
def test_checkpoints_move_between_one_two_and_four_ranks(cfg, initial_state, workers1, workers2):
    """A checkpoint written by N ranks resumes on M (N, M in 1, 2, 4): 2 -> 4 and 4 -> 1 give the step and the
    adapter of the ranks that wrote it."""
    workers2.load_state_dict(initial_state)
    workers2.train_step(BATCHES[0])
    by_two = workers2.state_dict()
    want = workers2.train_step(BATCHES[1])
    want_adapter = workers2.adapter_state()[0]
    with TrainerWorkers(ranks(cfg, 4), timeout_s=180) as workers4:
        workers4.load_state_dict(by_two)
        assert_metrics_close(workers4.train_step(BATCHES[1]), want)
        assert_adapters_close(workers4.adapter_state()[0], want_adapter, atol=1e-5)
        by_four = workers4.state_dict()
        assert by_four["meta"]["world_size"] == 4
        want = workers4.train_step(BATCHES[2])  # 5 rows over 4 ranks: unequal shares, padded with dummy passes
    workers1.load_state_dict(by_four)
    assert_metrics_close(workers1.train_step(BATCHES[2]), want)


@spawn
def test_killed_worker_fails_the_next_call_and_close_is_prompt(workers2):
    workers = workers2  # ended here: runs after the other tests that share it
    os.kill(workers.pids[1], signal.SIGTERM)
    start = time.monotonic()
    with pytest.raises(TrainerWorkerError, match="rank 1"):
        workers.train_step(BATCHES[0])
    assert time.monotonic() - start < 15
    start = time.monotonic()
    workers.close()
    assert time.monotonic() - start < 2
    assert not any(p.is_alive() for p in workers._procs)
    with pytest.raises(TrainerWorkerError, match="closed"):
        workers.train_step(BATCHES[0])


@spawn
def test_worker_start_failure_is_reported(tmp_path, tiny_model_dir):
    cfg = make_config(tiny_model_dir, name_or_path=str(tmp_path / "no-such-model"))
    start = time.monotonic()
    with pytest.raises(TrainerWorkerError, match="(?s)rank 0 failed in 'start'.*ModelError"):
        TrainerWorkers(ranks(cfg, 1), start_timeout_s=60)
    assert time.monotonic() - start < 60


def test_an_in_process_trainers_snapshots_are_copies_that_training_does_not_change(cfg):
    """`state_dict` and `adapter_state` of an in-process trainer are CPU copies: the gathers give the live
    tensors (a rank packs them straight into shared memory), so the copy is theirs; a checkpoint taken before a
    step must still hold the weights and moments of before it while the writer stores it."""
    trainer = inprocess_trainer(cfg)
    trainer.train_step(BATCHES[0])  # AdamW moments exist
    state, (adapter, _) = trainer.state_dict(), trainer.adapter_state()
    before = {k: v.clone() for k, v in state["tensors"].items()}
    adapter_before = {k: v.clone() for k, v in adapter.items()}
    assert all(t.device.type == "cpu" for t in [*state["tensors"].values(), *adapter.values()])
    trainer.train_step(BATCHES[1])
    moved = [k for k, v in trainer.gather_state_dict()["tensors"].items() if not torch.equal(v.cpu(), before[k])]
    assert any(k.startswith("params/") for k in moved) and any(k.endswith("/exp_avg") for k in moved)
    assert all(torch.equal(state["tensors"][k], v) for k, v in before.items())
    assert all(torch.equal(adapter[k], v) for k, v in adapter_before.items())


def test_packed_tensors_cross_a_pipe_as_own_copies_and_leave_no_shared_memory_file(tmp_path):
    """A rank's tensors cross as one shared-memory buffer per dtype; the parent gets copies that safetensors
    saves and that later writes to the buffer do not change; /dev/shm keeps no file (unlinked at once)."""
    import torch.multiprocessing as mp
    from safetensors.torch import load_file, save_file

    from lora_rl_core.trainer.workers import PackedTensors

    tensors = {
        "w": torch.randn(3, 4),
        "step": torch.tensor(7.0),
        "rng": torch.arange(10, dtype=torch.uint8),
        "v": torch.randn(5, dtype=torch.float64),
    }
    shm_before = set(os.listdir("/dev/shm"))
    parent, child = mp.get_context("spawn").Pipe()
    packed = PackedTensors.pack(tensors)
    assert sorted(packed.buffers) == ["float32", "float64", "uint8"]  # one buffer per dtype, not per tensor
    child.send(packed)
    got = parent.recv().unpack()
    for name, t in tensors.items():
        assert got[name].dtype == t.dtype and got[name].shape == t.shape and torch.equal(got[name], t)
    packed.buffers["float32"].zero_()
    assert torch.equal(got["w"], tensors["w"])  # its own storage
    save_file(got, tmp_path / "state.safetensors")  # no tensors sharing memory
    assert torch.equal(load_file(tmp_path / "state.safetensors")["rng"], tensors["rng"])
    assert set(os.listdir("/dev/shm")) <= shm_before


def test_packed_tensors_travel_as_bytes_where_shared_memory_has_no_room(monkeypatch):
    """A container's /dev/shm is often 64 MB and writing past a full one kills the process (SIGBUS): tensors
    that do not fit go as safetensors bytes, and arrive the same."""
    import lora_rl_core.trainer.workers as workers

    monkeypatch.setattr(workers, "shared_memory_room", lambda margin=0.5: 100)  # bytes
    tensors = {"w": torch.randn(8, 8), "rng": torch.arange(4, dtype=torch.uint8)}
    packed = workers.PackedTensors.pack(tensors)
    assert packed.blob is not None and not packed.buffers
    got = packed.unpack()
    assert all(torch.equal(got[k], v) for k, v in tensors.items())
    small = workers.PackedTensors.pack({"rng": tensors["rng"]})  # 4 bytes: room enough
    assert small.blob is None and torch.equal(small.unpack()["rng"], tensors["rng"])


def test_summed_gradients_leave_a_parameter_no_rank_trained_without_one():
    """As in one process (where AdamW then skips it, weight decay included): a parameter no rank has a gradient
    for keeps `grad None`; the others are summed (one rank here: unchanged)."""
    from lora_rl_core import distributed

    distributed.init_process_group("cpu", rank=0, world_size=1, port=distributed.free_port())
    try:
        used, unused = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))
        (used * 2).sum().backward()
        distributed.sum_gradients([used, unused])
        assert unused.grad is None and torch.equal(used.grad, torch.full((3,), 2.0))
    finally:
        distributed.destroy_process_group()


def test_a_checkpoint_part_is_a_shard_in_its_place_or_a_whole_tensor_of_its_owner_rank():
    """`local_part`: a DTensor shard goes with its offset whichever rank owns whole tensors; a replicated or
    plain tensor (the LoRA weights) only from its owner rank."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from lora_rl_core import distributed

    distributed.init_process_group("cpu", rank=0, world_size=1, port=distributed.free_port())
    try:
        mesh = init_device_mesh("cpu", (1,))
        full = torch.arange(12.0).view(4, 3)
        part = distributed.local_part(distribute_tensor(full, mesh, [Shard(0)]), rank=0, owner=1)
        assert part is not None and torch.equal(part[0], full) and part[1:] == ([4, 3], [0, 0])
        assert distributed.local_part(distribute_tensor(full, mesh, [Replicate()]), rank=0, owner=1) is None
        assert distributed.local_part(full, rank=0, owner=1) is None
        whole = distributed.local_part(full, rank=1, owner=1)
        assert whole is not None and whole[0] is full and whole[1:] == ([4, 3], [0, 0])
    finally:
        distributed.destroy_process_group()


@spawn
def test_whole_weights_on_every_rank_train_as_one_process_and_checkpoints_move_to_sharded_ranks(
    cfg, initial_state, workers2
):
    """`shard_weights: false` (data parallel: no FSDP2, only the LoRA gradients summed) makes the same updates as
    one process, and its checkpoint resumes on FSDP2-sharded ranks."""
    reference = inprocess_trainer(cfg)
    plan = dataclasses.replace(ranks(cfg, 2), shard_weights=False)
    with TrainerWorkers(plan, timeout_s=120) as whole:
        whole.load_state_dict(initial_state)
        for batch in BATCHES:
            assert_metrics_close(whole.train_step(batch), reference.train_step(batch))
        got, _ = whole.adapter_state()
        assert_adapters_close(got, adapter_state(reference.model)[0], atol=1e-5)
        saved = whole.state_dict()
    workers2.load_state_dict(saved)
    assert_metrics_close(workers2.train_step(BATCHES[0]), reference.train_step(BATCHES[0]))
