"""This process's connection to Ray, shared by everything a run puts on Ray (engine replicas, trainer ranks).

`acquire_ray()` joins the cluster of `RAY_ADDRESS` when set, else (Ray's own rule, `ray.init()`) the cluster
that `ray start` runs on this machine, else starts a local one, unless this process is connected already;
`release_ray()` gives one use back. Ray is shut down when the last use is given back, and only when
`acquire_ray` connected this process: a caller that ran `ray.init()` itself (a test, a notebook) keeps its
connection. So the engines and the trainer of one run may start and close in any order.
"""

from __future__ import annotations

import os
import threading

_lock = threading.Lock()
_uses = 0
_connected_here = False


def acquire_ray() -> None:
    """Connect to Ray for one use (`RAY_ADDRESS`, else this machine's cluster, else a new local one); a no-op
    connect when connected."""
    global _uses, _connected_here
    import ray

    with _lock:
        if not ray.is_initialized():
            ray.init(address=os.environ.get("RAY_ADDRESS"), include_dashboard=False, log_to_driver=False)
            _connected_here = True
        _uses += 1


def release_ray() -> None:
    """Give one use back; the last one disconnects (and so stops a local cluster) if `acquire_ray` connected."""
    global _uses, _connected_here
    import ray

    with _lock:
        _uses = max(0, _uses - 1)
        if _uses == 0 and _connected_here:
            _connected_here = False
            if ray.is_initialized():
                ray.shutdown()
