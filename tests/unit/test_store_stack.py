"""The store stack: time-outs and fault injection wrap any backend behind the store interface."""

from __future__ import annotations

import dataclasses

import json
import threading

import pytest

from connector.calls import StoreBusy, StoreTimeout
from connector.config import load_config
from connector.store.faults import FaultyStore
from connector.store.breaker import CircuitBreaker, GuardedStore
from connector.worker.loader import LOAD_THREADS
from connector.store.staging import StagingArea
from connector.store.instrumented import InstrumentedStore
from connector.store.latestore import LateStore
from connector.store.backends import BACKENDS, DEFAULT_BACKEND
from connector.store.store import PutOutcome, StoreError, TimedStore
from connector.store.stack import WORKER_STORE_CALLS, breaker_policy, open_store_stack

from .scripted_store import ScriptedStore


class HangingStore(ScriptedStore):
    def __init__(self):
        super().__init__()
        self.release = threading.Event()

    def exists(self, keys):
        self.release.wait()
        return super().exists(keys)


def test_a_hung_backend_call_is_a_timeout_and_hung_calls_never_queue_others():
    backend = HangingStore()
    store = TimedStore(
        backend, load_config({"master_server_address": "127.0.0.1:1", "lookup_timeout_s": 0.01}), limit=2
    )
    try:
        for _ in range(2):
            with pytest.raises(StoreTimeout):
                store.exists(["k"])
        with pytest.raises(StoreBusy):
            store.exists(["k"])  # both threads are held by hung calls: refused at once
        assert store.get([]) == [] and store.exists([]) == []  # nothing to ask: no call at all
    finally:
        backend.release.set()
        store.close()


def test_a_busy_healthy_store_takes_every_worker_call_at_once_and_keeps_the_breaker_closed():
    """Every fetch thread transferring and the put thread's call beside them: a worker's stack takes them
    all (with four slots the put was refused, ``StoreBusy``, and that opened the breaker)."""

    class Transferring(ScriptedStore):
        def __init__(self):
            super().__init__()
            self.release, self.started = threading.Event(), threading.Semaphore(0)

        def get_into(self, keys, regions, lease):
            self.started.release()
            self.release.wait()
            return [len(region.view) for region in regions]

        def put_from(self, items, lease):
            return [PutOutcome.STORED] * len(items)

    backend, breaker = Transferring(), CircuitBreaker()
    config = load_config({"master_server_address": "127.0.0.1:1", "load_timeout_s": 30, "save_timeout_s": 30})
    store = GuardedStore(TimedStore(backend, config, limit=WORKER_STORE_CALLS), breaker, "worker")
    area = StagingArea("test", 64, LOAD_THREADS + 1)
    leases = [area.take(1) for _ in range(LOAD_THREADS + 1)]
    loads = [threading.Thread(target=store.get_into, args=(["k"], [lease.region(0)], lease)) for lease in leases[:-1]]
    try:
        for load in loads:
            load.start()
        for _ in loads:
            assert backend.started.acquire(timeout=10)  # every fetch thread is inside its transfer
        saved = leases[-1]
        assert store.put_from([("a save", saved.region(0))], saved) == [PutOutcome.STORED]
        assert not breaker.is_open
    finally:
        backend.release.set()
        for load in loads:
            load.join()
        store._store.close()  # noqa: SLF001 - the timed store under the breaker
    assert not breaker.is_open


def test_closing_leaves_the_client_open_under_a_call_that_has_not_returned(monkeypatch):
    """Closing the client library under a call still running in it could crash the engine's process."""
    from connector.store import store as module

    monkeypatch.setattr(module, "CLOSE_WAIT_S", 0.01)

    class Closing(HangingStore):
        closed = 0

        def close(self):
            self.closed += 1

    backend = Closing()
    store = TimedStore(backend, load_config({"master_server_address": "127.0.0.1:1", "lookup_timeout_s": 0.01}))
    with pytest.raises(StoreTimeout):
        store.exists(["k"])
    store.close()
    assert backend.closed == 0
    backend.release.set()  # the call returns: a store whose calls all returned is closed
    idle = Closing()
    idle.release.set()
    other = TimedStore(idle, load_config({"master_server_address": "127.0.0.1:1"}))
    assert other.exists(["k"]) == [False]
    other.close()
    assert idle.closed == 1


def test_faults_wrap_the_interface(tmp_path):
    backend = ScriptedStore()
    backend.objects["kvtool/2/ns/0/b/32/aa"] = b"0123456789"
    plan = tmp_path / "faults.json"
    store = FaultyStore(backend, str(plan))
    assert store.get(["kvtool/2/ns/0/b/32/aa"]) == [b"0123456789"]  # no plan file: no faults
    plan.write_text(json.dumps({"corrupt_get": "flip", "put_outcome": "no_space", "put_kinds": ["t"]}))
    assert store.get(["kvtool/2/ns/0/b/32/aa"]) == [b"0123456788"]
    assert store.put("kvtool/2/ns/0/t/20/bb", b"x") is PutOutcome.NO_SPACE
    assert store.put("kvtool/2/ns/0/b/64/cc", b"x") is PutOutcome.STORED
    plan.write_text("{not json")  # a half-written plan injects nothing
    assert store.get(["kvtool/2/ns/0/b/32/aa"]) == [b"0123456789"]


def test_faults_wrap_the_zero_copy_batches_too(tmp_path):
    from connector.store.staging import StagingArea

    backend = ScriptedStore()
    backend.objects["kvtool/2/ns/0/b/32/aa"] = bytes(range(32))
    plan = tmp_path / "faults.json"
    store = FaultyStore(backend, str(plan))
    area = StagingArea("test", 64, 2)
    lease = area.take(2)
    keys = ["kvtool/2/ns/0/b/32/aa", "kvtool/2/ns/0/p/40/aa"]

    def read():
        return store.get_into(keys, [lease.region(0), lease.region(1)], lease)

    assert read()[0] == 32 and bytes(lease.region(0, 32).view) == bytes(range(32))
    plan.write_text(json.dumps({"corrupt_get": "truncate"}))
    assert read()[0] == 16  # what a torn read reports; the object check rejects it
    plan.write_text(json.dumps({"corrupt_get": "flip", "get_kinds": ["b"]}))
    assert read()[0] == 32 and lease.region(0, 32).view[31] == 30
    plan.write_text(json.dumps({"corrupt_get": "flip", "get_namespaces": ["other"]}))  # another TP rank's
    assert read()[0] == 32 and lease.region(0, 32).view[31] == 31
    plan.write_text(json.dumps({"corrupt_get": "flip", "get_namespaces": ["ns"]}))
    assert read()[0] == 32 and lease.region(0, 32).view[31] == 30
    plan.write_text(json.dumps({"fail_get": True}))
    assert all(count <= 0 for count in read())
    plan.write_text(json.dumps({"put_outcome": "no_space", "put_kinds": ["t"]}))
    items = [("kvtool/2/ns/0/t/20/bb", lease.region(0, 3)), ("kvtool/2/ns/0/b/64/cc", lease.region(1, 5))]
    assert store.put_from(items, lease) == [PutOutcome.NO_SPACE, PutOutcome.STORED]
    assert "kvtool/2/ns/0/t/20/bb" not in backend.objects and len(backend.objects["kvtool/2/ns/0/b/64/cc"]) == 5


def _backend_with(monkeypatch, **changes):
    """The default backend's registration with ``changes`` (``backend.Backend``'s fields), for the test."""
    monkeypatch.setitem(BACKENDS, DEFAULT_BACKEND, dataclasses.replace(BACKENDS[DEFAULT_BACKEND], **changes))


def _unreachable(monkeypatch):
    """A backend whose probe says it cannot be reached (as the Mooncake one says of a dead master)."""
    _backend_with(monkeypatch, probe=lambda config: "the master at 127.0.0.1:1 is not reachable")
    return load_config({"master_server_address": "127.0.0.1:1"})


def test_a_reader_of_an_unreachable_store_is_told_why_and_an_engines_side_serves_on(monkeypatch):
    config = _unreachable(monkeypatch)
    with pytest.raises(StoreError, match="not reachable"):
        open_store_stack(config, "reader")
    breaker = CircuitBreaker(breaker_policy(config))
    stack = open_store_stack(config, "scheduler", breaker)
    try:
        assert isinstance(stack, InstrumentedStore)
        with pytest.raises(StoreError):  # what a lookup takes for a miss while the store is away
            stack.exists(["k"])
        guarded = stack._store  # noqa: SLF001 - the layers, in order
        assert isinstance(guarded, GuardedStore) and guarded.breaker is breaker
        assert isinstance(guarded._store, LateStore)  # noqa: SLF001 - tried again in the background
    finally:
        stack.close()


def test_a_backend_without_a_probe_is_opened_straight_away(monkeypatch):
    opened = []
    _backend_with(monkeypatch, probe=None)
    monkeypatch.setattr(
        "connector.store.stack.open_store", lambda config, **kwargs: opened.append(kwargs) or ScriptedStore()
    )
    config = load_config({"master_server_address": "127.0.0.1:1"})
    stack = open_store_stack(config, "worker")
    assert opened == [{"shared": True, "call_threads": WORKER_STORE_CALLS}]
    assert isinstance(stack, InstrumentedStore)


def test_the_worker_stack_takes_every_fetch_thread_the_put_thread_and_a_spare():
    assert WORKER_STORE_CALLS == LOAD_THREADS + 2
