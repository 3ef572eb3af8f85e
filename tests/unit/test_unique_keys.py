"""No key twice in one batch: ``UniqueKeysStore`` asks each key once and answers every position that
named it, over a fake that answers a repeated key the way Mooncake 0.3.13.post1's client does."""

from __future__ import annotations

import dataclasses

import json
import logging

from hypothesis import given, settings
from hypothesis import strategies as st

from connector.config import load_config
from connector.store.staging import StagingArea
from connector.store.store import PutOutcome, open_store
from connector.store.uniquekeys import TOO_SMALL, UniqueKeysStore

from .scripted_store import RepeatedKeyStore

SLOT = 64
OBJECTS = {"a": b"alpha" * 4, "b": b"bravo!", "c": bytes(range(40)), "empty": b""}  # "missing" is not stored


def fake_store() -> RepeatedKeyStore:
    store = RepeatedKeyStore()
    store.objects.update(OBJECTS)
    return store


def read_into(store, keys, sizes=None):
    """``get_into`` of ``keys`` into slots of a fresh area (of ``sizes`` bytes each, default whole slots);
    the counts and each region's bytes as read."""
    lease = StagingArea("load", SLOT, max(1, len(keys))).take(len(keys))
    regions = [lease.region(i, None if sizes is None else sizes[i]) for i in range(len(keys))]
    counts = store.get_into(keys, regions, lease)
    return counts, [bytes(region.view[: max(count, 0)]) for region, count in zip(regions, counts, strict=True)]


def test_the_fake_answers_a_repeated_key_wrong_at_full_length():
    """What the wrapper guards against: every slot claims success, all but the key's last hold other bytes."""
    store = fake_store()
    assert store.get(["a", "a"]) == [bytes(len(OBJECTS["a"])), OBJECTS["a"]]
    counts, read = read_into(store, ["a", "a", "b"])
    assert counts == [20, 20, 6] and read[1:] == [OBJECTS["a"], OBJECTS["b"]] and read[0] != OBJECTS["a"]
    assert [call for call, _ in store.repeated] == ["get", "get_into"]


def test_exists_asks_each_key_once_and_answers_every_position():
    backend = fake_store()
    store = UniqueKeysStore(backend)
    assert store.exists(["a", "missing", "a", "b", "missing"]) == [True, False, True, True, False]
    assert store.exists([]) == []
    assert backend.repeated == []


def test_get_hands_the_same_bytes_to_every_repeat():
    backend = fake_store()
    values = UniqueKeysStore(backend).get(["a", "b", "a", "missing", "a", "missing"], object_bytes=SLOT)
    assert values == [OBJECTS["a"], OBJECTS["b"], OBJECTS["a"], None, OBJECTS["a"], None]
    assert values[0] is values[2] is values[4]
    assert backend.repeated == []


def test_get_into_reads_a_key_once_and_copies_it_into_every_region_that_names_it():
    backend = fake_store()
    counts, read = read_into(UniqueKeysStore(backend), ["c", "a", "c", "missing", "c", "missing", "empty", "empty"])
    assert counts == [40, 20, 40, -704, 40, -704, 0, 0]
    assert read == [OBJECTS["c"], OBJECTS["a"], OBJECTS["c"], b"", OBJECTS["c"], b"", b"", b""]
    assert backend.repeated == []


def test_a_repeat_whose_region_is_too_small_fails_alone_and_a_failed_read_fails_every_repeat():
    backend = fake_store()
    counts, read = read_into(UniqueKeysStore(backend), ["c", "c", "c"], sizes=[SLOT, 16, 40])
    assert counts == [40, TOO_SMALL, 40] and read[2] == OBJECTS["c"]
    counts, _ = read_into(UniqueKeysStore(backend), ["c", "c"], sizes=[16, SLOT])  # the first is too small
    assert counts == [-704, -704]  # the read into the first region failed: so did every repeat
    assert backend.repeated == []


def test_put_from_puts_each_key_once_from_its_first_region_and_every_repeat_shares_the_outcome():
    backend = RepeatedKeyStore()
    backend.put_outcome_for = lambda key: PutOutcome.NO_SPACE if key == "full" else PutOutcome.STORED
    lease = StagingArea("save", SLOT, 5).take(5)
    regions = [lease.region(i, 8) for i in range(5)]
    for number, region in enumerate(regions):
        region.view[:] = bytes([number]) * 8
    items = list(zip(["x", "full", "x", "y", "full"], regions, strict=True))
    assert UniqueKeysStore(backend).put_from(items, lease) == [
        PutOutcome.STORED,
        PutOutcome.NO_SPACE,
        PutOutcome.STORED,
        PutOutcome.STORED,
        PutOutcome.NO_SPACE,
    ]
    assert backend.objects == {"x": bytes([0]) * 8, "y": bytes([3]) * 8}
    assert backend.repeated == []


def test_put_many_puts_one_item_per_key_keeping_the_first_value(caplog):
    backend = RepeatedKeyStore()
    store = UniqueKeysStore(backend)
    with caplog.at_level(logging.DEBUG, logger="vllm.kvtool"):
        assert store.put_many([("p", b"one"), ("q", b"q"), ("p", b"one")], replace=True) is PutOutcome.STORED
        assert not caplog.records  # the same value twice: nothing to say
        assert store.put_many([("r", b"first"), ("r", b"second")]) is PutOutcome.STORED
    assert backend.objects == {"p": b"one", "q": b"q", "r": b"first"}
    assert ["named r twice" in record.getMessage() for record in caplog.records] == [True]
    assert backend.repeated == []


KEYS = st.lists(st.sampled_from(["a", "b", "c", "empty", "missing"]), max_size=12)


@settings(max_examples=200, deadline=None)
@given(keys=KEYS)
def test_every_batch_answers_as_each_key_asked_alone(keys):
    backend = fake_store()
    store = UniqueKeysStore(backend)
    assert store.exists(keys) == [backend.exists([key])[0] for key in keys]
    assert store.get(keys) == [backend.get([key])[0] for key in keys]
    counts, read = read_into(store, keys)
    alone = [read_into(backend, [key]) for key in keys]
    assert counts == [count for (count,), _ in alone]
    assert read == [value for _, (value,) in alone]
    assert backend.repeated == []


@settings(max_examples=100, deadline=None)
@given(items=st.lists(st.tuples(st.sampled_from("pqrs"), st.binary(max_size=8)), max_size=10))
def test_every_put_batch_stores_what_a_put_of_each_item_in_turn_stores(items):
    batched, alone = RepeatedKeyStore(), RepeatedKeyStore()
    assert UniqueKeysStore(batched).put_many(items) is PutOutcome.STORED
    for key, value in items:
        alone.put(key, value)  # the first put of a key wins
    assert batched.objects == alone.objects and batched.repeated == []
    lease = StagingArea("save", SLOT, max(1, len(items))).take(len(items))
    regions = [lease.region(i, len(value)) for i, (_, value) in enumerate(items)]
    for region, (_, value) in zip(regions, items, strict=True):
        region.view[:] = value
    zero_copy = RepeatedKeyStore()
    named = [(key, region) for (key, _), region in zip(items, regions, strict=True)]
    outcomes = UniqueKeysStore(zero_copy).put_from(named, lease)
    assert outcomes == [PutOutcome.STORED] * len(items)
    assert zero_copy.objects == alone.objects and zero_copy.repeated == []


def test_open_store_puts_the_guard_between_every_caller_and_the_backend(monkeypatch, tmp_path):
    """Under the time-outs, and above fault injection (which stands for the backend)."""
    from connector.store.backends import BACKENDS, DEFAULT_BACKEND

    backend = fake_store()
    registered = dataclasses.replace(BACKENDS[DEFAULT_BACKEND], open=lambda config: backend)
    monkeypatch.setitem(BACKENDS, DEFAULT_BACKEND, registered)
    plan = tmp_path / "faults.json"
    plan.write_text(json.dumps({}))
    for faults in ({}, {"fault_control_file": str(plan)}):
        stack = open_store(load_config({"master_server_address": "127.0.0.1:1", **faults}))
        try:
            assert stack.get(["a", "a"]) == [OBJECTS["a"]] * 2
            assert read_into(stack, ["a", "a"])[1] == [OBJECTS["a"]] * 2
        finally:
            stack.close()
    assert backend.repeated == []
