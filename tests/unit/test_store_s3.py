"""AdapterStore on S3 through s3fs, against moto's S3 server on 127.0.0.1 (as s3fs's own tests do).

One server per module; each test gets its own prefix in one bucket. Covers the
S3 paths of publish / list / pull, the conditional manifest create behind
racing writers, corrupted and truncated objects, a writer killed mid-upload,
injected 503 / 403 faults on the real client, tags and gc, and the CLI with
the endpoint taken from the standard ``AWS_ENDPOINT_URL`` variable.
"""

from __future__ import annotations

import json
import re
import socket
import uuid
from pathlib import Path

import fsspec
import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict
from s3fs.errors import translate_boto_error
from safetensors.torch import load_file
from typer.testing import CliRunner

from cli.adapters import adapters_app
from lora_rl_core.errors import StoreError
from lora_rl_core.run.rundir import RunDir
from lora_rl_core.store import AdapterStore, RetentionPolicy, RetryPolicy
from tests.support.store_adapters import SMALL_CONFIG, SMALL_KEY, check_race_outcome, race, small_lora, tiny_base
from tests.unit.test_store_faults import FlakyFS, client_error, kill_mid_upload

pytestmark = pytest.mark.slow  # a moto S3 server (and one writer subprocess)
moto_server = pytest.importorskip("moto.server")
BUCKET = "lora-rl-test"
FAST = RetryPolicy(attempts=3, base_delay_s=0.001, max_delay_s=0.005)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def s3():
    """A moto S3 server on 127.0.0.1 with one bucket; yields the endpoint and the storage options."""
    with pytest.MonkeyPatch.context() as mp:
        for name, value in {
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
        }.items():
            mp.setenv(name, value)
        for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
            mp.delenv(name, raising=False)
        port = _free_port()
        server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
        server.start()
        endpoint = f"http://127.0.0.1:{port}"
        options = {"client_kwargs": {"endpoint_url": endpoint}, "key": "testing", "secret": "testing"}
        fsspec.filesystem("s3", **options).mkdir(BUCKET)
        try:
            yield {"endpoint": endpoint, "options": options}
        finally:
            server.stop()


@pytest.fixture
def uri(s3) -> str:
    """A fresh prefix in the test bucket."""
    return f"s3://{BUCKET}/{uuid.uuid4().hex[:12]}"


@pytest.fixture
def store(s3, uri) -> AdapterStore:
    """An AdapterStore at ``uri`` with explicit endpoint and credentials."""
    return AdapterStore(uri, storage_options=s3["options"])


def _fs(s3):
    return fsspec.filesystem("s3", use_listings_cache=False, **s3["options"])


def _model_object(store: AdapterStore, uri: str, version: int) -> str:
    """Path (bucket/key) of a version's weights object."""
    root = uri.removeprefix("s3://")
    return f"{root}/r1/adapters/v{version:06d}/{store.manifest('r1', version).data_dir}/adapter_model.safetensors"


def _pub(store: AdapterStore, version: int, seed: int | None = None):
    tensors = small_lora(version if seed is None else seed)
    return store.publish("r1", version, tensors=tensors, adapter_config=SMALL_CONFIG, step=version, base_model="tiny")


def test_moto_honours_conditional_create(s3, uri):
    fs, path = _fs(s3), f"{uri.removeprefix('s3://')}/x.json"
    fs.pipe_file(path, b"first", mode="create")
    with pytest.raises(FileExistsError):
        fs.pipe_file(path, b"second", mode="create")
    assert fs.cat_file(path) == b"first"


def test_publish_list_pull_and_load(store, uri, s3, tmp_path):
    ref1, ref2 = _pub(store, 1), _pub(store, 2)
    assert store.versions("r1") == [1, 2] and store.latest("r1") == ref2 and store.runs() == ["r1"]
    assert ref1.uri == f"{uri}/r1/adapters/v000001"
    assert json.loads(_fs(s3).cat_file(f"{uri.removeprefix('s3://')}/r1/adapters/LATEST")) == {"version": 2}
    dest = store.pull("r1", 2, tmp_path / "pulled")
    assert {p.name for p in dest.iterdir()} == {"adapter_model.safetensors", "adapter_config.json", "manifest.json"}
    pulled = load_file(dest / "adapter_model.safetensors")
    assert all(torch.equal(pulled[k], t) for k, t in small_lora(2).items())
    tensors, config = store.load_tensors("r1", 1)
    assert all(torch.equal(tensors[k], t) for k, t in small_lora(1).items()) and config["r"] == 2
    run_dir = RunDir(uri, "r1", s3["options"])
    run_dir.write_config({"lr": 1e-4})
    assert run_dir.read_config() == {"lr": 1e-4}


@pytest.mark.filterwarnings("ignore:Could not find a config file")
def test_pulled_folder_loads_with_peft(store, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model = get_peft_model(tiny_base(), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    gen = torch.Generator().manual_seed(3)
    state = {k: torch.randn(t.shape, generator=gen) for k, t in get_peft_model_state_dict(model).items()}
    store.publish(
        "r1", 1, tensors=state, adapter_config=model.peft_config["default"].to_dict(), step=1, base_model="tiny"
    )
    dest = store.pull("r1", 1, tmp_path / "peft")
    config = json.loads((dest / "adapter_config.json").read_text())
    assert {config["peft_type"], config["r"], config["lora_alpha"]} == {"LORA", 4, 8}  # what SGLang --lora-paths reads
    assert sorted(config["target_modules"]) == ["q_proj", "v_proj"]
    got = get_peft_model_state_dict(PeftModel.from_pretrained(tiny_base(), dest))
    assert got.keys() == state.keys() and all(torch.equal(got[k], state[k]) for k in state)


def test_racing_writers_on_s3(s3, uri, monkeypatch):
    stores = [AdapterStore(uri, storage_options=s3["options"]) for _ in range(2)]
    tensors = [small_lora(20), small_lora(21)]
    wins, losses = race(stores, tensors, monkeypatch)
    check_race_outcome(stores[0], tensors, wins, losses)
    files = _fs(s3).find(f"{uri.removeprefix('s3://')}/r1/adapters/v000003")
    data_dirs = {f.split("/")[-2] for f in files if not f.endswith("manifest.json")}
    assert data_dirs == {stores[0].manifest("r1", 3).data_dir}  # the loser removed its files


def test_corrupted_and_truncated_objects_are_named_and_skipped(store, uri, s3):
    _pub(store, 1)
    _pub(store, 2)
    fs, path = _fs(s3), _model_object(store, uri, 2)
    data = bytearray(fs.cat_file(path))
    data[-1] ^= 0xFF
    fs.pipe_file(path, bytes(data))
    with pytest.raises(StoreError, match=re.escape(f"s3://{path} fails its checksum: manifest sha256")):
        store.load_tensors("r1", 2)
    fs.pipe_file(path, bytes(data[:100]))
    with pytest.raises(StoreError, match=re.escape(f"s3://{path} is 100 bytes but its manifest says {len(data)}")):
        store.verify("r1", 2)
    tensors, _ = store.load_tensors("r1", 1)  # the previous version is intact
    assert torch.equal(tensors[SMALL_KEY.format(0, "q_proj", "A")], small_lora(1)[SMALL_KEY.format(0, "q_proj", "A")])


def test_writer_killed_mid_upload_is_never_visible_s3(store, uri, s3, tmp_path):
    kill_mid_upload(store, uri, s3["options"], tmp_path)


def test_injected_503_is_retried_and_403_fails_cleanly(s3, uri):
    real = fsspec.filesystem("s3", use_listings_cache=False, **s3["options"])
    slow = FlakyFS(
        real, methods={"pipe_file"}, failures=2, error=lambda: translate_boto_error(client_error("SlowDown", 503))
    )
    store = AdapterStore(uri, fs=slow, retry=FAST)
    assert _pub(store, 1).version == 1 and len(slow.injected) == 2
    denied = FlakyFS(
        real,
        methods={"pipe_file"},
        failures=1,
        match="adapter_config",
        error=lambda: translate_boto_error(client_error("AccessDenied", 403)),
    )
    store = AdapterStore(uri, fs=denied, retry=FAST)
    with pytest.raises(
        StoreError, match=r"write s3://.*adapter_config.json failed: PermissionError: AccessDenied injected"
    ):
        _pub(store, 2)
    assert store.versions("r1") == [1]
    assert not real.find(f"{uri.removeprefix('s3://')}/r1/adapters/v000002")  # no partial version remains
    assert _pub(store, 2).version == 2


def test_tags_and_gc_on_s3(store, uri, s3):
    for v in range(1, 6):
        _pub(store, v)
    store.tag("r1", 2, "best")
    assert store.resolve("r1@best").version == 2
    assert store.gc("r1", RetentionPolicy(keep_last=2), dry_run=False) == [1, 3]
    assert store.versions("r1") == [2, 4, 5]
    assert not _fs(s3).find(f"{uri.removeprefix('s3://')}/r1/adapters/v000001")


def test_cli_reads_s3_with_the_standard_aws_variables(store, uri, s3, monkeypatch, tmp_path):
    _pub(store, 1)
    _pub(store, 2)
    store.tag("r1", 1, "best")
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3["endpoint"])
    runner = CliRunner()
    listed = runner.invoke(adapters_app, ["list", "--store", uri, "--run", "r1"])
    assert listed.exit_code == 0, listed.output
    assert "best" in listed.output and store.ref("r1", 2).sha256[:12] in listed.output
    out = tmp_path / "best"
    pulled = runner.invoke(adapters_app, ["pull", "r1@best", "--store", uri, "--out", str(out)])
    assert pulled.exit_code == 0, pulled.output
    assert Path(pulled.stdout.strip()) == out and (out / "adapter_model.safetensors").is_file()
