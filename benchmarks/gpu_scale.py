"""Real model sizes on GPUs: the main job's step time for Qwen2.5-1.5B to -32B shapes on 1 to N GPUs (issues 22,
33).

Random weights in the published shapes (`benchmarks/model_configs/qwen2.5-<shape>.json`; speed and memory
need no trained weights), the default config plus only the model path and the batch shape (16 prompts x 8
samples x 256 new tokens), SGLang launched by the run, 10 steps through the library's step loop
(`lora_rl_core.run.loop.run_steps` over `RunPhases`, phase by phase as `benchmarks/cpu_step.py` does).
Random weights score 0 on every problem and almost never end a completion, so `algorithm.skip_uniform_groups=false`
and `algorithm.truncation=keep` make every step train on all 128 rows as a learning run would (under the
default `mask` every row, cut at the limit, would be left out of the loss).

    one GPU, trainer and SGLang colocated:   python benchmarks/gpu_scale.py --shape 7b
    N GPUs, a trainer rank and an SGLang data-parallel worker on each:   ... --gpus N --placement colocated
    N GPUs, SGLang on half, the trainer on the rest, async rollouts:     ... --gpus N --placement split
    N GPUs, `placement` left at its default (the plan chooses):         ... --gpus N --placement auto

On the offline GPU host (docs/SGLANG.md, "GPU host"): `--sglang-pythonpath /tmp/sglsite` and a tokenizer
folder `--tokenizer /tmp/models/meta` (SmolLM2's: random weights make any tokenizer right). Writes
`benchmarks/results/gpu_scale/<shape>-1gpu.json` or `<shape>-<gpus>gpu-<placement>.json` and prints a table.

Physical limit (`physical_limit_seconds`): decoding reads every bf16 weight once per new token for the whole
batch, and training runs at the GPU's dense bf16 peak:

    limit = max_new_tokens x weight_bytes / HBM bandwidth + 6 x params x trained_tokens / (peak_flops x gpus)

(trained tokens: prompt + completion of every row; on N GPUs every data-parallel SGLang worker still reads the
whole model once per new token, while training divides over the GPUs). `mfu` is `6 x params x trained_tokens /
train_seconds / (peak_flops x trainer GPUs)` (the usual 6N per token; LoRA skips the frozen weights' gradients
and checkpointing recomputes, so the GPU does about 4N-8N). Peaks: H100 SXM 989 TFLOP/s and 3.35 TB/s, H200
989 TFLOP/s and 4.8 TB/s.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout, before torch loads
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads, as the CLI does (lora_rl_core.runtime)

# isort: split
import torch  # noqa: E402
from _common import RESULTS, ROOT, machine_info, model_config, print_table, random_model, write_json  # noqa: E402
from _timeline import StepTimeline  # noqa: E402
from cpu_step import TimedPhases  # noqa: E402

PHASES = ("rollout", "score", "train", "sync", "publish")
PEAKS = {"H100": (989e12, 3.35e12), "H200": (989e12, 4.8e12)}  # dense bf16 FLOP/s, HBM bytes/s


def build_model(shape: str, tokenizer: Path, out: Path) -> Path:
    """A random-weight model folder of the shape (config + safetensors + the tokenizer's files)."""
    if (out / "config.json").exists():
        return out
    import shutil

    cfg = model_config(ROOT / "benchmarks" / "model_configs" / f"qwen2.5-{shape}.json")
    model = random_model(cfg, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.02)
    model.save_pretrained(out, safe_serialization=True)
    del model
    torch.cuda.empty_cache()
    for f in tokenizer.iterdir():
        if f.name != "config.json" and f.is_file():
            shutil.copy(f, out / f.name)
    return out


class ProfileAt:
    """The run's trainer, with its `at`-th `train_step` call run under `torch.profiler` on every rank
    (`profiled_train_step` of `PolicyTrainer` and of the sharded trainers, `RankCommands`; not on the `Trainer`
    protocol, which a run needs); `report` keeps the ranks' tables. Everything else goes to the trainer."""

    def __init__(self, trainer: Any, at: int) -> None:
        self.trainer, self.at, self.calls, self.report = trainer, at, 0, ""

    def train_step(self, batch: Any) -> dict[str, float]:
        """`train_step`, profiled at the `at`-th call."""
        self.calls += 1
        if self.calls != self.at:
            return self.trainer.train_step(batch)
        metrics, self.report = self.trainer.profiled_train_step(batch)
        return metrics

    def __getattr__(self, name: str) -> Any:
        return getattr(self.trainer, name)


class GpuMemory:
    """Samples `nvidia-smi`'s used memory of this run's GPUs (`CUDA_VISIBLE_DEVICES`, else all) twice a second
    (every process: trainer and SGLang)."""

    def __init__(self) -> None:
        self.peak: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> GpuMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")  # this run's GPUs (another run may share the host)
            out = subprocess.run(
                ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"]
                + ([f"--id={visible}"] if visible else []),
                capture_output=True,
                text=True,
            ).stdout
            used = [int(x) * 1024**2 for x in out.split()]
            self.peak = [max(a, b) for a, b in zip(self.peak, used, strict=False)] if self.peak else used
            self._stop.wait(0.5)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=["0.5b", "1.5b", "7b", "14b", "32b"], default="1.5b")
    p.add_argument("--gpus", type=int, default=1, choices=[1, 2, 4, 8])
    p.add_argument(
        "--placement",
        choices=["colocated", "split", "auto"],
        default="colocated",
        help="with --gpus > 1; auto: `placement` left at its default (the plan chooses over every visible GPU)",
    )
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--tokenizer", type=Path, default=Path("/tmp/models/meta"))
    p.add_argument("--models", type=Path, default=Path("/tmp/models"))
    p.add_argument("--sglang-pythonpath", default=None, help="PYTHONPATH of SGLang's interpreter")
    p.add_argument("--override", action="append", default=[], help="further config overrides")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument(
        "--profile-step", type=int, default=0, help="profile this step's train phase on every rank (torch.profiler)"
    )
    p.add_argument(
        "--timeline-step",
        type=int,
        default=0,
        help="put this whole step on a timeline (torch.profiler, `_timeline.py`): <out>.trace.json.gz, .timeline.txt",
    )
    p.add_argument(
        "--serialise-in-memory",
        action="store_true",
        help="serialise versions and checkpoints with safetensors `save` (holds the interpreter lock: the code "
        "before 796d3bd), for the A/B of that change",
    )
    args = p.parse_args()
    for flag, step in (("--profile-step", args.profile_step), ("--timeline-step", args.timeline_step)):
        if step and not 1 <= step <= args.steps:
            p.error(f"{flag} {step} is not one of the {args.steps} steps")
    if args.profile_step and args.profile_step == args.timeline_step:
        p.error("--profile-step and --timeline-step name the same step: one profiler at a time")
    if args.placement == "auto" and args.gpus > 1 and torch.cuda.device_count() != args.gpus:
        visible = torch.cuda.device_count()
        p.error(f"--placement auto places the run on every visible GPU: {visible} visible, not {args.gpus}")
    if args.serialise_in_memory:
        serialise_holding_the_lock()

    from cli import reaper, shutdown
    from lora_rl_core.config import load_config
    from lora_rl_core.records import RolloutBatch
    from lora_rl_core.run import open_run
    from lora_rl_core.run.loop import RunPhases, run_steps

    # as `lora-rl train` does: SIGTERM (a `timeout`) unwinds through `run.close()`, which stops SGLang, and the
    # reaper ends whatever the run started if this process is SIGKILLed (a GPU left holding a server otherwise)
    shutdown.install()
    with reaper.enabled():  # the reaper starts in this process's own command, not in a test's
        reaper.watch()

    model_dir = build_model(args.shape, args.tokenizer, args.models / f"qwen2.5-{args.shape}-random")
    work = Path(tempfile.mkdtemp(prefix="gpu-scale-"))
    env = {"PYTHONPATH": args.sglang_pythonpath} if args.sglang_pythonpath else {}
    overrides = [
        f"model.name_or_path={model_dir}",
        "rollout.prompts_per_step=16",
        "rollout.group_size=8",
        "rollout.max_new_tokens=256",
        f"trainer.steps={args.steps}",
        "engine.type=sglang",
        "engine.launch.enabled=true",
        "algorithm.skip_uniform_groups=false",
        "algorithm.truncation=keep",  # random weights never end a completion: `mask` would leave every row out
    ]
    gpus = list(range(args.gpus))
    if args.gpus == 1:  # one GPU of the machine, trainer and SGLang on it
        overrides += ["placement=manual"]
    elif args.placement == "auto":  # the config's default (no override): the plan places the run
        pass
    elif args.placement == "split":  # SGLang on the first half, the trainer on the rest, rollouts one step ahead
        overrides += [f"placement={{type: split, gpus: {gpus}}}"]  # rollout.mode auto: async there
    else:  # a trainer rank and an SGLang data-parallel worker on every GPU
        overrides += [f"placement={{type: colocated, gpus: {gpus}}}"]
    overrides += args.override
    shown = [o for o in overrides if not o.startswith("model.name_or_path")]
    plumbing = [f"run.output_dir={work}", f"store.uri=file://{work}/store", f"engine.launch.env={json.dumps(env)}"]
    cfg = load_config(None, overrides + plumbing)
    steps: list[dict[str, Any]] = []
    start = time.perf_counter()
    with GpuMemory() as memory:
        run = open_run(cfg, "gpu-scale")
        setup_s = time.perf_counter() - start
        profiled = None
        if args.profile_step:
            run.trainer = profiled = ProfileAt(run.trainer, args.profile_step)
        out = args.out or RESULTS / "gpu_scale" / f"{result_name(args)}.json"
        timeline = StepTimeline(run, args.timeline_step, out.with_suffix("")) if args.timeline_step else None
        try:
            with RunPhases(run) as inner:
                timed = TimedPhases(inner, around=timeline.phase if timeline else None)
                last = [time.perf_counter()]

                def on_step(m: dict[str, Any]) -> None:
                    now = time.perf_counter()
                    times = timed.take()
                    wall = now - last[0]
                    last[0] = now
                    rows = run.run_dir.read_phase("rollouts", m["step"], RolloutBatch).rows
                    trained = sum(len(r.prompt_ids) + len(r.completion_ids) for r in rows)
                    times["other"] = max(0.0, wall - sum(times.values()))  # async: includes waiting for rollouts
                    times["rollout"] = m["rollout_seconds"]  # generation time (async: overlapped with training)
                    if timeline is not None:
                        timeline.on_step(m["step"])  # writing the trace takes seconds: not the next step's
                        last[0] = time.perf_counter()
                    steps.append(
                        {
                            "step": m["step"],
                            # a profiled step (the profiler's own cost) is left out of the medians
                            "profiled": m["step"] in (args.profile_step, args.timeline_step),
                            "step_seconds": wall,
                            "seconds": times,
                            "completion_tokens": m["completion_tokens"],
                            # the trainer's own train_step (rank 0 inside its process): the rest of "train" is the
                            # run around it (the batch, the checkpoint's hand-over)
                            "trainer_seconds": m.get("train_seconds"),
                            # the update seen from the run (ranks: the batch there, the answers back) and the
                            # checkpoint's snapshot (its copy from the trainer or rank 0)
                            "update_seconds": m.get("update_seconds"),
                            "snapshot_seconds": m.get("snapshot_seconds"),
                            "trained_tokens": trained,
                            # padded positions the forwards computed (what padding-free packing would remove)
                            "padding_fraction": m.get("padding_fraction"),
                        }
                    )
                    print(
                        f"step {m['step']}: {wall:.2f} s { ({k: round(v, 2) for k, v in times.items()}) }", flush=True
                    )

                run_steps(timed, steps=args.steps, ahead=run.plan.rollouts_ahead(), on_step=on_step)
            plan = run.runtime.get("memory_plan")
            trainer_plan = run.plan.trainer
            assert trainer_plan is not None
            in_process = trainer_plan.world_size == 0 and trainer_plan.device.startswith("cuda")
            trainer_peak = torch.cuda.max_memory_reserved(torch.device(trainer_plan.device)) if in_process else None
            sglang_log = (run.workdir / "sglang.log").read_text(errors="replace").splitlines()
        finally:
            run.close()
    command = next((ln for ln in sglang_log if ln.startswith("[lora-rl] command:")), "")
    args.trainer_gpus = max(1, trainer_plan.world_size)  # the MFU's denominator
    record = summarize(args, steps, shown, memory.peak, model_dir)
    launch = run.plan.engine.launch
    record.update(
        placement=run.plan.choices["placement"].value,
        placement_reason=run.plan.choices["placement"].reason,
        rollout_mode=run.plan.rollout_mode,
        trainer_ranks=trainer_plan.world_size,
        sglang_dp=launch.servers if launch is not None else 1,  # servers (data parallel)
        sglang_tp=launch.tp_size if launch is not None else 1,
        setup_seconds=setup_s,
        memory_plan=plan,
        trainer_peak_reserved_gib=round(trainer_peak / 1024**3, 2) if trainer_peak is not None else None,
        trainer_kernels=run.plan.choices["trainer.liger_kernels"].reason,
        plan_choices={name: {"value": c.value, "reason": c.reason} for name, c in run.plan.choices.items()},
        sglang_command=command,
        steps=steps,
        machine=machine_info("cuda"),
    )
    record.update(serialised="in memory, holding the interpreter lock" if args.serialise_in_memory else "save_file")
    write_json(record, out)
    if timeline is not None and timeline.report:
        print(timeline.report)
    if profiled is not None and profiled.report:
        Path(str(out).removesuffix(".json") + ".train-profile.txt").write_text(profiled.report)
        print(profiled.report)
    ph = record["phases"]
    print_table(
        f"{args.shape} on {args.gpus} x {record['gpu']} ({record['placement']}): median of steps 2..{args.steps}",
        ["step s", *ph.keys(), "rollout tok/s", "train tok/s", "MFU", "peak GiB", "limit s", "ratio"],
        [
            [
                record["median_step_seconds"],
                *ph.values(),
                record["rollout_tokens_per_second"],
                record["train_tokens_per_second"],
                record["mfu"],
                record["peak_gpu_memory_gib"],
                record["physical_limit_seconds"],
                record["limit_ratio"],
            ]
        ],
    )


def summarize(
    args: argparse.Namespace, steps: list[dict[str, Any]], overrides: list[str], peak: list[int], model_dir: Path
) -> dict[str, Any]:
    """Medians over the steps after the first (which pays Triton compilation and cold caches), a profiled
    step left out."""
    timed = [s for s in steps[1:] if not s.get("profiled")] or steps[1:] or steps
    med = lambda xs: statistics.median(xs)  # noqa: E731
    phases = {k: med([s["seconds"].get(k, 0.0) for s in timed]) for k in (*PHASES, "other")}
    gpu = torch.cuda.get_device_name(0)
    flops, bandwidth = next((v for k, v in PEAKS.items() if k in gpu), PEAKS["H100"])
    params = sum(v for v in _param_count(model_dir).values())
    weight_bytes = 2 * params
    trained = med([s["trained_tokens"] for s in timed])
    limit = 256 * weight_bytes / bandwidth + 6 * params * trained / (flops * args.gpus)
    step_s = med([s["step_seconds"] for s in timed])
    train_s = phases["train"]
    return {
        "gpu": gpu,
        "gpus": args.gpus,
        "shape": f"qwen2.5-{args.shape}",
        "params": params,
        "prompts_per_step": 16,
        "group_size": 8,
        "max_new_tokens": 256,
        "overrides": overrides,
        "median_step_seconds": step_s,
        "phases": phases,
        "rollout_tokens_per_second": med([s["completion_tokens"] / s["seconds"]["rollout"] for s in timed]),
        "train_tokens_per_second": trained / train_s if train_s else None,
        "mfu": 6 * params * trained / train_s / (flops * args.trainer_gpus) if train_s else None,
        "peak_gpu_memory_gib": [round(b / 1024**3, 2) for b in peak],
        "padding_fraction": med([s["padding_fraction"] or 0.0 for s in timed]),
        "physical_limit_seconds": limit,
        "limit_ratio": step_s / limit,
    }


def result_name(args: argparse.Namespace) -> str:
    """`<shape>-1gpu` or `<shape>-<gpus>gpu-<placement>`: the JSON's default name."""
    return f"{args.shape}-1gpu" if args.gpus == 1 else f"{args.shape}-{args.gpus}gpu-{args.placement}"


def serialise_holding_the_lock() -> None:
    """Make the run serialise adapter versions and checkpoints as before 796d3bd: `safetensors.torch.save`,
    which holds the interpreter lock while it copies every tensor into one buffer (the same bytes as today's
    `save_file` through a temporary file: `lora_rl_core.adapters.io.safetensors_bytes`)."""
    import importlib

    from safetensors.torch import save

    from lora_rl_core.adapters import io

    def in_memory(tensors: dict[str, torch.Tensor], metadata: Any = io.PT_METADATA) -> bytes:
        cpu = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
        return save(cpu, metadata=None if metadata is None else dict(metadata))

    users = ("checkpoint", "store.publish", "run.state", "engines.remote.transport", "trainer.workers", "adapters")
    original = io.safetensors_bytes
    for module in [io, *(importlib.import_module(f"lora_rl_core.{name}") for name in users)]:
        if getattr(module, "safetensors_bytes", None) is original:
            module.safetensors_bytes = in_memory  # type: ignore[attr-defined]


def _param_count(model_dir: Path) -> dict[str, int]:
    """Elements of every tensor in the model folder's safetensors files (read from their headers)."""
    from safetensors import safe_open

    counts: dict[str, int] = {}
    for f in model_dir.glob("*.safetensors"):
        with safe_open(f, "pt") as st:
            for k in st.keys():  # noqa: SIM118 - safe_open is not a dict
                n = 1
                for d in st.get_slice(k).get_shape():
                    n *= d
                counts[k] = n
    return counts


if __name__ == "__main__":
    main()
