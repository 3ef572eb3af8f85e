"""Loads are bounded by the load staging area's slots, and a load that cannot start now waits its turn
instead of failing: concurrent hits against a healthy store are all loaded. A hung store still costs
only a bounded wait (queued loads fail when their turn does not come within the load time-out), and
memory the store client may still write into is never handed to another load."""

from __future__ import annotations

import threading

from connector.calls import BoundedCalls
from connector.data import BlockTransfer, RequestLoad
from connector.core.keys import KeyKind
from connector.worker.loader import Loader
from connector.store.staging import StagingArea

OBJECT_BYTES = 1024  # a slot (a multiple of the slot alignment)


class GatedStore:
    """Answers every get once the gate opens (a slow but healthy store): each object is its key."""

    def __init__(self):
        self.gate = threading.Event()
        self.gets = 0

    def get_into(self, keys, regions, lease):
        self.gets += 1
        self.gate.wait(30)
        for key, region in zip(keys, regions, strict=True):
            region.view[: len(key)] = key.encode()
        return [len(key) for key in keys]

    def close(self):
        pass


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def transfer(block_id: int) -> BlockTransfer:
    return BlockTransfer(block_id, KeyKind.BLOCK, 0, 32, bytes(16))


def load(req_id: str, objects: int = 1, first_block: int = 0) -> RequestLoad:
    return RequestLoad(req_id, tuple(transfer(first_block + i) for i in range(objects)))


def loader(store, *, slots=10, threads=2, clock=None):
    written = []
    calls = BoundedCalls("test-load", limit=threads)
    instance = Loader(
        store,
        key_of=lambda t: f"k{t.block_id}",
        header_of=lambda t: None,  # unused: verification is patched out below
        write_block=lambda t, payload: written.append((t.block_id, bytes(payload))),
        timeout_s=10,
        area=StagingArea("load", OBJECT_BYTES, slots),
        calls=calls,
        **({"clock": clock} if clock else {}),
    )
    return instance, calls, written


def finish_all(instance, expected: set[str], rounds: int = 400):
    """vLLM's steps: call finish until every expected load has ended."""
    received, failed = set(), {}
    for _ in range(rounds):
        finished, _ = instance.finish()
        received |= finished.received
        failed.update(finished.failed or {})
        if received >= expected:
            return received, failed
        threading.Event().wait(0.01)
    raise AssertionError(f"loads did not end: {sorted(expected - received)}")


def accept_any(monkeypatch):
    monkeypatch.setattr("connector.worker.loader.verify_object", lambda value, header: memoryview(value))


def test_more_concurrent_hits_than_threads_all_load(monkeypatch):
    accept_any(monkeypatch)
    store = GatedStore()
    instance, calls, written = loader(store, threads=2)
    try:
        for number, name in enumerate(("a", "b", "c", "d", "e")):
            instance.start(load(name, 2, first_block=10 * number))
        finished, counts = instance.finish()
        assert not finished.received, "nothing has answered yet, and nothing failed as busy"
        assert counts.get("loads_queued") == 3
        store.gate.set()
        received, failed = finish_all(instance, {"a", "b", "c", "d", "e"})
        assert failed == {}
        # Each load wrote its own objects into its own blocks (never another waiting load's).
        assert sorted(written) == sorted(
            (block, f"k{block}".encode()) for n in range(5) for block in (10 * n, 10 * n + 1)
        )
    finally:
        store.gate.set()
        calls.shutdown()


def test_bytes_in_flight_stay_within_the_area(monkeypatch):
    accept_any(monkeypatch)
    store = GatedStore()
    instance, calls, _ = loader(store, slots=3, threads=4)
    try:
        instance.start(load("a", 2))
        instance.start(load("b", 2))  # 4 objects would not fit: it waits although threads are free
        assert instance.held_bytes == 2 * OBJECT_BYTES
        store.gate.set()
        received, failed = finish_all(instance, {"a", "b"})
        assert failed == {}
        assert instance.held_bytes == 0
    finally:
        store.gate.set()
        calls.shutdown()


def test_one_load_larger_than_the_area_still_runs_alone(monkeypatch):
    accept_any(monkeypatch)
    store = GatedStore()
    instance, calls, written = loader(store, slots=1)
    try:
        instance.start(load("big", 5))  # a buffer of its own: nothing else is in flight
        instance.start(load("next", first_block=10))  # fits the area
        instance.start(load("big2", 5, first_block=20))  # waits: a buffer of its own only when all is free
        assert instance.held_bytes == 6 * OBJECT_BYTES
        store.gate.set()
        received, failed = finish_all(instance, {"big", "next", "big2"})
        assert failed == {} and len(written) == 11
        assert sorted(written)[:5] == [(block, f"k{block}".encode()) for block in range(5)]
        assert instance.held_bytes == 0 and instance.area.oversize == 2
    finally:
        store.gate.set()
        calls.shutdown()


def test_a_load_larger_than_the_area_whose_buffer_the_host_cannot_give_is_a_miss(monkeypatch):
    """A failed allocation of the buffer of its own fails the load (recomputed), never the engine; the
    next load runs."""
    accept_any(monkeypatch)
    store = GatedStore()
    store.gate.set()
    instance, calls, written = loader(store, slots=1)

    def no_memory(count, given_back=None):
        raise RuntimeError("CUDA error: out of memory (cudaHostAlloc)")

    monkeypatch.setattr(instance.area, "take_oversize", no_memory)
    try:
        instance.start(load("big", 5))  # does not raise
        instance.start(load("next", first_block=10))
        received, failed = finish_all(instance, {"big", "next"})
        assert failed["big"][1].cause == "no_memory" and "next" not in failed
        assert written == [(10, b"k10")] and instance.held_bytes == 0
    finally:
        calls.shutdown()


def test_the_buffer_of_a_load_larger_than_the_area_is_allocated_off_the_engine_thread(monkeypatch):
    """Pinned on a GPU host, a large buffer takes long to allocate: never on the engine's thread."""
    accept_any(monkeypatch)
    store = GatedStore()
    instance, calls, written = loader(store, slots=1)
    threads = []
    take_oversize = instance.area.take_oversize

    def recorded(count, given_back):
        threads.append(threading.current_thread())
        return take_oversize(count, given_back)

    monkeypatch.setattr(instance.area, "take_oversize", recorded)
    try:
        instance.start(load("big", 3))
        instance.start(load("big2", 3, first_block=10))  # waits for the first one's buffer to be given back
        assert instance.held_bytes == 3 * OBJECT_BYTES
        store.gate.set()
        received, failed = finish_all(instance, {"big", "big2"})
        assert failed == {} and len(written) == 6 and instance.held_bytes == 0
        assert len(threads) == 2 and threading.main_thread() not in threads
    finally:
        store.gate.set()
        calls.shutdown()


def test_a_hung_store_fails_started_and_waiting_loads_after_the_time_out_and_holds_their_bytes(monkeypatch):
    accept_any(monkeypatch)
    store, clock = GatedStore(), Clock()
    instance, calls, written = loader(store, threads=1, clock=clock)
    try:
        instance.start(load("stuck"))
        instance.start(load("waiting"))
        assert instance.finish()[0].received == frozenset()
        clock.now += 11
        finished, counts = instance.finish()
        assert finished.received == {"stuck", "waiting"}
        assert {name: failure.cause for name, (_, failure) in finished.failed.items()} == {
            "stuck": "timeout",
            "waiting": "no_turn",
        }
        assert instance.held_bytes == OBJECT_BYTES, "a fetch still stuck in the client keeps its bytes"
        store.gate.set()
        for _ in range(400):
            if instance.held_bytes == 0:
                break
            threading.Event().wait(0.01)
        assert instance.held_bytes == 0
        assert written == [], "a late answer writes nothing"
    finally:
        store.gate.set()
        calls.shutdown()


def test_a_load_the_store_time_out_gave_up_on_keeps_its_slots_until_the_client_returns(monkeypatch):
    """The store's time-out stops waiting, not the client's call: its slots must not go to the next
    load while the client may still write into them (that load would read another object's bytes)."""
    from connector.config import KVToolConfig
    from connector.store.store import TimedStore

    accept_any(monkeypatch)
    backend = GatedStore()
    timed = TimedStore(backend, KVToolConfig(master_server_address="127.0.0.1:1", load_timeout_s=0.05))
    instance, calls, written = loader(timed, slots=1)
    try:
        instance.start(load("late"))
        received, failed = finish_all(instance, {"late"})
        assert failed["late"][1].cause == "store_error" and "timed out" in failed["late"][1].detail
        assert instance.held_bytes == OBJECT_BYTES, "the client may still write into the slot"
        instance.start(load("next", first_block=7))
        assert backend.gets == 1, "the next load waits for the slot"
        backend.gate.set()
        received, failed = finish_all(instance, {"next"})
        assert failed == {} and written == [(7, b"k7")]
        assert instance.held_bytes == 0
    finally:
        backend.gate.set()
        calls.shutdown()
        timed.close()


def test_an_idle_step_waits_for_the_fetch_in_flight_and_reports_it_received(monkeypatch):
    """After a step that computed nothing, finish waits for the fetch instead of returning at once:
    vLLM learns of the load in this step, not after more empty steps."""
    accept_any(monkeypatch)
    store = GatedStore()
    instance, calls, written = loader(store)
    try:
        instance.start(load("a"))
        finished, _ = instance.finish()  # a step that computed tokens does not wait
        assert not finished.received
        threading.Timer(0.05, store.gate.set).start()
        finished, _ = instance.finish(wait_s=30)  # ends when the fetch answers, long before 30 s
        assert finished.received == {"a"} and not finished.failed
        assert written == [(0, b"k0")]
    finally:
        store.gate.set()
        calls.shutdown()


def test_the_copy_runs_off_the_engine_thread_and_one_begun_before_the_deadline_is_received(monkeypatch):
    """The fetch thread copies into the KV cache; a load whose copy began before its deadline is waited
    for and reported received (its blocks hold the loaded KV), never failed while bytes still land."""
    accept_any(monkeypatch)
    store, clock = GatedStore(), Clock()
    copying, release, threads = threading.Event(), threading.Event(), []

    def write_block(transfer, payload):
        threads.append(threading.get_ident())
        copying.set()
        release.wait(30)

    calls = BoundedCalls("test-load", limit=1)
    instance = Loader(
        store,
        key_of=lambda t: f"k{t.block_id}",
        header_of=lambda t: None,
        write_block=write_block,
        timeout_s=10,
        area=StagingArea("load", OBJECT_BYTES, 4),
        calls=calls,
        clock=clock,
    )
    try:
        instance.start(load("a"))
        store.gate.set()
        assert copying.wait(30)
        clock.now += 11  # past the deadline, with the copy under way
        ended: list = []
        finisher = threading.Thread(target=lambda: ended.append(instance.finish()[0]))
        finisher.start()
        finisher.join(0.05)
        assert not ended, "finish waits for the copy under way instead of failing the load"
        release.set()
        finisher.join(30)
        assert ended[0].received == {"a"} and not ended[0].failed
        assert threads and threading.get_ident() not in threads
    finally:
        store.gate.set()
        release.set()
        calls.shutdown()


def test_a_load_slower_than_recomputing_its_tokens_is_abandoned_as_a_miss(monkeypatch):
    """The scheduler priced the load's tokens' recompute: a load still running past that (at least the
    floor) fails as ``slow``, its request recomputes, and the cost model hears how slow it was; a load
    not priced keeps the load time-out."""
    from connector.worker.loader import SLOW_LOAD_FLOOR_S

    accept_any(monkeypatch)
    store, clock = GatedStore(), Clock()
    instance, calls, written = loader(store, clock=clock)
    priced_s = SLOW_LOAD_FLOOR_S + 1.0  # over the floor, under the 10 s time-out
    try:
        instance.start(RequestLoad("priced", (transfer(1),), recompute_s=priced_s))
        instance.start(RequestLoad("cheap", (transfer(2),), recompute_s=0.001))  # the floor holds
        instance.start(load("unpriced", first_block=3))
        clock.now += SLOW_LOAD_FLOOR_S + 0.01
        finished, counts = instance.finish()
        assert set(finished.failed) == {"cheap"} and counts["load_failures_slow"] == 1
        clock.now += 1.0
        finished, counts = instance.finish()
        assert set(finished.failed) == {"priced"} and finished.failed["priced"][1].cause == "slow"
        assert f"{priced_s * 1e3:.0f} ms" in finished.failed["priced"][1].detail
        assert [sample[1] for sample in instance.samples] == [SLOW_LOAD_FLOOR_S, priced_s]
        store.gate.set()
        received, failed = finish_all(instance, {"unpriced"})
        assert "unpriced" not in failed and all(block == 3 for block, _ in written)
    finally:
        store.gate.set()
        calls.shutdown()
