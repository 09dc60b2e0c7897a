"""An SGLang server of a version the client does not know is refused in one line when the engine is built
(`Dialect.versions`, `connect`), not at a request mid-run; our own server is not asked."""

from __future__ import annotations

import pytest

from lora_rl_core.config import load_config
from lora_rl_core.engines.records import EngineInputs
from lora_rl_core.engines.remote import SERVER, SGLANG, HTTPEngine
from lora_rl_core.engines.remote.connect import connect
from lora_rl_core.engines.serve.app import create_app
from lora_rl_core.errors import EngineError
from lora_rl_testing.servers import serve_app_in_thread
from lora_rl_testing.sglang_fake import SGLangFakeServer

pytestmark = pytest.mark.slow  # uvicorn in a thread


@pytest.fixture(scope="module", autouse=True)
def prefect_harness():
    """No Prefect server is needed here: overrides the package's session-wide harness for this module."""
    yield


def _inputs(url: str, kind: str = "sglang") -> EngineInputs:
    cfg = load_config(None, [f"engine.type={kind}", f"engine.urls=[{url}]"])
    return EngineInputs(cfg.engine, cfg.model, cfg.lora)


@pytest.mark.parametrize(
    ("version", "said"),
    [
        ("0.6.1", "SGLang 0.6.1"),
        ("0.5.12", "SGLang 0.5.12"),
        ("nightly", "SGLang nightly"),
        (None, "an SGLang that does not say its version"),
    ],
)
def test_an_unknown_sglang_version_is_refused_when_the_engine_is_built(backend, monkeypatch, version, said):
    closed, close = [], HTTPEngine.close
    monkeypatch.setattr(HTTPEngine, "close", lambda self: closed.append(self.url) or close(self))
    with serve_app_in_thread(SGLangFakeServer(backend, served_model_name="tiny", version=version).app()) as url:
        with pytest.raises(EngineError) as err:
            connect(SGLANG, _inputs(url))
    message = str(err.value)
    assert message.startswith(f"{said} at {url} is not a version this client knows (>=0.5.17,<0.5.24")
    assert "pip install 'sglang>=0.5.17,<0.5.24'" in message and "\n" not in message
    assert closed == [url]  # the client made for it is closed again


@pytest.mark.parametrize("version", ["0.5.17", "0.5.23", "0.5.23.post1"])
def test_a_known_sglang_version_connects(backend, version):
    with serve_app_in_thread(SGLangFakeServer(backend, served_model_name="tiny", version=version).app()) as url:
        with connect(SGLANG, _inputs(url)) as built:
            assert built.engine.server_version() == version


def test_our_server_is_not_asked_its_version(backend, monkeypatch):
    """`lora-rl serve` has no `/server_info`: the `server` kind connects without asking (`SERVER.versions`) and
    its calls go out."""
    asked, version = [], HTTPEngine.server_version
    monkeypatch.setattr(HTTPEngine, "server_version", lambda self: asked.append(self.url) or version(self))
    with serve_app_in_thread(create_app(backend, served_model_name="tiny")) as url:
        with connect(SERVER, _inputs(url, "server")) as built:
            assert built.engine.list_adapters() == {} and asked == []
            assert built.engine.server_version() is None  # 404 on both paths: it says none


def test_a_server_unreachable_at_connect_is_asked_before_the_first_call(monkeypatch):
    """A subscriber's engines may be down when it starts: `connect` builds the client, and its first call asks
    the version first (and refuses an unknown one) instead of sending the call."""
    from lora_rl_core.errors import EngineUnavailable

    answers: list = [EngineUnavailable("down"), "0.6.0"]

    def version(self):
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    monkeypatch.setattr(HTTPEngine, "server_version", version)
    sent = []
    monkeypatch.setattr(HTTPEngine, "list_adapters", lambda self: sent.append(self._call("GET", "/v1/models")))
    with connect(SGLANG, _inputs("http://127.0.0.1:1")) as built:  # nothing listens: built all the same
        with pytest.raises(EngineError, match=r"^SGLang 0.6.0 at http://127.0.0.1:1 is not a version this client"):
            built.engine.list_adapters()
    assert answers == [] and sent == []
