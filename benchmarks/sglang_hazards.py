"""Which request sequences make SGLang's `/unload_lora_adapter` wait forever, and that the same sequences sent
through our engine server in front of SGLang never do; prints a table and writes
`benchmarks/results/sglang-real/hazards_*.json`.

Each sequence runs on its own adapter (a random rank-2 LoRA on q/v, loaded from a folder), then that adapter is
unloaded with a deadline (`--unload-timeout`): `ok` with the seconds it took, or `hung` (no answer: SGLang's
unload unregisters the adapter, then waits without a timeout for its reference count to be exactly 0, holding
the LoRA update lock, so every later load and unload of that server waits too). The sequences (each sends
requests naming the adapter; the server runs at most `--max-running` requests at once, so the others queue):

* `single`: `--requests` requests of one sample each, all answered;
* `pause-retract`, `pause-in_place`: those requests, a pause in that mode, a resume, all answered;
* `abort-running`: one long request, aborted by rid while it decodes;
* `n4`: one `/generate` with `sampling_params.n = 4` (sglang#36894);
* `abort-queued`: `--requests` long requests, the last aborted by rid while it waits in the queue (sglang#34205);
* `pause-abort`: `--requests` long requests, a pause in `abort` mode, a resume;
* `disconnect`: `--requests` long requests whose client closes the connection after `--disconnect-after` s.

Servers (on one GPU, `--launch-parallel` starting at a time, eager, small memory fraction): one runs the
first four sequences in that order (an unload that hangs there would block the ones after it: they are
reported `blocked`), one each
for `n4`, `abort-queued`, `pause-abort` and `disconnect`, and one has our engine server in front (`EngineServer`
over `HTTPEngine` dialect SGLANG, `abort="detach"`, `retire="unload"`: what `lora-rl serve` runs in front of
SGLang) and gets every sequence through it, adapters loaded and unloaded through it too. `--fake` runs the
same against the SGLang look-alike on the CPU (which models 0.5.17's reference counts: a check of the script,
not of SGLang).

Usage (GPU host)::

    PYTHONPATH=/tmp/ours:. python3 benchmarks/sglang_hazards.py --model-dir /tmp/models/smollm2-random \
        --sglang-pythonpath /tmp/sglsite --out benchmarks/results/sglang-real/hazards_h200.json
    PYTHONPATH=. python benchmarks/sglang_hazards.py --fake     # CPU check of the script
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import _common
import httpx
from _common import RESULTS, machine_info, print_table, write_json
from _sglang import launch_small_sglang

from lora_rl_core.engines.remote import SGLANG, HTTPEngine
from lora_rl_core.engines.serve.app import EngineServer
from lora_rl_testing.adapters import random_lora_factory, write_peft_folder
from lora_rl_testing.servers import serve_app_in_thread

SAFE = ("single", "pause-retract", "pause-in_place", "abort-running")
HAZARDS = ("n4", "abort-queued", "pause-abort", "disconnect")
Sequence = Callable[[str, str, argparse.Namespace], dict[str, Any]]


# ----------------------------------------------------------------------------- the sequences


def _post(url: str, path: str, body: dict[str, Any], timeout_s: float = 60.0) -> int | str:
    """POST and return the status code, or the exception's name (a closed connection, a timeout)."""
    try:
        return httpx.post(f"{url}{path}", json=body, timeout=timeout_s).status_code
    except httpx.HTTPError as exc:
        return type(exc).__name__


def _generate(url: str, adapter: str, rid: str, *, tokens: int, n: int = 1, timeout_s: float = 120.0) -> int | str:
    sampling = {"max_new_tokens": tokens, "temperature": 1.0, "n": n}  # random weights: EOS is rare
    body = {"input_ids": [11, 12, 13, 14], "sampling_params": sampling, "lora_path": adapter, "rid": rid}
    return _post(url, "/generate", body, timeout_s)


def _many(url: str, adapter: str, args: argparse.Namespace, during: Callable[[list[str]], None], **kw: Any) -> Any:
    """`--requests` requests at once (rids `<adapter>-i`); `during(rids)` runs once they are sent; their statuses."""
    rids = [f"{adapter}-{i}" for i in range(args.requests)]
    with ThreadPoolExecutor(len(rids)) as pool:
        futures = [pool.submit(_generate, url, adapter, rid, **kw) for rid in rids]
        time.sleep(args.settle)
        during(rids)
        return [f.result() for f in futures]


def single(url: str, adapter: str, args: argparse.Namespace) -> dict[str, Any]:
    return {"statuses": _many(url, adapter, args, lambda rids: None, tokens=args.tokens)}


def pause_then_resume(mode: str) -> Sequence:
    def run(url: str, adapter: str, args: argparse.Namespace) -> dict[str, Any]:
        calls: list[Any] = []

        def pause(rids: list[str]) -> None:
            calls.append(_post(url, "/pause_generation", {"mode": mode}))
            time.sleep(args.settle)
            calls.append(_post(url, "/continue_generation", {}))

        return {"statuses": _many(url, adapter, args, pause, tokens=args.long_tokens), "control": calls}

    return run


def abort_running(url: str, adapter: str, args: argparse.Namespace) -> dict[str, Any]:
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(_generate, url, adapter, f"{adapter}-long", tokens=args.long_tokens * 4)
        time.sleep(args.settle)
        control = _post(url, "/abort_request", {"rid": f"{adapter}-long"})
        return {"statuses": [future.result()], "control": [control]}


def n4(url: str, adapter: str, args: argparse.Namespace) -> dict[str, Any]:
    return {"statuses": [_generate(url, adapter, f"{adapter}-n4", tokens=args.tokens, n=4)]}


def abort_queued(url: str, adapter: str, args: argparse.Namespace) -> dict[str, Any]:
    calls: list[Any] = []
    abort = lambda rids: calls.append(_post(url, "/abort_request", {"rid": rids[-1]}))  # noqa: E731
    return {"statuses": _many(url, adapter, args, abort, tokens=args.long_tokens), "control": calls}


def disconnect(url: str, adapter: str, args: argparse.Namespace) -> dict[str, Any]:
    statuses = _many(url, adapter, args, lambda rids: None, tokens=args.long_tokens, timeout_s=args.disconnect_after)
    time.sleep(args.settle)
    return {"statuses": statuses}


SEQUENCES: dict[str, Sequence] = {
    "single": single,
    "pause-retract": pause_then_resume("retract"),
    "pause-in_place": pause_then_resume("in_place"),
    "abort-running": abort_running,
    "n4": n4,
    "abort-queued": abort_queued,
    "pause-abort": pause_then_resume("abort"),
    "disconnect": disconnect,
}


# ----------------------------------------------------------------------------- servers and runs


def load(url: str, adapter: str, folder: Path) -> None:
    status = _post(url, "/load_lora_adapter", {"lora_name": adapter, "lora_path": str(folder)})
    if status != 200:
        raise RuntimeError(f"{url}: loading {adapter} answered {status}")


def unload(url: str, adapter: str, timeout_s: float) -> tuple[str, float]:
    """`ok` or `hung` (no answer in time; a refusal is `failed`), and the seconds waited."""
    start = time.monotonic()
    status = _post(url, "/unload_lora_adapter", {"lora_name": adapter}, timeout_s)
    seconds = round(time.monotonic() - start, 2)
    return ("ok" if status == 200 else "hung" if status == "ReadTimeout" else f"failed ({status})"), seconds


def run_on(url: str, names: list[str], via: str, folder: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Load one adapter per sequence, run the sequences in order, then unload each in order (one that hangs
    blocks the ones after it: those are `blocked`)."""
    rows = []
    for name in names:
        adapter = f"hz{len(rows)}-{name.replace('_', '-')}-v000001"
        load(url, adapter, folder)
        row: dict[str, Any] = {"sequence": name, "via": via, "adapter": adapter}
        row.update(SEQUENCES[name](url, adapter, args))
        rows.append(row)
    hung = False
    for row in rows:
        if hung:
            row["unload"], row["unload_s"] = "blocked", None
            continue
        row["unload"], row["unload_s"] = unload(url, row["adapter"], args.unload_timeout)
        hung = row["unload"] == "hung"
    return rows


@contextlib.contextmanager
def servers(args: argparse.Namespace, count: int) -> Iterator[list[str]]:
    """`count` SGLang servers, `--launch-parallel` at a time (or look-alikes with `--fake`); yields their URLs."""
    if args.fake:
        with contextlib.ExitStack() as stack:
            yield [stack.enter_context(_fake_server()) for _ in range(count)]
        return
    logs = Path(tempfile.mkdtemp(prefix="hazards-sglang-"))
    extra = ["--max-running-requests", str(args.max_running)]
    launched: list[Any] = []
    lock = threading.Lock()

    def start(i: int) -> None:
        server = launch_small_sglang(
            args.model_dir, logs / f"server-{i}.log", rank=2, port=args.port + i, python=args.sglang_python,
            pythonpath=args.sglang_pythonpath, mem_fraction=args.mem_fraction, extra_args=extra,
        )  # fmt: skip
        with lock:
            launched.append(server)

    try:
        # a few at a time: six cold starts at once (Triton compiling in each) left the GPU host unanswering
        with ThreadPoolExecutor(max(1, min(count, args.launch_parallel))) as pool:
            for future in [pool.submit(start, i) for i in range(count)]:
                future.result()
        yield [s.url for s in sorted(launched, key=lambda s: s.url)]
    finally:
        for server in launched:
            server.stop()


@contextlib.contextmanager
def _fake_server() -> Iterator[str]:
    import torch
    from _common import TINY_CONFIG, random_model, stub_tokenizer

    from lora_rl_core.engines import EmbeddedEngine
    from lora_rl_testing.sglang_fake import SGLangFakeServer

    model = random_model(TINY_CONFIG, device="cpu", dtype=torch.float32)
    with EmbeddedEngine(model, stub_tokenizer(TINY_CONFIG), max_batch_size=2) as backend:
        with serve_app_in_thread(SGLangFakeServer(backend, served_model_name="fake", unload_wait_s=60.0).app()) as url:
            yield url


def adapter_folder(args: argparse.Namespace) -> Path:
    """One random rank-2 q/v LoRA for the model, written as a PEFT folder."""
    import torch
    from _common import TINY_CONFIG, random_model
    from transformers import AutoModelForCausalLM

    if args.fake:
        model = random_model(TINY_CONFIG, device="cpu", dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)
    tensors, config = random_lora_factory(model, rank=2)(1)
    return write_peft_folder(tensors, config, Path(tempfile.mkdtemp(prefix="hazards-adapter-")))


def hazards(args: argparse.Namespace) -> list[dict[str, Any]]:
    folder = adapter_folder(args)
    rows: list[dict[str, Any]] = []
    with servers(args, 2 + len(HAZARDS)) as urls:
        safe_url, front_url, hazard_urls = urls[0], urls[1], urls[2:]
        with (
            HTTPEngine(SGLANG, front_url, timeout_s=120.0, control_timeout_s=60.0, abort="detach") as client,
            serve_app_in_thread(EngineServer(client, served_model_name="front").app()) as front,
            ThreadPoolExecutor(1 + len(HAZARDS)) as pool,
        ):
            jobs = [pool.submit(run_on, safe_url, list(SAFE), "raw", folder, args)]
            jobs += [
                pool.submit(run_on, url, [name], "raw", folder, args)
                for url, name in zip(hazard_urls, HAZARDS, strict=True)
            ]
            ours = run_on(front, [*SAFE, *HAZARDS], "our server in front", folder, args)
            for job in jobs:
                rows += job.result()
            rows += ours
    return rows


def main() -> int:
    """Parse arguments, run, print the table, write the JSON; 1 when our server's side had an unload not ok."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fake", action="store_true", help="SGLang look-alikes on the CPU (checks the script)")
    parser.add_argument("--model-dir", type=Path, default=None)
    parser.add_argument("--sglang-python", default=None)
    parser.add_argument("--sglang-pythonpath", default=None)
    parser.add_argument("--port", type=int, default=30010, help="first server's port (the others follow)")
    parser.add_argument("--launch-parallel", type=int, default=2, help="SGLang servers starting at once")
    parser.add_argument("--mem-fraction", type=float, default=0.06, help="each server's --mem-fraction-static")
    parser.add_argument("--max-running", type=int, default=2, help="each server's --max-running-requests")
    parser.add_argument("--requests", type=int, default=6)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--long-tokens", type=int, default=256)
    parser.add_argument("--settle", type=float, default=0.5, help="seconds between sending and the abort/pause")
    parser.add_argument("--disconnect-after", type=float, default=0.5)
    parser.add_argument("--unload-timeout", type=float, default=20.0)
    parser.add_argument("--out", type=Path, default=RESULTS / "sglang-real" / "hazards.json")
    args = parser.parse_args()
    if not args.fake and args.model_dir is None:
        parser.error("give --model-dir, or --fake")
    _common.resolve_device("cpu")
    start = time.monotonic()
    rows = hazards(args)
    table = [[r["via"], r["sequence"], _counts(r["statuses"]), r["unload"], r["unload_s"]] for r in rows]
    print_table("SGLang unload after each request sequence", ["via", "sequence", "answers", "unload", "s"], table)
    ours_ok = all(r["unload"] == "ok" for r in rows if r["via"] != "raw")
    record = {
        "benchmark": "sglang_hazards",
        "server": "SGLang look-alike" if args.fake else "SGLang",
        "gpu": None if args.fake else machine_info("cuda")["device_name"],
        "ours_all_unloaded": ours_ok,
        "raw_hung": sorted(r["sequence"] for r in rows if r["via"] == "raw" and r["unload"] == "hung"),
        "rows": rows,
        "seconds": round(time.monotonic() - start, 1),
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "machine": machine_info("cpu" if args.fake else "cuda"),
    }
    write_json(record, args.out)
    return 0 if ours_ok else 1


def _counts(statuses: list[Any]) -> str:
    counts: dict[str, int] = {}
    for s in statuses:
        counts[str(s)] = counts.get(str(s), 0) + 1
    return ", ".join(f"{k} x{v}" for k, v in counts.items())


if __name__ == "__main__":
    sys.exit(main())
