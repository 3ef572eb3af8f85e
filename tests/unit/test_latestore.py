"""``connector.store.latestore``: an engine that started while its store was down connects once it is up."""

from __future__ import annotations

import threading
import time

import pytest

from connector.calls import StoreError
from connector.store.latestore import LateStore
from connector.store.store import PutOutcome

from .scripted_store import ScriptedStore


class Registering(ScriptedStore):
    def __init__(self):
        super().__init__()
        self.registered: list[tuple[int, int]] = []
        self.closed = 0

    def register(self, address, nbytes):
        self.registered.append((address, nbytes))

    def close(self):
        self.closed += 1


def until(predicate, what: str) -> None:
    for _ in range(2000):  # polled, no time asserted
        if predicate():
            return
        time.sleep(0.005)
    raise AssertionError(what)


def test_calls_are_misses_until_the_store_opens_then_reach_it_with_what_was_registered():
    backend, tries = Registering(), []
    opened = threading.Event()

    def open_store():
        tries.append(1)
        if not opened.is_set():
            raise StoreError("the master at 127.0.0.1:1 is not reachable")
        return backend

    late = LateStore(open_store, retry_s=0.001, max_retry_s=0.002)
    try:
        with pytest.raises(StoreError, match="not connected yet"):
            late.exists(["k"])
        late.register(4096, 1 << 20)  # a staging area made while down: kept for the client to come
        until(lambda: len(tries) >= 2, "no second try")
        assert not late.connected
        opened.set()
        until(lambda: late.connected, "never connected")
        assert backend.registered == [(4096, 1 << 20)]  # registered before any call could reach it
        assert late.put("k", b"v") is PutOutcome.STORED and late.exists(["k"]) == [True]
        late.register(8192, 4096)  # once connected: straight through
        assert backend.registered[-1] == (8192, 4096)
        count = len(tries)
        time.sleep(0.02)
        assert len(tries) == count  # no more tries once connected
    finally:
        late.close()
    assert backend.closed == 1
    with pytest.raises(StoreError):
        late.exists(["k"])


def test_a_probe_that_says_no_keeps_the_store_closed_and_no_client_is_made():
    made = []
    answers = iter(["the master accepts connections but did not answer", None])
    late = LateStore(lambda: made.append(1) or Registering(), lambda: next(answers), retry_s=0.001)
    try:
        until(lambda: late.connected, "never connected")
        assert made == [1]  # only after the probe said yes
    finally:
        late.close()


def test_a_try_that_raises_a_bug_is_one_failed_try_not_the_end_of_the_tries():
    answers = iter([RuntimeError("a bug in the probe"), None])

    def probe():
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    late = LateStore(Registering, probe, retry_s=0.001)
    try:
        until(lambda: late.connected, "a raising try ended the tries")
        assert late.tries == 2
    finally:
        late.close()


def test_a_registration_the_new_client_refuses_is_said_and_the_client_kept():
    """As at start: a staging area the store does not register still transfers (over TCP)."""

    class Refusing(Registering):
        def register(self, address, nbytes):
            raise StoreError("refused")

    client, registered = Refusing(), threading.Event()

    def open_store():
        registered.wait(10)  # the engine registers before the store answers (else it is a direct call)
        return client

    late = LateStore(open_store, retry_s=0.001)
    late.register(1, 2)
    registered.set()
    try:
        until(lambda: late.connected, "never connected")
        assert late.exists(["k"]) == [False] and client.closed == 0
    finally:
        late.close()


def test_closing_while_it_tries_leaves_no_client_open():
    gate, clients = threading.Event(), []

    def open_store():
        gate.wait()
        clients.append(Registering())
        return clients[-1]

    late = LateStore(open_store, retry_s=0.001)
    until(lambda: late.tries >= 1, "no try")
    late.close()
    gate.set()
    until(lambda: clients, "the try never returned")
    until(lambda: clients[0].closed == 1, "the client made after close stayed open")
    assert not late.connected


def test_a_close_between_the_check_and_the_call_of_a_registration_is_no_attribute_error():
    """``register`` reads the client once under the lock and calls that one: a ``close`` right after the
    lock (here, inside its release) leaves the call on the client it read, never on None."""
    store = Registering()
    late = LateStore(lambda: store, retry_s=0.001)
    until(lambda: late.connected, "the store never connected")

    class CloseOnRelease:
        def __init__(self, lock):
            self._lock = lock

        def __enter__(self):
            self._lock.acquire()

        def __exit__(self, *exc):
            self._lock.release()
            late._store = None  # what a close() on another thread does just then

    late._lock = CloseOnRelease(threading.Lock())
    late.register(4096, 64)
    assert store.registered == [(4096, 64)]


def test_a_registration_after_close_is_dropped():
    late = LateStore(lambda: (_ for _ in ()).throw(StoreError("down")), retry_s=60.0)
    late.close()
    late.register(4096, 64)
    assert late._registered == []
