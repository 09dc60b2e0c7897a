"""The engines a stress run drives (`lora_rl_testing.stress`): one class per kind of target, the calls the run
makes (send a group, abort, load, retire, list) and how each kind answers them."""

from __future__ import annotations

import dataclasses
from typing import Any

import httpx

from lora_rl_core.adapters import adapter_version
from lora_rl_core.engines.base import GenerationRequest, SamplingParams
from lora_rl_core.engines.remote import SERVER, SGLANG, HTTPEngine
from lora_rl_core.errors import EngineError
from lora_rl_core.subscriber import retire_stale
from lora_rl_testing.stress_report import Group, Sample, StressSettings


class Target:
    """The engine calls the stress run makes; `InProcess`, `HttpTarget` and `SGLangTarget` fill in how."""

    samples = "group"
    exact_abort_counts = True
    """Whether `abort` returns how many requests the engine really aborted (checked against the samples)."""

    def __init__(self, engine: Any, settings: StressSettings) -> None:
        self.engine = engine
        self.settings = settings
        self.label = type(engine).__name__
        """What the report names as the target: the engine's class here, the server's URL over HTTP."""

    def send(self, group: Group, prompt: list[int], params: SamplingParams) -> list[Sample]:
        """`n` requests sharing the prompt through `engine.generate` (raises EngineError when refused)."""
        requests = [
            GenerationRequest(prompt, group.name, params, request_id=f"{group.rid}-{j}") for j in range(group.n)
        ]
        done = self.engine.generate(requests, timeout_s=self.settings.request_timeout_s)
        return [Sample(c.request_id, c.finish_reason, c.adapter, c.adapter_version, c.abort_reason) for c in done]

    def abort_ids(self, group: Group, which: int | None) -> list[str]:
        """Request ids to abort: sample `which` of the group, or all of them (None)."""
        return [f"{group.rid}-{j}" for j in range(group.n) if which is None or j == which]

    def load(self, name: str, tensors: dict, config: dict) -> None:
        """Load one version from tensors (the tensor path)."""
        self.engine.load_adapter(name, tensors=tensors, config=config, timeout_s=self.settings.control_timeout_s)

    def retire(self, active: str, *, keep: int | None = None, drain: bool = False) -> list[str]:
        """Unload stale versions with `subscriber.retire_stale` (which skips a paused engine), beyond the
        `keep` newest (default: the settings')."""
        s = self.settings
        keep = s.keep if keep is None else keep
        return retire_stale(self.engine, s.run_id, keep=keep, protect={active}, drain=drain)

    def loaded(self, run_id: str) -> int:
        """How many versions of `run_id` the engine lists now."""
        return sum(1 for name in self.engine.list_adapters() if name.startswith(f"{run_id}-v"))

    def in_flight(self) -> int:
        """Requests holding an adapter now (sum over adapters)."""
        return sum(int(info.get("in_flight") or 0) for info in self.engine.list_adapters().values())

    def revived(self) -> int:
        """Retired versions the engine was seen serving again (only a real SGLang server revives them)."""
        return 0

    def close(self) -> None:
        """Release what the target opened."""


class InProcess(Target):
    """An `EmbeddedEngine` in this process."""


class HttpTarget(Target):
    """Our engine server over HTTP through `ServerEngine`; `samples="n"` sends SGLang's `n` itself."""

    def __init__(self, engine: HTTPEngine, settings: StressSettings) -> None:
        super().__init__(engine, settings)
        self.label = engine.url
        self.samples = settings.samples or "n"
        limits = httpx.Limits(max_connections=settings.clients + 8)
        self._http = httpx.Client(base_url=engine.url, timeout=settings.request_timeout_s, limits=limits)

    def send(self, group: Group, prompt: list[int], params: SamplingParams) -> list[Sample]:
        """One `/generate` with `sampling_params.n` (or the group path); versions from `weight_version`."""
        if self.samples == "group":
            return super().send(group, prompt, params)
        return self._generate_n(group, prompt, params, rid=group.rid)

    def _generate_n(self, group: Group, prompt: list[int], params: SamplingParams, *, rid: str | None) -> list[Sample]:
        """One raw `/generate` of the group's `n` samples (`rid` None: the server names them)."""
        sampling = {"max_new_tokens": params.max_new_tokens, "temperature": params.temperature, "n": group.n}
        body = {"input_ids": prompt, "sampling_params": sampling, "lora_path": group.name}
        response = self._http.post("/generate", json=body if rid is None else {**body, "rid": rid})
        if response.status_code == 499:
            raise LostCall(f"HTTP 499: {response.text[:300]}")
        if response.status_code >= 400:
            raise EngineError(f"HTTP {response.status_code}: {response.text[:300]}")
        outs = response.json()
        return [_http_sample(o) for o in (outs if isinstance(outs, list) else [outs])]

    def abort_ids(self, group: Group, which: int | None) -> list[str]:
        """With SGLang's n the server maps the group's rid to all its samples; single samples are `rid-j`."""
        if self.samples == "n" and which is None:
            return [group.rid]
        return super().abort_ids(group, which)

    def close(self) -> None:
        """Close the HTTP connections opened for `samples="n"`."""
        self._http.close()


class SGLangTarget(HttpTarget):
    """A real SGLang server through `SGLangEngine` (docs/SGLANG.md). SGLang reports neither the adapter nor
    its version per sample (`weight_version` is the base weights'), so a sample's version is the one its
    request named, and abort counts are this client's estimates (an abort may reach the server after the
    request finished): the version and abort-count checks cannot fail here. What can: lost samples, errors,
    hangs (an unload after n>1 traffic, sglang#36894), unloads while paused, and a retired version coming
    back (`revived_adapters`). `samples="group"` (the default here): `n` requests through `generate`, the
    rollout path (an HTTP 499 is `SGLangEngine`'s to resolve); `samples="n"`: one raw `/generate` with
    `sampling_params.n` and no rid (SGLang's n>1 rid mapping is not ours to guess), so those groups get no
    aborts by id, and a call SGLang fails with HTTP 499 during an `abort` pause is a group aborted `paused`
    (`LostCall`)."""

    exact_abort_counts = False

    def __init__(self, engine: HTTPEngine, settings: StressSettings) -> None:
        super().__init__(engine, settings)
        self.samples = settings.samples or "group"

    def send(self, group: Group, prompt: list[int], params: SamplingParams) -> list[Sample]:
        if self.samples == "group":
            return Target.send(self, group, prompt, params)
        samples = self._generate_n(group, prompt, params, rid=None)
        return [dataclasses.replace(x, adapter=group.name, version=adapter_version(group.name)) for x in samples]

    def abort_ids(self, group: Group, which: int | None) -> list[str]:
        return [] if self.samples == "n" else Target.abort_ids(self, group, which)

    def in_flight(self) -> int:
        """This client's requests in flight (SGLang reports none)."""
        return int(self.engine.metrics()["in_flight"])

    def revived(self) -> int:
        return int(self.engine.metrics()["revived_adapters"])


class LostCall(EngineError):
    """A raw `/generate` that SGLang failed as a whole with HTTP 499 (`Request RID was aborted`): 0.5.17 does so
    to a call in flight when generation is paused in `abort` mode (docs/SGLANG.md). The group's samples count
    as aborted with reason `paused` when such a pause overlapped the call (`_send`), else as an error."""


def _http_sample(out: dict[str, Any]) -> Sample:
    meta = out.get("meta_info") or {}
    finish = meta.get("finish_reason") or {}
    kind = finish.get("type") if isinstance(finish, dict) else finish
    reason = finish.get("message") if isinstance(finish, dict) and kind == "abort" else None
    return Sample(str(meta.get("id")), str(kind), meta.get("lora_path"), meta.get("weight_version"), reason)


def make_target(engine: Any, settings: StressSettings) -> tuple[Target, bool]:
    """The target for an engine or URL; True when this function opened the client (and must close it)."""
    owned = isinstance(engine, str)
    if owned:
        engine = HTTPEngine(
            SERVER, engine, timeout_s=settings.request_timeout_s, control_timeout_s=settings.control_timeout_s
        )
    if isinstance(engine, HTTPEngine) and engine.dialect is SGLANG:  # a real SGLang server
        return SGLangTarget(engine, settings), owned
    if isinstance(engine, HTTPEngine):
        return HttpTarget(engine, settings), owned
    if settings.samples == "n":
        raise EngineError("samples='n' (SGLang's n) needs an HTTP target; in-process groups are n requests")
    return InProcess(engine, settings), False
