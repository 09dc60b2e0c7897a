"""Our engine server in a thread of the test (or benchmark) process: `serve_in_thread(engine)` yields its URL."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


@contextmanager
def serve_in_thread(engine: Any, *, start_timeout_s: float = 15.0, **app_options: Any) -> Iterator[str]:
    """Serve `engine` with our engine server (uvicorn, in a daemon thread) on a free 127.0.0.1 port.

    Args:
        engine: the engine to serve (normally an `EmbeddedEngine`).
        start_timeout_s: how long to wait for uvicorn to start (s).
        app_options: `create_app` arguments (default `served_model_name="stress"`).

    Yields:
        The server's URL, e.g. `http://127.0.0.1:40123`; the server stops on exit.

    Raises:
        RuntimeError: uvicorn did not start in time.
    """
    from lora_rl_core.engines.serve.app import create_app

    app = create_app(engine, **{"served_model_name": "stress", **app_options})
    with serve_app_in_thread(app, start_timeout_s=start_timeout_s) as url:
        yield url


@contextmanager
def serve_app_in_thread(app: Any, *, start_timeout_s: float = 15.0) -> Iterator[str]:
    """Serve an ASGI `app` with uvicorn in a daemon thread on a free 127.0.0.1 port; yields its URL and
    stops the server on exit. RuntimeError when uvicorn did not start within `start_timeout_s` seconds."""
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="stress-server", daemon=True)
    thread.start()
    deadline = time.monotonic() + start_timeout_s
    try:
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the engine server did not start")
            time.sleep(0.02)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()
