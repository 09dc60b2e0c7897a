"""Stop sequences outside the engine: the `rollout.stop` / `rollout.stop_token_ids` settings and their checks
(a non-string stop, an empty one, a negative id, an id outside the tokenizer's vocabulary before step 1), what the
HTTP client sends SGLang (`stop`, `stop_token_ids`, `no_stop_trim`) and how it reads SGLang's finish reasons
(`{"type": "stop", "matched": <str or int>}`: `stop` or `eos`), and the shapes our server answers in."""

from __future__ import annotations

import json

import httpx
import pytest

from lora_rl_core.config.load import config_from_dict
from lora_rl_core.engines import Completion, GenerationRequest, SamplingParams
from lora_rl_core.engines.remote import SERVER, SGLANG, Dialect, HTTPEngine
from lora_rl_core.engines.remote.wire import sampling_body
from lora_rl_core.engines.serve.api import SamplingIn, finish_reason, output_text
from lora_rl_core.errors import ConfigError
from lora_rl_core.run import load_inputs

STOPPED = SamplingParams(max_new_tokens=8, stop=("\n\n", "####"), stop_token_ids=(7, 9))


# ----------------------------------------------------------------- settings


def test_rollout_stop_settings() -> None:
    cfg = config_from_dict({"rollout": {"stop": "\n\n", "stop_token_ids": [7]}})
    assert (cfg.rollout.stop, cfg.rollout.stop_token_ids) == (("\n\n",), (7,))  # a bare string is one stop
    assert (config_from_dict({}).rollout.stop, config_from_dict({}).rollout.stop_token_ids) == ((), ())


@pytest.mark.parametrize(
    ("rollout", "words"),
    [
        ({"stop": [5]}, "rollout.stop: Value error, each stop must be a string, got 5"),
        ({"stop": ["a", ""]}, "rollout.stop: Value error, a stop must not be an empty string"),
        ({"stop": {"a": 1}}, "rollout.stop: Value error, must be a string or a list of strings"),
        ({"stop_token_ids": [3, -1]}, "rollout.stop_token_ids: Value error, each stop token id must be a token id"),
        ({"stop_token_ids": ["3"]}, "rollout.stop_token_ids: Value error, each stop token id must be a token id"),
        ({"stop_token_ids": [True]}, "rollout.stop_token_ids: Value error, each stop token id must be a token id"),
    ],
)
def test_bad_stop_settings_are_one_line_naming_the_field(rollout: dict, words: str) -> None:
    with pytest.raises(ConfigError) as err:
        config_from_dict({"rollout": rollout})
    assert words in str(err.value) and "\n" not in str(err.value)


def test_stop_token_ids_outside_the_vocabulary_are_refused_before_step_1(tiny_model_dir) -> None:
    model = {"name_or_path": str(tiny_model_dir)}
    ok = config_from_dict({"model": model, "store": {"uri": "memory://stops"}, "rollout": {"stop_token_ids": [77]}})
    load_inputs(ok).close()  # 78 ids: 0 .. 77
    bad = ok.model_copy(update={"rollout": ok.rollout.model_copy(update={"stop_token_ids": [5, 78, 1000]})})
    with pytest.raises(ConfigError, match=r"rollout\.stop_token_ids: \[78, 1000\] outside the tokenizer's vocabulary"):
        load_inputs(bad)


# ----------------------------------------------------------------- the HTTP client


def test_sampling_body_sends_stops_only_where_set() -> None:
    plain = sampling_body(SamplingParams(max_new_tokens=4))
    assert not {"stop", "stop_token_ids", "no_stop_trim"} & set(plain)
    assert sampling_body(STOPPED) == {
        **plain, "max_new_tokens": 8, "stop": ["\n\n", "####"], "stop_token_ids": [7, 9], "no_stop_trim": True,
    }  # fmt: skip
    only_ids = sampling_body(SamplingParams(stop_token_ids=(3,)))
    assert (only_ids["stop_token_ids"], only_ids["no_stop_trim"], "stop" in only_ids) == ([3], True, False)


def _sglang_answers(finishes: list[dict], bodies: list[dict], dialect: Dialect = SGLANG) -> HTTPEngine:
    """A client whose server records `/generate` bodies and ends request `i` with `finishes[i]`."""
    engine = HTTPEngine(dialect, "http://fake")

    def handle(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        bodies.append(body)
        outs = []
        for rid, finish in zip(body["rid"], finishes, strict=True):
            last = finish.get("matched") if isinstance(finish.get("matched"), int) else 8
            meta = {"id": rid, "finish_reason": finish, "output_token_logprobs": [[-0.1, 5, None], [-0.2, last, None]]}
            version = "default" if dialect is SGLANG else None  # ours: the adapter's version (none here)
            outs.append({"text": "", "output_ids": [5, last], "meta_info": {**meta, "weight_version": version}})
        return httpx.Response(200, json=outs)

    engine._http = engine._generation_http = httpx.Client(base_url="http://fake", transport=httpx.MockTransport(handle))
    return engine


@pytest.mark.parametrize("dialect", [SGLANG, SERVER])
def test_sglang_finish_reasons_map_to_stop_eos_and_length(dialect: Dialect) -> None:
    finishes = [
        {"type": "stop", "matched": "####"},  # FINISH_MATCHED_STR: a stop string
        {"type": "stop", "matched": 9},  # FINISH_MATCHED_TOKEN of a stop token id
        {"type": "stop", "matched": 2},  # FINISH_MATCHED_TOKEN of an EOS id (not a stop token id)
        {"type": "length", "length": 2},
        {"type": "stop", "matched": [4, 9]},  # a list of ids, one of them a stop token id
    ]
    bodies: list[dict] = []
    params = SamplingParams(**{**STOPPED.__dict__, "seed": 4})
    with _sglang_answers(finishes, bodies, dialect) as engine:
        done = engine.generate([GenerationRequest([1, 2], None, params) for _ in finishes])
    assert [c.finish_reason for c in done] == ["stop", "stop", "eos", "length", "stop"]
    assert done[1].completion_ids == [5, 9] and done[1].logprobs == [-0.1, -0.2]  # the stop's token kept
    (body,) = bodies
    per_request = body["sampling_params"] if isinstance(body["sampling_params"], list) else [body["sampling_params"]]
    for sp in per_request:
        assert (sp["stop"], sp["stop_token_ids"], sp["no_stop_trim"]) == (["\n\n", "####"], [7, 9], True)
    # without stop token ids in the request, a matched id is an EOS
    with _sglang_answers([{"type": "stop", "matched": 9}], []) as engine:
        (plain,) = engine.generate([GenerationRequest([1, 2], None, SamplingParams())])
    assert plain.finish_reason == "eos"


# ----------------------------------------------------------------- our server's answer


class _Chars:
    """A tokenizer of one character per id (id = code point)."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids)


def _completion(text: str, finish: str) -> Completion:
    ids = [ord(ch) for ch in text]
    return Completion("r", [1], ids, [-0.1] * len(ids), finish, None, None)  # type: ignore[arg-type]


def test_server_reports_finish_reasons_and_text_as_sglang() -> None:
    sampling = SamplingIn(stop=["##", "x"], stop_token_ids=[ord("!")])
    cases = [
        (_completion("ab##", "stop"), {"type": "stop", "matched": "##"}, "ab", "ab##"),
        (_completion("ab!", "stop"), {"type": "stop", "matched": ord("!")}, "ab", "ab!"),
        (_completion("ab.", "eos"), {"type": "stop", "matched": ord(".")}, "ab", "ab."),
        (_completion("abc", "length"), {"type": "length", "length": 3}, "abc", "abc"),
    ]
    keep = sampling.model_copy(update={"no_stop_trim": True})
    for c, finish, trimmed, kept in cases:
        assert finish_reason(c, sampling, _Chars()) == finish
        assert output_text(c.completion_ids, finish.get("matched"), sampling, _Chars()) == trimmed
        assert output_text(c.completion_ids, finish.get("matched"), keep, _Chars()) == kept
    # no tokenizer: the matched string is the first stop string (a client still reads `stop`)
    assert finish_reason(_completion("ax", "stop"), sampling, None) == {"type": "stop", "matched": "##"}
    assert SamplingIn(stop="x", stop_token_ids=[3]).to_params().stop == ("x",)
