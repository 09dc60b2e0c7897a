"""Adapter pool without a model: eviction order (LRU, FIFO), pinning, usage counts, unload deadlines."""

from __future__ import annotations

import threading
import time

import pytest

from lora_rl_core.engines.embedded.pool import AdapterPool
from lora_rl_core.errors import EngineError


def load(pool: AdapterPool, name: str, *, pinned: bool = False, keep: tuple[str, ...] = ()) -> list[str]:
    """What the engine does on a load: make room (returns the victims), then register as resident."""
    pool.check_new(name, pinned=pinned)
    victims = pool.evict_for(1, keep=keep)
    pool.register(name, source="tensors", pinned=pinned)
    return victims


def use(pool: AdapterPool, name: str, request_id: str = "r") -> None:
    """One request admitted with `name` and finished."""
    pool.acquire(name, request_id)
    pool.release(name, request_id)


def resident(pool: AdapterPool) -> list[str]:
    return sorted(n for n, info in pool.snapshot().items() if info["resident"])


@pytest.mark.parametrize(("policy", "victim"), [("lru", "b"), ("fifo", "a")])
def test_eviction_order_follows_the_policy(policy, victim):
    pool = AdapterPool(max_loaded=2, policy=policy)
    load(pool, "a")
    load(pool, "b")
    use(pool, "a")  # a: loaded first, used last
    assert load(pool, "c") == [victim]
    assert resident(pool) == sorted({"a", "b", "c"} - {victim})
    assert pool.snapshot()[victim]["evictions"] == 1 and victim in pool.snapshot()  # still known


def test_lru_and_fifo_differ_over_a_longer_sequence():
    orders = {}
    for policy in ("lru", "fifo"):
        pool = AdapterPool(max_loaded=2, policy=policy)
        evicted = load(pool, "a") + load(pool, "b")
        use(pool, "a")
        evicted += load(pool, "c")
        use(pool, "c")
        if "a" in resident(pool):
            use(pool, "a")
        evicted += load(pool, "d")
        orders[policy] = evicted
    assert orders == {"lru": ["b", "c"], "fifo": ["a", "b"]}


def test_pinned_adapter_survives_pressure_and_held_ones_are_not_evicted():
    pool = AdapterPool(max_loaded=3, policy="lru", max_pinned=1)
    load(pool, "p", pinned=True)
    load(pool, "a")
    pool.acquire("a", "r1")  # in flight
    victims = [v for name in ("b", "c", "d") for v in load(pool, name)]
    assert "p" not in victims and "a" not in victims
    assert resident(pool) == ["a", "d", "p"]
    assert pool.snapshot()["p"]["evictions"] == 0


def test_full_pool_names_what_holds_it():
    pool = AdapterPool(max_loaded=2, max_pinned=1)
    load(pool, "p", pinned=True)
    load(pool, "a")
    pool.acquire("a", "r1")
    with pytest.raises(EngineError, match="pool full.*'p': 'pinned'.*'a': '1 in flight'"):
        load(pool, "b")


def test_pinned_cap_is_max_loras_per_batch_minus_one_and_below_max_loaded():
    pool = AdapterPool(max_pinned=1)  # max_loras_per_batch = 2
    load(pool, "p1", pinned=True)
    with pytest.raises(EngineError, match="cannot pin 'p2'.*at most 1"):
        load(pool, "p2", pinned=True)
    assert AdapterPool(max_loaded=2, max_pinned=7).max_pinned == 1


def test_duplicate_and_draining_names_are_refused():
    pool = AdapterPool()
    load(pool, "a")
    with pytest.raises(EngineError, match="already loaded"):
        load(pool, "a")
    pool.acquire("a", "r1")
    pool.unregister("a")
    with pytest.raises(EngineError, match="being unloaded"):
        load(pool, "a")


def test_unknown_adapter_gets_sglang_message():
    pool = AdapterPool()
    load(pool, "known")
    sglang = r"Got LoRA adapter that has never been loaded: x\nAll loaded adapters: \['known'\]"
    with pytest.raises(EngineError, match=sglang):
        pool.acquire("x", "r1")


def test_usage_is_released_exactly_once_per_request():
    pool = AdapterPool()
    load(pool, "a")
    pool.acquire("a", "r1")
    pool.acquire("a", "r2")
    assert pool.in_flight("a") == 2 and pool.holders("a") == ["r1", "r2"]
    assert pool.release("a", "r1") is True
    assert pool.release("a", "r1") is False  # a second release of the same request is a no-op
    assert pool.in_flight("a") == 1
    assert pool.release("a", "r2") and pool.in_flight("a") == 0


def test_unload_waits_for_the_holder_then_succeeds():
    pool = AdapterPool()
    load(pool, "a")
    pool.acquire("a", "r1")
    pool.unregister("a")
    assert pool.get("a") is None and pool.reapable() == []
    result = {}
    waiter = threading.Thread(target=lambda: result.update(ok=pool.wait_unused("a", 5.0)))
    waiter.start()
    time.sleep(0.05)
    assert waiter.is_alive()
    pool.release("a", "r1")
    waiter.join(timeout=2.0)
    assert not waiter.is_alive() and result == {"ok": True}
    assert pool.reapable() == ["a"]
    pool.forget("a")
    assert pool.entry("a") is None


def test_unload_deadline_reports_the_holders():
    pool = AdapterPool()
    load(pool, "a")
    pool.acquire("a", "req-7")
    pool.unregister("a")
    start = time.monotonic()
    assert pool.wait_unused("a", 0.05) is False
    assert time.monotonic() - start < 1.0
    assert pool.holders("a") == ["req-7"]
    with pytest.raises(EngineError, match="has never been loaded: a"):
        pool.acquire("a", "req-8")  # unregistered: new requests fail like unknown ones


def test_a_load_proceeds_while_an_unload_waits():
    pool = AdapterPool()
    load(pool, "a")
    pool.acquire("a", "r1")
    pool.unregister("a")
    waiter = threading.Thread(target=pool.wait_unused, args=("a", 5.0))
    waiter.start()
    time.sleep(0.02)
    loader = threading.Thread(target=load, args=(pool, "b"))
    loader.start()
    loader.join(timeout=1.0)
    assert not loader.is_alive() and pool.get("b") is not None
    assert waiter.is_alive()
    pool.release("a", "r1")
    waiter.join(timeout=2.0)
    assert not waiter.is_alive()


def test_idle_draining_adapters_are_evicted_first():
    pool = AdapterPool(max_loaded=2)
    load(pool, "a")
    load(pool, "b")
    use(pool, "a")
    pool.unregister("a")  # idle, draining: freeing it costs nothing
    assert pool.evict_for(1) == ["a"]
    assert pool.snapshot()["b"]["evictions"] == 0


def test_bad_pool_arguments():
    """An unknown eviction policy is refused once, by the engine config (`EngineConfig.eviction_policy`)."""
    from lora_rl_core.config import config_from_dict
    from lora_rl_core.errors import ConfigError

    with pytest.raises(ConfigError, match="engine.eviction_policy"):
        config_from_dict({"engine": {"eviction_policy": "random"}})
    with pytest.raises(ValueError):
        AdapterPool(max_loaded=0)
