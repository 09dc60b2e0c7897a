"""Orderly shutdown of the `lora-rl` commands on SIGINT, SIGTERM or SIGHUP.

Python's default SIGTERM action ends the process on the spot: no `finally`, no atexit hook. The trainer
worker processes, the engine's worker thread and Prefect's ephemeral API server (a uvicorn subprocess that
Prefect starts when no `PREFECT_API_URL` is set and stops from an atexit hook) were left running.

`install()` (called by `cli.main.main`) turns the first of these signals into `Interrupted`, raised in the
main thread wherever it is, so every `finally` on the way out runs: the flow's `close_session` (trainer
workers, engine), the engine server's `engine.close()`, the subscriber's `engines.close()`. `main` then
calls `exit_interrupted()`: stop Prefect's ephemeral server, print one line
`lora-rl: interrupted by SIGTERM; stopped ...` to stderr, exit 128 + the signal number (130 for SIGINT,
143 for SIGTERM). Signals that arrive during that shutdown are ignored (every step of it has a time
limit); SIGKILL still ends the process (and `cli.reaper` what it started).

Handlers of others that run first hand the signal back to ours: inside a flow run Prefect's SIGTERM
handler raises its `TerminationSignal` (the run is marked Crashed, the flow's `finally` runs), then
restores our handler and re-sends the signal; uvicorn (`lora-rl serve`) shuts its server down gracefully,
restores our handler and re-raises the signal. `quiet_console_logs` keeps the console log lines of an
interrupt (Prefect's "Crash detected!") off the terminal: the one line says what happened, and Prefect's
API log handler still records the crash for the UI. `isolate_prefect_server` starts the ephemeral server
in a session of its own, so that a terminal's Ctrl-C reaches lora-rl only, as it does not the trainer
workers (they ignore SIGINT).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import signal
import subprocess
import sys
from collections.abc import Callable
from typing import Any, NoReturn, TypeVar

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)  # SIGHUP: the terminal closed
F = TypeVar("F", bound=Callable[..., Any])


class Interrupted(BaseException):
    """SIGINT, SIGTERM or SIGHUP arrived. A BaseException, as KeyboardInterrupt: `except Exception` lets it through."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class _State:
    signum: int | None = None  # the first signal received
    stopped: str = ""  # what the running command stops on the way out, for the message


_state = _State()


def install() -> None:
    """Route SIGINT, SIGTERM and SIGHUP to `Interrupted` (main thread only; elsewhere a no-op)."""
    _state.signum, _state.stopped = None, ""
    try:
        for sig in SIGNALS:
            signal.signal(sig, _on_signal)
    except ValueError:  # not the main thread (e.g. a test runner's worker thread): keep the defaults
        pass


def stops(what: str) -> Callable[[F], F]:
    """Decorate a command with what an interrupt of it stops, e.g. `"trainer workers, engine and Prefect server"`."""

    def decorate(command: F) -> F:
        @functools.wraps(command)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            _state.stopped = what
            return command(*args, **kwargs)

        return wrapper  # type: ignore[return-value]

    return decorate


def signal_of(exc: BaseException) -> int | None:
    """The signal behind `exc`: `Interrupted` or Prefect's `TerminationSignal`, also as the exception that
    `exc` was raised while handling (Prefect's task engine, when SIGTERM lands while it sets up a task run,
    fails its crash handling with `ValueError: Task run is not set` and never re-sends the signal to our
    handler), or any exception (even `SystemExit`) that ends the command after a signal arrived; None when
    no signal was received."""
    signum = _signal_in_chain(exc)
    return signum if signum is not None else _state.signum


def exit_interrupted(signum: int) -> NoReturn:
    """Stop Prefect's ephemeral server, print the one line, exit with 128 + `signum`."""
    _state.signum = _state.signum or signum  # later signals are ignored from here on
    stop_prefect_servers()
    stopped = f"; stopped {_state.stopped}" if _state.stopped else ""
    print(f"lora-rl: interrupted by {signal.Signals(signum).name}{stopped}", file=sys.stderr, flush=True)
    sys.exit(128 + signum)


def isolate_prefect_server() -> None:
    """Have Prefect start its ephemeral API server (when no `PREFECT_API_URL` is set) in a session of its
    own, as the trainer workers ignore SIGINT: a terminal's Ctrl-C, sent to the whole foreground process
    group, then reaches lora-rl only, and the server stays up while the run records its crash (otherwise it
    shuts down at once, printing tracebacks, and each API call of the crash handling retries against it for
    about a minute); `exit_interrupted` stops it afterwards (and Prefect's atexit hook at any other exit).

    Registers a `SubprocessASGIServer` subclass as Prefect's default instance (what
    `prefect.testing.utilities.prefect_test_harness` does with its test server); a no-op when an API URL is
    set or a default instance exists.
    """
    from prefect.settings import PREFECT_API_URL

    if PREFECT_API_URL.value():
        return
    from prefect.server.api.server import SubprocessASGIServer

    class OwnSessionServer(SubprocessASGIServer):
        def _run_uvicorn_command(self) -> subprocess.Popen[Any]:
            popen = subprocess.Popen  # Prefect's own command, started with start_new_session=True
            subprocess.Popen = functools.partial(popen, start_new_session=True)  # type: ignore[misc,assignment]
            try:
                return super()._run_uvicorn_command()
            finally:
                subprocess.Popen = popen  # type: ignore[misc]

    OwnSessionServer()  # the instance for port None, which Prefect's client starts; an existing one is kept


def stop_prefect_servers() -> int:
    """Stop the ephemeral Prefect API servers this process started (what Prefect's atexit hook does); how many."""
    module = sys.modules.get("prefect.server.api.server")
    if module is None:  # Prefect's server code never loaded: none was started
        return 0
    servers = [s for s in list(module.SubprocessASGIServer._instances.values()) if s.server_process is not None]
    if servers:
        _flush_prefect_logs()
    for server in servers:
        server.stop()  # SIGTERM, SIGKILL after 5 s, reaped
    return len(servers)


def _flush_prefect_logs() -> None:
    """Send the run logs (and events) Prefect has queued while its server still runs (5 s at most): at a
    normal exit its thread-exit hooks do this before the atexit hook stops the server."""
    handlers = sys.modules.get("prefect.logging.handlers")
    if handlers is not None:
        with contextlib.suppress(Exception):
            handlers.APILogHandler().flush()


def quiet_console_logs() -> None:
    """Keep console log lines about an interrupt off the terminal (the one line reports it).

    Adds a filter to every console handler (a stream handler that is no file) now configured: it drops
    records logged while an `Interrupted` or Prefect's `TerminationSignal` is being handled (Prefect's
    "Crash detected!" lines: its SIGTERM handler runs before ours), and every record once a signal arrived.
    Prefect's API log handler is no console handler: the UI still shows the crash. Call it after the
    libraries whose handlers matter have configured logging (Prefect does on import).
    """
    loggers = [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]
    for logger in loggers:
        for handler in getattr(logger, "handlers", ()):
            console = isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler)
            if console and _FILTER not in handler.filters:
                handler.addFilter(_FILTER)
    if logging.lastResort is not None and _FILTER not in logging.lastResort.filters:
        logging.lastResort.addFilter(_FILTER)


def _on_signal(signum: int, frame: Any) -> None:
    if _state.signum is not None:
        return  # already shutting down: let it finish
    _state.signum = signum
    quiet_console_logs()
    raise Interrupted(signum)


def _signal_in_chain(exc: BaseException | None) -> int | None:
    """The signal of `exc`, or of an exception it was raised while handling, when that is an interrupt
    (`Interrupted`, or Prefect's `TerminationSignal` with its `signal`); None otherwise."""
    seen = 0
    while exc is not None and seen < 20:
        if isinstance(exc, Interrupted):
            return exc.signum
        signum = getattr(exc, "signal", None)
        if type(exc).__name__ == "TerminationSignal" and isinstance(signum, int) and signum in SIGNALS:
            return signum
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return None


def _is_interrupt(exc: BaseException | None) -> bool:
    """`exc`, or an exception it was raised while handling, is an interrupt."""
    return _signal_in_chain(exc) is not None


class _InterruptFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if _state.signum is not None:
            return False
        handled = record.exc_info[1] if record.exc_info else None
        return not (_is_interrupt(sys.exc_info()[1]) or _is_interrupt(handled))


_FILTER = _InterruptFilter()
