"""The store stack: time-outs and fault injection wrap any backend behind the store interface."""

from __future__ import annotations

import json
import threading

import pytest

from connector.calls import StoreBusy, StoreTimeout
from connector.config import load_config
from connector.faults import FaultyStore
from connector.store import PutOutcome, TimedStore

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
