"""Fault injection for resume tests: `LORA_RL_FAULT=phase:step[:mode]`.

`phase` is a step phase (`rollout`, `score`, `train`, `publish`,
`sync`) or a background write (`checkpoint`; `publish` fires in
the version's upload, with its files written and its manifest not), `step` the
step number, `mode` one of `raise` (default: raise `InjectedFault`), `kill`
(SIGKILL this process, as `kill -9` would) or `hang` (sleep up to an hour, so a
test can kill the worker). Several faults
are separated by commas. A fault fires once per run: a marker object
`<store>/<run>/faults/<phase>-<step>` records that it fired, so a retried
flow run goes past it.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Protocol

ENV = "LORA_RL_FAULT"


class InjectedFault(RuntimeError):
    """Raised by an injected `raise` fault."""


def parse_faults(spec: str) -> list[tuple[str, int, str]]:
    """Parse `phase:step[:mode],...` into (phase, step, mode) tuples (ValueError on bad input)."""
    faults = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        parts = item.split(":")
        if len(parts) not in (2, 3) or not parts[1].isdigit():
            raise ValueError(f"{ENV}={spec!r}: expected phase:step[:raise|kill|hang], e.g. train:3")
        mode = parts[2] if len(parts) == 3 else "raise"
        if mode not in ("raise", "kill", "hang"):
            raise ValueError(f"{ENV}={spec!r}: mode {mode!r} is not raise, kill or hang")
        faults.append((parts[0], int(parts[1]), mode))
    return faults


class Markers(Protocol):
    """Where fired faults are recorded: `lora_rl_core.run.rundir.RunDir`."""

    def mark(self, name: str, data: bytes = b"") -> bool:
        """Create marker `name` unless it exists; True if this call created it."""
        ...


def maybe_fail(phase: str, step: int, markers: Markers) -> None:
    """Fire the fault configured for (`phase`, `step`) if any and not fired before in this run.

    Args:
        markers: the run's files; the marker `faults/<phase>-NNNNNN` records that the fault fired.
    """
    spec = os.environ.get(ENV, "")
    matches = [mode for p, s, mode in parse_faults(spec) if p == phase and s == step] if spec else []
    if not matches or not markers.mark(f"faults/{phase}-{step:06d}", matches[0].encode()):
        return
    if matches[0] == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if matches[0] == "hang":
        time.sleep(3600)
    raise InjectedFault(f"injected fault at {phase} step {step} ({ENV})")
