"""One process of the train-step A/B (README.md here): the default job's run built without Prefect, version 0
published and synced, two rollouts, then three train steps on the first step's 64 scored rows (every group
kept). Prints one RESULT line: rollout seconds, train-step seconds, peak RSS. Run it from the root of the
tree to time, alternating trees:

    PYTHONPATH=. /path/to/.venv/bin/python benchmarks/results/cpu-logprobs/train_step_ab.py

With AB_MALLOPT=1 it calls `runtime.configure_allocator()` first (for a tree whose trainer does not)."""

import os
import resource
import tempfile
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
if os.environ.get("AB_MALLOPT") == "1":
    from lora_rl_core.runtime import configure_allocator

    print("mallopt", configure_allocator())

from lora_rl_core.config import load_config  # noqa: E402
from lora_rl_core.records import BatchRules, ScoredBatch, TrainBatch  # noqa: E402
from lora_rl_core.run import open_run, phases, versions  # noqa: E402

tmp = tempfile.mkdtemp(prefix="train-ab-")
overrides = [f"run.output_dir={tmp}", f"store.uri=file://{tmp}/store", "algorithm.skip_uniform_groups=false"]
run = open_run(load_config("configs/smollm2-arith-grpo.yaml", overrides), "train-ab")
try:
    versions.sync(run, versions.publish(run, 0))
    rollout_s = []
    for step in (1, 2):
        start = time.perf_counter()
        phases.rollout(run, step)
        rollout_s.append(time.perf_counter() - start)
    phases.score(run, 1)
    rows = run.run_dir.read_phase("scored", 1, ScoredBatch).rows
    batch = TrainBatch.from_scored(
        rows,
        step=1,
        rules=BatchRules(max_staleness=0, skip_uniform=False, mask_truncated=False, critic_sees_truncated=False),
    )
    train_s = []
    for _ in range(3):
        start = time.perf_counter()
        run.trainer.train_step(batch)
        train_s.append(time.perf_counter() - start)
    rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
    print(
        "RESULT",
        "rollout",
        [round(x, 2) for x in rollout_s],
        "train",
        [round(x, 2) for x in train_s],
        "rss_MiB",
        rss_mib,
    )
finally:
    run.close()
