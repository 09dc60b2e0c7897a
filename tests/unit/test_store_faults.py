"""Store faults: transient errors are retried, permanent ones fail cleanly, a killed writer leaves nothing visible.

Faults are injected by ``FlakyFS``, an fsspec wrapper whose chosen methods raise
(botocore-style 503 SlowDown, connection resets, timeouts, 403) for their first
N calls. The kill test runs a publish in a subprocess that stops half-way
through the weights upload, SIGKILLs it while this process polls the store, and
checks that no reader ever saw the partial version.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import fsspec
import pytest
import torch
from botocore.exceptions import ClientError, EndpointConnectionError
from s3fs.errors import translate_boto_error

from lora_rl_core.errors import StoreError
from lora_rl_core.store import AdapterStore, RetryPolicy, is_transient
from tests.support import processes
from tests.support.store_adapters import SMALL_CONFIG, SMALL_KEY, small_lora

REPO = Path(__file__).resolve().parents[2]
FAST = RetryPolicy(attempts=4, base_delay_s=0.001, max_delay_s=0.005)


def client_error(code: str, status: int, op: str = "PutObject") -> ClientError:
    """A botocore ClientError as S3 returns it."""
    return ClientError(
        {"Error": {"Code": code, "Message": f"{code} injected"}, "ResponseMetadata": {"HTTPStatusCode": status}}, op
    )


class FlakyFS:
    """Wrap an fsspec filesystem; the first ``failures`` calls of ``methods`` (on paths containing ``match``) raise.

    Args:
        inner: the real filesystem.
        methods: method names to break, e.g. ``{"pipe_file"}``.
        failures: how many calls fail before the filesystem heals.
        error: builds the exception to raise.
        match: only calls whose path contains this substring fail.
        land_first: perform the call before raising (the request succeeded, the response was lost).
    """

    def __init__(
        self,
        inner,
        *,
        methods: set[str],
        failures: int,
        error: Callable[[], BaseException],
        match: str = "",
        land_first: bool = False,
    ):
        self.inner, self.methods, self.failures, self.error = inner, methods, failures, error
        self.match, self.land_first, self.injected = match, land_first, []

    def __getattr__(self, name: str):
        attr = getattr(self.inner, name)
        if name not in self.methods:
            return attr

        def flaky(*args, **kwargs):
            """The wrapped method, failing while failures remain."""
            path = str(args[0]) if args else ""
            if self.failures > 0 and self.match in path:
                self.failures -= 1
                self.injected.append((name, path))
                if self.land_first:
                    attr(*args, **kwargs)
                raise self.error()
            return attr(*args, **kwargs)

        return flaky


def flaky_store(root: str, **kwargs) -> tuple[AdapterStore, FlakyFS]:
    """A store at ``root`` over a FlakyFS(memory, **kwargs), with millisecond retries."""
    fs = FlakyFS(fsspec.filesystem("memory"), **kwargs)
    return AdapterStore(root, fs=fs, retry=FAST), fs


def publish(store: AdapterStore, version: int, seed: int = 0):
    """Publish ``small_lora(seed)`` as r1@version."""
    return store.publish(
        "r1", version, tensors=small_lora(seed), adapter_config=SMALL_CONFIG, step=version, base_model="tiny"
    )


# ----------------------------------------------------------------- classification


@pytest.mark.parametrize(
    ("exc", "transient"),
    [
        (client_error("SlowDown", 503), True),
        (client_error("InternalError", 500), True),
        (client_error("ThrottlingException", 400), True),
        (client_error("TooManyRequests", 429), True),
        (client_error("ConditionalRequestConflict", 409), True),
        (
            translate_boto_error(client_error("SlowDown", 503)),
            True,
        ),  # as s3fs raises it: OSError(EBUSY) from ClientError
        (translate_boto_error(client_error("ServiceUnavailable", 503)), True),
        (ConnectionResetError("reset by peer"), True),
        (TimeoutError("read timed out"), True),
        (EndpointConnectionError(endpoint_url="http://127.0.0.1:1"), True),
        (OSError(errno.EBUSY, "busy"), True),
        (client_error("AccessDenied", 403), False),
        (translate_boto_error(client_error("AccessDenied", 403)), False),  # PermissionError
        (translate_boto_error(client_error("NoSuchBucket", 404)), False),  # FileNotFoundError
        (client_error("InvalidArgument", 400), False),
        (ValueError("bad"), False),
    ],
)
def test_is_transient(exc, transient):
    assert is_transient(exc) is transient


def test_backoff_grows_and_is_capped():
    policy = RetryPolicy(attempts=6, base_delay_s=0.1, max_delay_s=0.5)
    delays = [policy.delay(i) for i in range(1, 7)]
    assert 0.05 <= delays[0] <= 0.1 and 0.2 <= delays[2] <= 0.4 and all(d <= 0.5 for d in delays)


# ----------------------------------------------------------------- transient faults


@pytest.mark.parametrize(
    "error",
    [
        lambda: translate_boto_error(client_error("SlowDown", 503)),
        lambda: client_error("InternalError", 500),
        lambda: ConnectionResetError("connection reset by peer"),
        lambda: TimeoutError("read timed out"),
    ],
)
def test_transient_write_errors_are_retried(memory_root, error):
    store, fs = flaky_store(memory_root, methods={"pipe_file"}, failures=3, error=error)
    ref = publish(store, 1)
    assert len(fs.injected) == 3
    assert store.versions("r1") == [1] and store.load_tensors("r1", 1)[0].keys() == small_lora().keys()
    assert ref.sha256 == store.manifest("r1", 1).files["adapter_model.safetensors"].sha256


@pytest.mark.parametrize("method", ["find", "info", "cat_file"])
def test_transient_read_and_list_errors_are_retried(memory_root, method):
    publish(AdapterStore(memory_root), 1)
    store, fs = flaky_store(memory_root, methods={method}, failures=3, error=lambda: TimeoutError("slow"))
    tensors, _ = store.load_tensors("r1", store.latest("r1").version)
    assert len(fs.injected) == 3
    key = SMALL_KEY.format(0, "q_proj", "A")
    assert torch.equal(tensors[key], small_lora()[key])


def test_manifest_create_that_landed_but_lost_its_response_counts_as_won(memory_root):
    store, fs = flaky_store(
        memory_root,
        methods={"pipe_file"},
        failures=1,
        match="manifest.json",
        land_first=True,
        error=lambda: TimeoutError("no reply"),
    )
    ref = publish(store, 1)
    assert fs.injected and store.ref("r1", 1) == ref


def test_exhausted_retries_fail_cleanly_then_a_retry_succeeds(memory_root):
    store, fs = flaky_store(memory_root, methods={"pipe_file"}, failures=4, error=lambda: client_error("SlowDown", 503))
    with pytest.raises(
        StoreError, match=r"write memory://.*adapter_model.safetensors failed after 4 attempts: ClientError.*SlowDown"
    ):
        publish(store, 1)
    assert store.versions("r1") == []
    fs_files = fsspec.filesystem("memory").find(fsspec.core.url_to_fs(memory_root)[1])
    assert not any("/adapters/" in f for f in fs_files), fs_files  # the attempt's files were removed
    assert publish(store, 1).version == 1  # what a Prefect task retry does


# ----------------------------------------------------------------- permanent faults


@pytest.mark.parametrize(
    ("match", "error", "message"),
    [
        (
            "adapter_model",
            lambda: translate_boto_error(client_error("AccessDenied", 403)),
            "failed: PermissionError: AccessDenied injected",
        ),
        ("adapter_config", lambda: client_error("InvalidArgument", 400), "failed: ClientError: .*InvalidArgument"),
        (
            "manifest.json",
            lambda: translate_boto_error(client_error("AccessDenied", 403)),
            "create memory://.*manifest.json failed",
        ),
        (
            "adapter_model",
            lambda: translate_boto_error(client_error("NoSuchBucket", 404)),
            "its bucket or folder does not exist",
        ),
    ],
)
def test_permanent_errors_are_not_retried_and_leave_no_version(memory_root, match, error, message):
    store, fs = flaky_store(memory_root, methods={"pipe_file"}, failures=1, match=match, error=error)
    with pytest.raises(StoreError, match=message):
        publish(store, 1)
    assert len(fs.injected) == 1  # no retry
    assert store.versions("r1") == [] and store.latest("r1") is None
    assert not fsspec.filesystem("memory").find(fsspec.core.url_to_fs(memory_root)[1] + "/r1/adapters")
    assert publish(store, 1).version == 1


# ----------------------------------------------------------------- kill mid-upload

KILL_CHILD = """
import json, sys, time
import torch
from lora_rl_core.store import AdapterStore, MODEL_FILE

uri, options, marker, seed = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3], int(sys.argv[4])
store = AdapterStore(uri, options or None)
put = store._io.put

def half_then_hang(path, data):
    if path.endswith(MODEL_FILE):
        put(path, data[: len(data) // 2])  # half the weights are in the store, as when the upload dies
        open(marker, "w").close()
        time.sleep(120)
    put(path, data)

store._io.put = half_then_hang
gen = torch.Generator().manual_seed(seed)
tensors = {k: torch.randn(*s, generator=gen) for k, s in json.loads(sys.argv[5]).items()}
config = json.loads(sys.argv[6])
store.publish("r1", 2, tensors=tensors, adapter_config=config, step=2, base_model="tiny")
"""


def kill_mid_upload(store: AdapterStore, uri: str, options: dict, tmp_path: Path) -> None:
    """v1 is published; a child dies half-way through v2; readers never see v2; v2 then publishes cleanly."""
    v1 = small_lora(1)
    store.publish("r1", 1, tensors=v1, adapter_config=SMALL_CONFIG, step=1, base_model="tiny")
    marker = tmp_path / f"uploading-{uuid.uuid4().hex}"
    shapes = {k: list(t.shape) for k, t in small_lora().items()}
    args = [uri, json.dumps(options), str(marker), "7", json.dumps(shapes), json.dumps(SMALL_CONFIG)]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    child = processes.popen([sys.executable, "-c", KILL_CHILD, *args], env=env, cwd=REPO, stderr=subprocess.PIPE)
    seen: list[tuple[list[int], int]] = []
    try:
        deadline = time.monotonic() + 60
        while not marker.exists():
            assert child.poll() is None, child.stderr.read().decode()
            assert time.monotonic() < deadline, "the child never started uploading"
            seen.append((store.versions("r1"), store.latest("r1").version))
        for _ in range(5):  # the partial upload is in the store now
            seen.append((store.versions("r1"), store.latest("r1").version))
        os.kill(child.pid, signal.SIGKILL)
    finally:
        processes.stop(child, signal.SIGKILL)
        child.stderr.close()
    assert child.returncode == -signal.SIGKILL
    seen.append((store.versions("r1"), store.latest("r1").version))
    assert set(map(str, seen)) == {str(([1], 1))}, seen
    tensors, _ = store.load_tensors("r1", store.latest("r1").version)
    assert all(torch.equal(tensors[k], v1[k]) for k in v1)
    v2 = small_lora(2)
    store.publish("r1", 2, tensors=v2, adapter_config=SMALL_CONFIG, step=2, base_model="tiny")
    assert store.versions("r1") == [1, 2]
    tensors, _ = store.load_tensors("r1", 2)
    assert all(torch.equal(tensors[k], v2[k]) for k in v2)


@pytest.mark.slow  # a writer subprocess
def test_writer_killed_mid_upload_is_never_visible_file(tmp_path):
    uri = f"file://{tmp_path}/runs"
    kill_mid_upload(AdapterStore(uri), uri, {}, tmp_path)
    leftovers = [p for p in (tmp_path / "runs/r1/adapters/v000002").iterdir() if p.is_dir()]
    assert len(leftovers) == 2  # the killed attempt's folder and the published one; gc removes the first
