"""AdapterStore: publish, list, pull and verify tiny real PEFT LoRA adapters."""

from __future__ import annotations

import hashlib
import json
import uuid
from pathlib import Path

import fsspec
import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict

from lora_rl_core.errors import StoreError
from lora_rl_core.store import AdapterRef, AdapterStore, RetentionPolicy, plan_retention
from tests.support.store_adapters import BASE, check_race_outcome, race, small_lora, tiny_base
from tests.support.store_adapters import publish_small as _pub
from tests.support.store_adapters import version_files as _files


@pytest.fixture(scope="module")
def lora() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict]:
    """Two different LoRA state dicts (random A and B) and the raw PEFT config dict."""
    model = get_peft_model(tiny_base(), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    gen = torch.Generator().manual_seed(1)
    sd = get_peft_model_state_dict(model)
    v1 = {k: torch.randn(t.shape, generator=gen) for k, t in sd.items()}
    v2 = {k: torch.randn(t.shape, generator=gen) for k, t in sd.items()}
    return v1, v2, model.peft_config["default"].to_dict()  # to_dict holds a set: the store must cope


@pytest.fixture
def store(tmp_path: Path) -> AdapterStore:
    return AdapterStore(f"file://{tmp_path}/runs")


def _publish(store: AdapterStore, version: int, tensors: dict, config: dict, **kw) -> AdapterRef:
    return store.publish(
        "r1",
        version,
        tensors=tensors,
        adapter_config=config,
        step=10 * version,
        base_model=BASE,
        metrics={"reward_mean": 0.5 + version},
        **kw,
    )


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_publish_two_versions_lists_and_latest(store, lora, tmp_path):
    v1, v2, config = lora
    assert store.versions("r1") == [] and store.latest("r1") is None
    ref1 = _publish(store, 1, v1, config)
    ref2 = _publish(store, 2, v2, config)
    assert store.versions("r1") == [1, 2]
    assert store.latest("r1") == ref2
    assert ref2.name == "r1-v000002"
    assert ref1.uri == f"file://{tmp_path}/runs/r1/adapters/v000001"
    latest = tmp_path / "runs/r1/adapters/LATEST"
    assert json.loads(latest.read_text()) == {"version": 2}
    assert store.runs() == ["r1"]
    assert AdapterRef.model_validate_json(ref1.model_dump_json()) == ref1


def test_latest_hint_never_moves_backwards(store, lora, tmp_path):
    v1, v2, config = lora
    _publish(store, 5, v1, config)
    _publish(store, 3, v2, config)
    assert json.loads((tmp_path / "runs/r1/adapters/LATEST").read_text()) == {"version": 5}
    assert store.resolve("r1@latest").version == 5


def test_manifest_checksums_match_files(store, lora, tmp_path):
    v1, _, config = lora
    ref = _publish(store, 1, v1, config)
    manifest = store.manifest("r1", 1)
    vdir = _files(tmp_path, store, 1)
    assert manifest.data_dir.startswith(ref.sha256[:12]) and vdir.parent.name == "v000001"
    assert set(manifest.files) == {"adapter_model.safetensors", "adapter_config.json"}
    for name, entry in manifest.files.items():
        assert entry.sha256 == _sha(vdir / name)
        assert entry.size == (vdir / name).stat().st_size
    assert ref.sha256 == manifest.files["adapter_model.safetensors"].sha256
    assert (manifest.step, manifest.base_model, manifest.metrics) == (10, BASE, {"reward_mean": 1.5})
    assert manifest.lora == {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}
    assert manifest.created_at.endswith("+00:00")


@pytest.mark.filterwarnings("ignore:Could not find a config file")
def test_pull_loads_with_peft_and_weights_match(store, lora, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # PEFT would look up BASE on the Hub
    v1, v2, config = lora
    _publish(store, 1, v1, config)
    _publish(store, 2, v2, config)
    dest = store.pull("r1", 2, tmp_path / "pulled" / "r1-v2")
    assert dest.is_absolute()
    loaded = PeftModel.from_pretrained(tiny_base(), dest)
    got = get_peft_model_state_dict(loaded)
    assert set(got) == set(v2)
    for key, tensor in v2.items():
        torch.testing.assert_close(got[key], tensor, rtol=0, atol=0)
    assert not torch.equal(got[next(iter(v1))], v1[next(iter(v1))])


def test_load_tensors_roundtrip(store, lora):
    v1, _, config = lora
    _publish(store, 1, v1, config)
    tensors, adapter_config = store.load_tensors("r1", 1)
    assert set(tensors) == set(v1)
    assert all(torch.equal(tensors[k], v1[k]) for k in v1)
    assert adapter_config["r"] == 4 and adapter_config["base_model_name_or_path"] == BASE


def test_folder_without_manifest_is_invisible(store, lora, tmp_path):
    v1, _, config = lora
    _publish(store, 1, v1, config)
    partial = tmp_path / "runs/r1/adapters/v000002"
    partial.mkdir()
    (partial / "adapter_model.safetensors").write_bytes(b"half an upload")
    assert store.versions("r1") == [1]
    assert store.latest("r1").version == 1
    with pytest.raises(StoreError, match=r"r1@2 not found.*\[1\]"):
        store.ref("r1", 2)


def test_leftover_of_a_killed_upload_is_ignored_by_publish(store, lora, tmp_path):
    v1, _, config = lora
    partial = tmp_path / "runs/r1/adapters/v000001"
    partial.mkdir(parents=True)
    (partial / "adapter_model.safetensors").write_bytes(b"half an upload")
    ref = _publish(store, 1, v1, config)
    assert _sha(_files(tmp_path, store, 1) / "adapter_model.safetensors") == ref.sha256
    assert torch.equal(store.load_tensors("r1", 1)[0][next(iter(v1))], v1[next(iter(v1))])


def test_versions_are_immutable_and_republish_is_idempotent(store, lora):
    v1, v2, config = lora
    ref = _publish(store, 1, v1, config)
    assert _publish(store, 1, {k: t.clone() for k, t in v1.items()}, config) == ref
    with pytest.raises(StoreError, match="already exists"):
        _publish(store, 1, v2, config)
    assert store.load_tensors("r1", 1)[0].keys() == v1.keys()


def test_non_finite_tensors_are_refused(store, lora):
    v1, _, config = lora
    key = next(iter(v1))
    bad = {**v1, key: torch.full_like(v1[key], float("nan"))}
    with pytest.raises(StoreError, match="NaN"):
        _publish(store, 1, bad, config)
    assert store.versions("r1") == []


def test_corrupt_file_fails_pull_and_leaves_no_dest(store, lora, tmp_path):
    v1, _, config = lora
    ref = _publish(store, 1, v1, config)
    stored = _files(tmp_path, store, 1) / "adapter_model.safetensors"
    data = bytearray(stored.read_bytes())
    data[-1] ^= 0xFF
    stored.write_bytes(bytes(data))
    out = tmp_path / "out"
    with pytest.raises(StoreError, match="adapter_model.safetensors") as err:
        store.pull("r1", 1, out / "r1")
    assert ref.sha256 in str(err.value) and _sha(stored) in str(err.value)
    assert not (out / "r1").exists()
    assert not out.exists() or list(out.iterdir()) == []
    with pytest.raises(StoreError, match="checksum"):
        store.load_tensors("r1", 1)


def test_pull_into_non_empty_folder_is_refused_unless_same_version(store, lora, tmp_path):
    v1, v2, config = lora
    _publish(store, 1, v1, config)
    _publish(store, 2, v2, config)
    dest = store.pull("r1", 1, tmp_path / "a")
    assert store.pull("r1", 1, dest) == dest
    with pytest.raises(StoreError, match="not an empty folder"):
        store.pull("r1", 2, dest)


def test_publish_folder_from_save_pretrained(store, tmp_path):
    model = get_peft_model(tiny_base(), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"]))
    model.save_pretrained(tmp_path / "saved")
    ref = store.publish_folder("r2", 0, tmp_path / "saved", step=0, base_model=BASE)
    assert ref.sha256 == _sha(tmp_path / "saved" / "adapter_model.safetensors")
    (tmp_path / "saved" / "adapter_model.bin").write_bytes(b"pickle")
    with pytest.raises(StoreError, match="pickle"):
        store.publish_folder("r2", 1, tmp_path / "saved", step=1, base_model=BASE)


def test_pickle_file_in_manifest_is_refused(store, lora, tmp_path):
    v1, _, config = lora
    _publish(store, 1, v1, config)
    mpath = tmp_path / "runs/r1/adapters/v000001/manifest.json"
    manifest = json.loads(mpath.read_text())
    manifest["files"]["../../evil.pt"] = {"sha256": "0" * 64, "size": 1}
    mpath.write_text(json.dumps(manifest))
    with pytest.raises(StoreError, match="unsafe file name"):
        store.pull("r1", 1, tmp_path / "out")


def test_memory_store(lora):
    v1, v2, config = lora
    root = f"memory://store-{uuid.uuid4().hex}"
    store = AdapterStore(root)
    try:
        _publish(store, 1, v1, config)
        ref = _publish(store, 2, v2, config)
        assert store.versions("r1") == [1, 2]
        assert store.resolve("r1") == ref and ref.uri.startswith("memory://")
        tensors, _ = store.load_tensors("r1", 2)
        assert all(torch.equal(tensors[k], v2[k]) for k in v2)
    finally:
        fsspec.filesystem("memory").rm(fsspec.core.url_to_fs(root)[1], recursive=True)


def test_relative_file_uri_is_made_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert AdapterStore("file://./runs").uri == f"file://{tmp_path}/runs"


def test_resolve_errors(store, lora):
    v1, _, config = lora
    _publish(store, 1, v1, config)
    assert store.resolve("r1@1").version == 1
    assert store.resolve("r1-v000001").version == 1
    with pytest.raises(StoreError, match=r"'ghost' has no complete adapter versions"):
        store.resolve("ghost@latest")
    with pytest.raises(StoreError, match=r"r1@9 not found.*\[1\]"):
        store.resolve("r1@9")


# ----------------------------------------------------------------- small adapters without PEFT

# ----------------------------------------------------------------- tags


def test_tags_resolve_move_and_untag(store):
    for v in (1, 2, 3):
        _pub(store, v)
    store.tag("r1", 2, "best")
    store.tag("r1", 1, "release")
    assert store.tags("r1") == {"best": 2, "release": 1}
    assert store.resolve("r1@best").version == 2
    store.tag("r1", 3, "best")  # a tag moves
    assert store.resolve("r1@best").version == 3
    assert store.untag("r1", "best") == 3
    assert store.tags("r1") == {"release": 1}
    with pytest.raises(StoreError, match=r"run 'r1' has no tag 'best'.*its tags: \{'release': 1\}"):
        store.resolve("r1@best")


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("latest", "'latest' always means the newest version"),
        ("7", "all digits and would read as a version number"),
        ("../x", r"invalid tag name '../x': use 1-64 characters"),
        ("a/b", "invalid tag name 'a/b'"),
        (".hidden", "invalid tag name '.hidden'"),
        ("x" * 65, "invalid tag name"),
    ],
)
def test_bad_tag_names_are_refused(store, name, message):
    _pub(store, 1)
    with pytest.raises(StoreError, match=message):
        store.tag("r1", 1, name)
    assert store.tags("r1") == {}


def test_tag_needs_an_existing_version_and_dangling_tag_is_explained(store, tmp_path):
    _pub(store, 1)
    with pytest.raises(StoreError, match=r"r1@4 not found.*\[1\]"):
        store.tag("r1", 4, "best")
    (tmp_path / "runs/r1/tags").mkdir(parents=True)
    (tmp_path / "runs/r1/tags/old.json").write_text('{"version": 9}')
    with pytest.raises(StoreError, match="tag 'old' of run 'r1' points to version 9, which is not in"):
        store.resolve("r1@old")


# ----------------------------------------------------------------- retention


def test_plan_retention_hand_computed():
    policy = RetentionPolicy(keep_last=2, keep_every=5)
    plan = plan_retention(list(range(1, 12)), {"best": 3}, policy)
    kept = {v: why for v, why in plan.items() if why}
    assert kept == {3: "tag best", 5: "every 5", 10: "last 2, every 5", 11: "last 2"}
    no_tags = plan_retention([1, 2, 3], {"best": 1}, RetentionPolicy(keep_last=1, keep_tags=False))
    assert no_tags == {1: None, 2: None, 3: "last 1"}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"keep_last": 0}, r"keep_last must be an integer >= 1 \(the newest version is always kept\), got 0"),
        ({"keep_last": 2, "keep_every": 0}, "keep_every must be an integer >= 1 or unset, got 0"),
    ],
)
def test_retention_policy_rejects(kwargs, message):
    with pytest.raises(StoreError, match=message):
        RetentionPolicy(**kwargs)


def test_gc_dry_run_then_delete(store, tmp_path):
    for v in range(1, 8):
        _pub(store, v)
    store.tag("r1", 1, "best")
    policy = RetentionPolicy(keep_last=2, keep_every=3)
    assert store.gc("r1", policy, dry_run=True) == [2, 4, 5]
    assert store.versions("r1") == list(range(1, 8))
    assert store.gc("r1", policy, dry_run=False) == [2, 4, 5]
    assert store.versions("r1") == [1, 3, 6, 7]
    assert not (tmp_path / "runs/r1/adapters/v000002").exists()
    assert store.resolve("r1@best").version == 1 and store.latest("r1").version == 7
    assert store.gc("r1", RetentionPolicy(keep_last=1, keep_tags=False), dry_run=False) == [1, 3, 6]
    assert store.versions("r1") == [7] and store.tags("r1") == {}


def test_gc_removes_leftover_data_folders_of_complete_versions(store, tmp_path):
    _pub(store, 1)
    vdir = tmp_path / "runs/r1/adapters/v000001"
    leftover = vdir / "0123456789ab-0123456789ab"
    leftover.mkdir()
    (leftover / "adapter_model.safetensors").write_bytes(b"a losing or killed attempt")
    assert store.gc("r1", RetentionPolicy(keep_last=1), dry_run=False) == []
    assert not leftover.exists() and (vdir / store.manifest("r1", 1).data_dir).is_dir()
    store.verify("r1", 1)


# ----------------------------------------------------------------- racing writers


@pytest.mark.parametrize("backend", ["file", "memory"])
def test_racing_writers_one_wins_nothing_mixed(tmp_path, monkeypatch, backend):
    root = f"file://{tmp_path}/runs" if backend == "file" else f"memory://race-{uuid.uuid4().hex}"
    stores = [AdapterStore(root), AdapterStore(root)]
    tensors = [small_lora(10), small_lora(11)]
    wins, losses = race(stores, tensors, monkeypatch)
    check_race_outcome(stores[0], tensors, wins, losses)
    if backend == "file":
        assert [p.name for p in (tmp_path / "runs/r1/adapters/v000003").iterdir() if p.is_dir()] == [
            stores[0].manifest("r1", 3).data_dir
        ]


def test_racing_identical_writers_both_get_the_ref(store, monkeypatch):
    wins, losses = race([store, AdapterStore(store.uri)], [small_lora(5), small_lora(5)], monkeypatch)
    assert losses == [] and len(wins) == 2 and wins[0] == wins[1]


def test_files_uri_is_a_peft_folder(store, lora, tmp_path):
    v1, _, config = lora
    _publish(store, 1, v1, config)
    folder = _files(tmp_path, store, 1)
    assert store.files_uri("r1", 1) == f"file://{folder}"
    assert {p.name for p in folder.iterdir()} == {"adapter_model.safetensors", "adapter_config.json"}
