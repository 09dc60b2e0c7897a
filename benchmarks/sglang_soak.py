"""Soak: one SGLang server followed for minutes through `lora-rl serve`'s engine server in front of it, with
at most `--keep` adapter versions resident; prints a table and writes `benchmarks/results/sglang-real/soak_*.json`.

What runs (docs/HOTSWAP.md, "Bounded residency on SGLang"):

* SGLang is launched once (`_sglang.launch_small_sglang`: eager, small memory fraction, LoRA on q/v) and runs
  throughout; `--fake` uses the SGLang look-alike in a thread instead (`lora_rl_testing.sglang_fake`: CPU, it
  keeps SGLang 0.5.17's adapter reference counts and records each unload that would wait forever).
* The front door: `lora-rl serve engine.type=sglang engine.urls=[URL]` in its own process (`--front-door
  process`, the default with SGLang: our engine server over our SGLang client, `HTTPEngine` dialect SGLANG,
  `abort="detach"`, `retire="unload"`), on 127.0.0.1. `--front-door thread` (the default with `--fake`) runs
  the same server in a thread of the benchmark instead: there the benchmark's 32 client threads and the
  server share one interpreter lock, which on the H200 held each swap's control calls to ~0.85 s.
* The clients misbehave as real ones do, against the front door: `lora_rl_testing.stress.run_hotswap_stress`
  with `samples="n"` (each group is one `/generate` with SGLang's `n`), aborts by rid and pauses in all three
  modes. Its swapper loads a fresh random version (tensors) for `--duration` seconds (the run passes only
  with at least `--swaps` of them); before each load it retires versions beyond `keep - 1`, draining the ones in use
  (`bounded=True`, what `lora-rl subscribe` does), so SGLang should never hold more than `keep` versions.
* A sampler asks SGLang itself (`/v1/models`, not the front door) every `--sample-every` seconds how many
  adapters it holds: `max_resident_versions`.
* At the end every version left is unloaded through the front door, each within `--final-unload-timeout`.

Keys of the JSON: `swaps`, `clients`, `n`, `duration_s`, `hangs` (threads alive at the deadline + calls past
their deadline + final unloads that did not answer in time), `lost`, `mixed` (groups whose samples came from
different versions), `resident_limit`, `max_resident_versions`, `p50_ms`, `p99_ms` (group latency), `gpu`,
`ok`, the stress report (`stress`, with `swap_phase_p50_s`: where a swap's time goes), the client's counters
(`client`: the in-thread client's; empty with `--front-door process`), the resident samples, the server's
facts and its command.

Usage (GPU host; docs/SGLANG.md, "GPU host")::

    PYTHONPATH=/tmp/ours:. python3 benchmarks/sglang_soak.py --model-dir /tmp/models/smollm2-random \
        --sglang-pythonpath /tmp/sglsite --duration 482 --swaps 1000 --grace 15 \
        --out benchmarks/results/sglang-real/soak_h200.json
    PYTHONPATH=. python benchmarks/sglang_soak.py --fake --duration 20 --swaps 20   # CPU smoke run
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import _common
from _common import RESULTS, machine_info, print_table, write_json
from _sglang import front_door, group_rss_mb, launch_small_sglang, listed_adapters

from lora_rl_core.engines.remote import SGLANG, HTTPEngine
from lora_rl_core.engines.serve.app import EngineServer
from lora_rl_testing.adapters import random_lora_factory
from lora_rl_testing.servers import serve_app_in_thread
from lora_rl_testing.stress import StressReport, run_hotswap_stress

RUN = "soak"


class ResidentSampler:
    """Counts the adapters the server lists every `every_s` seconds on a thread (`/v1/models`)."""

    def __init__(self, url: str, every_s: float) -> None:
        self.url, self.every_s = url, every_s
        self.samples: list[tuple[float, int | None]] = []  # (seconds since start, adapters listed; None: no answer)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="soak-sampler", daemon=True)
        self._start = time.monotonic()

    def __enter__(self) -> ResidentSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=15)

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            listed = listed_adapters(self.url, timeout_s=max(self.every_s, 5.0))
            self.samples.append((round(time.monotonic() - self._start, 1), None if listed is None else len(listed)))

    def max(self) -> int:
        """The most adapters seen at once (-1 before any answer)."""
        return max((n for _, n in self.samples if n is not None), default=-1)

    def unanswered(self) -> int:
        """Samples the server did not answer."""
        return sum(1 for _, n in self.samples if n is None)


@contextlib.contextmanager
def sglang_server(args: argparse.Namespace) -> Iterator[tuple[str, dict[str, Any], Any]]:
    """Yield (URL, facts, model for adapter shapes) of the SGLang server (launched) or its look-alike (`--fake`)."""
    import torch
    from transformers import AutoModelForCausalLM

    if args.fake:
        from _common import TINY_CONFIG, random_model, stub_tokenizer

        from lora_rl_core.engines import EmbeddedEngine
        from lora_rl_testing.sglang_fake import SGLangFakeServer

        model = random_model(TINY_CONFIG, device="cpu", dtype=torch.float32)
        with EmbeddedEngine(model, stub_tokenizer(TINY_CONFIG), max_batch_size=32) as backend:
            fake = SGLangFakeServer(backend, served_model_name="fake-sglang", unload_wait_s=10.0)
            with serve_app_in_thread(fake.app()) as url:
                facts: dict[str, Any] = {"server": "SGLang look-alike (lora_rl_testing.sglang_fake)"}
                yield url, facts, model
                facts["hung_unloads"] = fake.hung_unloads
                facts["reference_counts_left"] = {k: v for k, v in fake.refs.items() if v}
        return
    if args.model_dir is None:
        raise SystemExit("give --model-dir (an HF model folder with its tokenizer), or --fake")
    shapes = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)
    log = Path(tempfile.mkdtemp(prefix="soak-sglang-")) / "server.log"
    server = launch_small_sglang(
        args.model_dir, log, rank=args.rank, port=args.sglang_port, python=args.sglang_python,
        pythonpath=args.sglang_pythonpath,
    )  # fmt: skip
    facts = {"server": "SGLang", "argv": server.argv, "rss_mb_at_start": group_rss_mb(server.pid)}
    try:
        yield server.url, facts, shapes
        facts["rss_mb_at_end"] = group_rss_mb(server.pid)
    finally:
        print("server log tail:\n" + server.log_tail(40), flush=True)
        server.stop()


def soak(args: argparse.Namespace) -> dict[str, Any]:
    """Run the soak; returns the JSON record."""
    from transformers import AutoConfig

    with sglang_server(args) as (url, facts, model):
        vocab = model.config.vocab_size if args.fake else AutoConfig.from_pretrained(args.model_dir).vocab_size
        make_adapter = random_lora_factory(model, rank=args.rank)
        with contextlib.ExitStack() as stack:
            front, client = stack.enter_context(_front_door(args, url))
            sampler = stack.enter_context(ResidentSampler(url, args.sample_every))
            report = run_hotswap_stress(
                front, make_adapter, swaps=args.swaps, clients=args.clients, n=args.n,
                deadline_s=args.duration + args.grace, abort_prob=args.abort_prob, pause_prob=args.pause_prob,
                seed=args.seed, vocab_size=vocab, run_id=RUN, samples="n", keep=args.keep, bounded=True,
                duration_s=args.duration, request_timeout_s=args.request_timeout, control_timeout_s=60.0,
            )  # fmt: skip
            final = unload_all(front, args.final_unload_timeout)
            client_counts = client.metrics() if client is not None else {}  # the process's are its own
        facts["adapters_listed_at_end"] = listed_adapters(url)
    client_counts.pop("adapters", None)  # per-adapter counts: a thousand names
    facts["front_door"] = args.front_door
    return record(args, report, sampler, final, client_counts, facts)


@contextlib.contextmanager
def _front_door(args: argparse.Namespace, url: str) -> Iterator[tuple[str, HTTPEngine | None]]:
    """Our engine server in front of SGLang at `url`: `lora-rl serve` in its own process (`--front-door
    process`), or `EngineServer` over an `HTTPEngine` in a thread of this one (`thread`: the look-alike's
    default, and the client's counters are read directly). Yields (its URL, the in-thread client or None)."""
    transport = "inline" if args.fake else args.tensor_transport
    if args.front_door == "process":
        overrides = [f"engine.timeout_s={args.request_timeout}", f"engine.tensor_transport={transport}"]
        log = Path(tempfile.mkdtemp(prefix="soak-front-door-")) / "front-door.log"
        with front_door(url, args.model_dir, log, port=args.front_port, overrides=overrides) as front:
            yield front, None
        return
    timeouts = {"timeout_s": args.request_timeout, "control_timeout_s": 60.0}
    with (
        HTTPEngine(SGLANG, url, **timeouts, tensor_transport=transport, abort="detach", retire="unload") as client,
        serve_app_in_thread(
            EngineServer(client, served_model_name="soak", request_timeout_s=args.request_timeout).app()
        ) as front,
    ):
        yield front, client


def unload_all(front: str, timeout_s: float) -> dict[str, Any]:
    """Unload every adapter the front door lists, one by one; how long each took and which did not answer."""
    import httpx

    seconds, failed = [], []
    for name in listed_adapters(front) or []:
        start = time.monotonic()
        try:
            answer = httpx.post(f"{front}/unload_lora_adapter", json={"lora_name": name}, timeout=timeout_s).json()
            ok = answer.get("success") is True
        except httpx.HTTPError:
            ok = False
        seconds.append(round(time.monotonic() - start, 3))
        if not ok:
            failed.append(name)
    return {"unloaded": len(seconds) - len(failed), "failed": failed, "seconds": seconds}


def record(
    args: argparse.Namespace,
    report: StressReport,
    sampler: ResidentSampler,
    final: dict[str, Any],
    client: dict[str, Any],
    facts: dict[str, Any],
) -> dict[str, Any]:
    """The JSON record: the issue's keys first, then the details."""
    stress = report.as_dict()
    hangs = report.hangs + report.late_calls + len(final["failed"]) + len(facts.get("hung_unloads", []))
    resident_ok = 0 <= sampler.max() <= args.keep and sampler.unanswered() == 0
    out: dict[str, Any] = {
        "benchmark": "sglang_soak",
        "swaps": report.swaps,
        "clients": args.clients,
        "n": args.n,
        "duration_s": round(report.wall_s, 1),
        "hangs": hangs,
        "lost": report.lost,
        "mixed": report.mixed_groups,
        "resident_limit": args.keep,
        "max_resident_versions": sampler.max(),
        "p50_ms": round(1000 * report.latency_p50_s, 1),
        "p99_ms": round(1000 * report.latency_p99_s, 1),
        "gpu": None if args.fake else machine_info("cuda")["device_name"],
    }
    out["ok"] = bool(report.ok and hangs == 0 and resident_ok and report.swaps >= args.swaps)
    out["resident_samples"] = {"count": len(sampler.samples), "unanswered": sampler.unanswered()}
    out["resident_histogram"] = _histogram([n for _, n in sampler.samples if n is not None])
    out.update(final_unloads=final, client=client, server=facts, stress=stress)
    out["settings"] = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    out["machine"] = machine_info("cpu" if args.fake else "cuda")
    return out


def _histogram(values: list[int]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for v in sorted(values):
        counts[str(v)] = counts.get(str(v), 0) + 1
    return counts


def main() -> int:
    """Parse arguments, soak, print the table, write the JSON; 1 when it did not pass."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--swaps", type=int, default=1000, help="versions loaded: at least this many to pass")
    parser.add_argument("--duration", type=float, default=482.0, help="seconds of swaps under traffic")
    parser.add_argument("--grace", type=float, default=60.0, help="seconds past --duration before threads are hangs")
    parser.add_argument("--keep", type=int, default=4, help="versions resident at most (the subscriber's keep)")
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--abort-prob", type=float, default=0.1)
    parser.add_argument("--pause-prob", type=float, default=0.1, help="per 0.1 s tick")
    parser.add_argument("--request-timeout", type=float, default=60.0, help="the front door's /generate deadline (s)")
    parser.add_argument("--sample-every", type=float, default=1.0, help="seconds between residency samples")
    parser.add_argument("--final-unload-timeout", type=float, default=30.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rank", type=int, default=2)
    parser.add_argument("--fake", action="store_true", help="the SGLang look-alike on the CPU instead of SGLang")
    parser.add_argument("--model-dir", type=Path, default=None, help="SGLang's model folder")
    parser.add_argument("--sglang-python", default=None, help="SGLang's interpreter (default: this one)")
    parser.add_argument("--sglang-pythonpath", default=None, help="SGLang's PYTHONPATH")
    parser.add_argument("--sglang-port", type=int, default=30001)
    parser.add_argument("--tensor-transport", default="auto", help="ipc | inline | auto (the front door's loads)")
    parser.add_argument(
        "--front-door", choices=("process", "thread"), default=None,
        help="lora-rl serve in its own process, or our server in a thread here (default: process; thread with --fake)",
    )  # fmt: skip
    parser.add_argument("--front-port", type=int, default=30002, help="the front door's port (process)")
    parser.add_argument("--out", type=Path, default=RESULTS / "sglang-real" / "soak.json")
    args = parser.parse_args()
    args.front_door = args.front_door or ("thread" if args.fake else "process")
    if args.front_door == "process" and args.model_dir is None:
        parser.error("--front-door process needs --model-dir (the front door reads its tokenizer)")
    _common.resolve_device("cpu")
    result = soak(args)
    keys = ("swaps", "clients", "n", "duration_s", "hangs", "lost", "mixed", "resident_limit")
    keys += ("max_resident_versions", "p50_ms", "p99_ms", "gpu", "ok")
    stress = result["stress"]
    rows = [[k, result[k]] for k in keys]
    rows += [[k, stress[k]] for k in ("groups", "completed", "aborted", "rejected", "retired", "pauses")]
    rows += [[k, v] for k, v in stress.items() if k in StressReport.VIOLATIONS and v]
    print_table(f"SGLang soak through the front door (keep={args.keep})", ["key", "value"], rows)
    for example in stress.get("examples", [])[:8]:
        print(example)
    write_json(result, args.out)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
