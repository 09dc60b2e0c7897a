"""Adapter references on the engine server (`serve.names`): `RUN@latest`, `RUN@N`, `RUN@TAG`; the retry of a
call whose resolved version was retired before admission (`EngineServer.complete_named`); OpenAI stop strings.

No model: a dict-listing engine, a store stand-in and a character tokenizer.
"""

from __future__ import annotations

from concurrent.futures import Future

import pytest
from fastapi.testclient import TestClient

from lora_rl_core.engines.base import Completion, GenerationRequest, aborted_completion
from lora_rl_core.engines.serve.api import HTTPError
from lora_rl_core.engines.serve.app import create_app
from lora_rl_core.engines.serve.names import AdapterNames, is_reference, latest_aliases
from lora_rl_core.engines.serve.openai_api import apply_stops
from lora_rl_core.errors import StoreError


class ListingEngine:
    """Lists the adapters a test sets; completes a request at once with its adapter's version, or, for names in
    `retire_on_submit`, as a sync that retired it just before admission would (aborted `adapter_unloaded`)."""

    def __init__(self, names: list[str]) -> None:
        self.names = list(names)
        self.retire_on_submit: dict[str, str] = {}  # name -> the version loaded in its place
        self.submitted: list[GenerationRequest] = []

    def list_adapters(self) -> dict:
        return {n: {"version": int(n.rsplit("-v", 1)[1]) if "-v" in n else None} for n in self.names}

    def submit(self, request: GenerationRequest) -> Future:
        self.submitted.append(request)
        future: Future = Future()
        version = self.list_adapters().get(request.adapter, {}).get("version")
        if request.adapter in self.retire_on_submit:
            self.names = [self.retire_on_submit.pop(request.adapter) if n == request.adapter else n for n in self.names]
            future.set_result(aborted_completion(request, version, "adapter_unloaded"))
            return future
        fields = {"completion_ids": [7], "logprobs": [-0.5], "finish_reason": "length", "adapter_version": version}
        future.set_result(Completion(request.request_id, request.prompt_ids, adapter=request.adapter, **fields))
        return future

    def abort(self, request_id: str | None = None, *, reason: str = "aborted") -> int:
        return 0


class Store:
    """`tag_version` and `manifest` of a store holding `versions` of run `r` with `tags`."""

    def __init__(self, versions: list[int], tags: dict[str, int]) -> None:
        self.versions, self.tags = versions, tags

    def tag_version(self, run_id: str, tag: str) -> int:
        if run_id != "r" or tag not in self.tags:
            raise StoreError(f"run {run_id!r} has no tag {tag!r}; its tags: {self.tags}")
        return self.tags[tag]

    def manifest(self, run_id: str, version: int) -> dict:
        if run_id != "r" or version not in self.versions:
            raise StoreError(f"version {version} of run {run_id!r} not found; available versions: {self.versions}")
        return {}


LOADED = ["r-v000002", "r-v000010", "other-v000001", "plain"]


def resolve(name: str | None, *, store: Store | None = None, loaded: list[str] = LOADED) -> str | None:
    return AdapterNames(ListingEngine(loaded), store=store).resolve([name])[0]  # type: ignore[arg-type]


def test_references_resolve_to_loaded_versions_and_store_loads():
    store = Store([1, 2, 3, 10], {"best": 3, "old": 2})
    assert resolve("r@latest") == "r-v000010"  # the newest loaded, by number (v10 after v2)
    assert resolve("other@latest") == "other-v000001"
    assert resolve("r@2") == resolve("r@2", store=store) == "r-v000002"
    assert resolve("r@3", store=store) == "store://r@3"  # not loaded: the engine loads it from its store
    assert resolve("r@best", store=store) == "store://r@3" and resolve("r@old", store=store) == "r-v000002"
    for name in ("r-v000002", "plain", "store://r@7", None):
        assert resolve(name) == name  # names, store URIs and the base model pass as they are
    assert latest_aliases(LOADED) == {"other@latest": "other-v000001", "r@latest": "r-v000010"}
    assert [is_reference(n) for n in ("r@latest", "r-v000001", "store://r@1", None)] == [True, False, False, False]


@pytest.mark.parametrize(
    ("name", "store", "status", "words"),
    [
        ("ghost@latest", None, 404, ["ghost@latest", "no version of run 'ghost'", "'other', 'r'"]),
        ("r@7", None, 404, ["r@7", "r-v000007 is not loaded", "no store", "['r-v000002', 'r-v000010']"]),
        ("r@7", Store([1], {}), 404, ["r@7", "nor in its store", "available versions: [1]"]),
        ("r@best", None, 400, ["r@best", "tags live in the adapter store"]),
        ("r@nope", Store([1], {"best": 1}), 404, ["r@nope", "no tag 'nope'", "'best'"]),
        ("r@", None, 400, ["invalid adapter spec 'r@'"]),
        ("bad run@latest", None, 400, ["invalid run id"]),
        ("ghost-v000001", None, 400, ["has never been loaded: ghost-v000001", "r-v000010"]),
    ],
)
def test_unknown_or_malformed_references_name_the_reference_and_what_is_loaded(name, store, status, words):
    with pytest.raises(HTTPError) as caught:
        resolve(name, store=store)
    assert caught.value.status == status
    assert all(w in caught.value.message for w in words), caught.value.message


def test_one_listing_and_one_resolution_per_distinct_name():
    engine = ListingEngine(LOADED)
    calls = []
    listing = engine.list_adapters
    engine.list_adapters = lambda: calls.append(1) or listing()  # type: ignore[method-assign]
    names = AdapterNames(engine, store=None)  # type: ignore[arg-type]
    assert names.resolve(["r@latest", None, "r@latest", "plain"]) == ["r-v000010", None, "r-v000010", "plain"]
    assert calls == [1]


def test_a_call_whose_version_was_retired_before_admission_is_resolved_again_whole():
    """The race left open: `r@latest` resolved to v2, then a sync loaded v3 and retired v2 before the requests
    were admitted. The call runs again, every request of it, on v3, under fresh request ids."""
    engine = ListingEngine(["r-v000002"])
    engine.retire_on_submit["r-v000002"] = "r-v000003"
    with TestClient(create_app(engine, served_model_name="base")) as client:  # type: ignore[arg-type]
        body = {"input_ids": [[5, 6], [7]], "lora_path": "r@latest", "rid": ["a", "b"]}
        outs = client.post("/generate", json=body).json()
    assert [o["meta_info"]["weight_version"] for o in outs] == [3, 3]
    assert [o["meta_info"]["lora_path"] for o in outs] == ["r-v000003"] * 2
    assert [r.request_id for r in engine.submitted] == ["a", "b", "a.1", "b.1"]


def test_an_adapter_unloaded_without_a_race_is_answered_not_retried():
    """A plain name (no reference) whose version is unloaded before admission ends aborted, as before."""
    engine = ListingEngine(["r-v000002"])
    engine.retire_on_submit["r-v000002"] = "r-v000003"
    with TestClient(create_app(engine, served_model_name="base")) as client:  # type: ignore[arg-type]
        out = client.post("/generate", json={"input_ids": [5, 6], "lora_path": "r-v000002"}).json()
    assert out["meta_info"]["finish_reason"] == {"type": "abort", "message": "adapter_unloaded"}
    assert len(engine.submitted) == 1


class Chars:
    """A tokenizer whose token i is the character chr(i)."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids)


def completion(text: str, finish: str = "length") -> Completion:
    ids = [ord(c) for c in text]
    return Completion("x", [1], ids, [-1.0] * len(ids), finish, None, None)  # type: ignore[arg-type]


def test_stop_strings_cut_the_text_and_count_the_tokens_up_to_the_stop():
    assert apply_stops(completion("12+3=15\n#"), Chars(), ["\n", "="]) == ("12+3", 5, "stop")  # the first stop
    assert apply_stops(completion("abc"), Chars(), ["x"]) == ("abc", 3, "length")
    assert apply_stops(completion("abc", "stop"), Chars(), []) == ("abc", 3, "stop")
    assert apply_stops(completion("abcab"), Chars(), ["ab"]) == ("", 2, "stop")
