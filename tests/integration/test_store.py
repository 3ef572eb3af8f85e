"""The store adapter against a real mooncake_master."""

import os

import pytest

from connector.core.keys import KeyKind, Namespace, block_key, tail_key
from connector.core.objects import ObjectHeader, encode_object, verify_object
from connector.store.store import PutOutcome, StoreError, open_store

pytestmark = pytest.mark.integration

NS = Namespace(model="m", dtype="float32", kv_layout="cpu", block_size=32, num_layers=2, num_kv_heads=2, head_size=64)


def header(chain, kind=KeyKind.TAIL, end=85, payload_len=4096):
    return ObjectHeader(NS.fingerprint(), chain, kind, "float32", 2, 64, end, payload_len)


def test_objects_read_back_byte_identical(store):
    payload = os.urandom(4096)
    chain = os.urandom(16)
    key = tail_key(NS.key_component(), 85, chain)
    value = encode_object(header(chain), payload)
    assert store.put(key, value) is PutOutcome.STORED
    assert store.exists([key]) == [True]
    (read,) = store.get([key])
    assert read == value
    assert bytes(verify_object(read, header(chain))) == payload


def test_a_large_object_round_trips(store):
    payload = os.urandom(3 << 20)
    chain = os.urandom(16)
    key = block_key(NS.key_component(), 64, chain)
    value = encode_object(header(chain, KeyKind.BLOCK, 96, len(payload)), payload)
    assert store.put(key, value) is PutOutcome.STORED
    assert store.get([key]) == [value]


def test_a_missing_key_is_a_miss(store):
    key = block_key(NS.key_component(), 32, os.urandom(16))
    assert store.exists([key]) == [False]
    assert store.get([key]) == [None]


def test_batches_mix_hits_and_misses(store):
    chains = [os.urandom(16) for _ in range(3)]
    keys = [block_key(NS.key_component(), 32 * (i + 1), c) for i, c in enumerate(chains)]
    store.put(keys[1], b"x" * 100)
    assert store.exists(keys) == [False, True, False]
    assert store.get(keys) == [None, b"x" * 100, None]


def test_objects_are_immutable_first_put_wins(store):
    key = tail_key(NS.key_component(), 5, os.urandom(16))
    assert store.put(key, b"first") is PutOutcome.STORED
    store.put(key, b"second")
    assert store.get([key]) == [b"first"]


def test_an_unreachable_master_is_a_store_error(store_config):
    bad = store_config.with_backend(master_server_address="127.0.0.1:1").model_copy(update={"connect_timeout_s": 5})
    with pytest.raises(StoreError):
        open_store(bad)


def test_inspect_with_a_port_that_answers_but_is_no_master_is_one_sentence_not_a_hang():
    """An admin port given for the RPC port: the client's setup (which holds the GIL) retried it for ten
    minutes, through SIGTERM; a probe in a child process says why within the time-out."""
    import contextlib
    import socket
    import threading

    from kvtool.errors import ServerError
    from kvtool.inspect.target import Target, open_reader

    listener = socket.create_server(("127.0.0.1", 0))

    def hold() -> None:
        with contextlib.suppress(OSError):  # the listener closed under it
            held = [listener.accept() for _ in range(8)]  # noqa: F841 - kept open, never answered

    threading.Thread(target=hold, daemon=True).start()
    try:
        target = Target(admin="http://127.0.0.1:1", master=f"127.0.0.1:{listener.getsockname()[1]}")
        with pytest.raises(ServerError, match="RPC port"):
            open_reader(target)
    finally:
        listener.close()


def test_a_batch_larger_than_the_transfer_buffer_is_split(store):
    # The fixture's client has a 32 MiB transfer buffer; 40 objects of 1 MiB overflow it.
    values = [os.urandom(1 << 20) for _ in range(40)]
    keys = [block_key(NS.key_component(), 32 * (i + 1), os.urandom(16)) for i in range(40)]
    for key, value in zip(keys, values, strict=True):
        assert store.put(key, value) is PutOutcome.STORED
    assert store.get(keys, object_bytes=1 << 20) == values


def test_a_batch_put_stores_every_pointer_and_keeps_what_was_there(store):
    from connector.core.keys import object_key

    keys = [object_key(NS.key_component(), 0, KeyKind.POINTER, end, os.urandom(16)) for end in (8, 16, 24)]
    assert store.put(keys[1], b"first") is PutOutcome.STORED
    assert store.put_many([(key, f"pointer {i}".encode()) for i, key in enumerate(keys)]) is PutOutcome.STORED
    assert store.get(keys) == [b"pointer 0", b"first", b"pointer 2"]  # first put wins, in a batch too
    assert store.put_many([]) is PutOutcome.STORED


def test_a_batch_put_that_replaces_takes_the_new_values(store):
    from connector.core.keys import object_key

    keys = [object_key(NS.key_component(), 0, KeyKind.POINTER, end, os.urandom(16)) for end in (8, 16)]
    assert store.put(keys[0], b"a dangling pointer") is PutOutcome.STORED
    assert store.put_many([(key, b"pointer") for key in keys], replace=True) is PutOutcome.STORED
    assert store.get(keys) == [b"pointer", b"pointer"]


# -- zero-copy batches through a registered staging area ----------------------------------------------


def staged(store, slots=4, slot_bytes=1 << 16):
    from connector.store.staging import StagingArea

    area = StagingArea("test", slot_bytes, slots)
    store.register(area.address, area.nbytes)
    return area


def test_zero_copy_batches_round_trip_and_read_back_byte_identical(store):
    area = staged(store)
    chains = [os.urandom(16) for _ in range(3)]
    keys = [block_key(NS.key_component(), 32 * (i + 1), c) for i, c in enumerate(chains)]
    values = [os.urandom(size) for size in (1 << 16, 1000, 77)]  # a whole slot, and less
    lease = area.take(3)
    regions = [lease.region(i, len(v)) for i, v in enumerate(values)]
    for region, value in zip(regions, values, strict=True):
        region.view[:] = value
    assert store.put_from(list(zip(keys, regions, strict=True)), lease) == [PutOutcome.STORED] * 3
    lease.release()
    assert store.exists(keys) == [True] * 3
    assert store.get(keys) == values  # the bytes API reads what the zero-copy put wrote

    reader = area.take(4)
    missing = block_key(NS.key_component(), 999, os.urandom(16))
    # Whole slots as the regions: each read reports its object's own length.
    counts = store.get_into([*keys, missing], [reader.region(i) for i in range(4)], reader)
    assert counts[:3] == [len(v) for v in values] and counts[3] <= 0
    assert [bytes(reader.region(i, len(v)).view) for i, v in enumerate(values)] == values
    reader.release()
    assert area.free_slots == 4


def test_an_object_larger_than_its_region_is_not_read(store):
    area = staged(store, slot_bytes=4096)
    key = block_key(NS.key_component(), 32, os.urandom(16))
    assert store.put(key, os.urandom(8192)) is PutOutcome.STORED
    lease = area.take(1)
    (count,) = store.get_into([key], [lease.region(0)], lease)
    assert count <= 0  # a failed read, never a short one that looks whole


def test_an_engine_side_that_started_before_its_master_connects_once_it_is_up(tmp_path):
    """``LateStore`` over the real opener and probe: misses while no master listens, then the store."""
    import time
    from functools import partial

    from connector.config import load_config
    from connector.store.latestore import LateStore
    from connector.store.mooncake import probe_master
    from kvtool.store.master import LocalMaster

    master = LocalMaster(tmp_path / "late-master.log")  # its ports picked; nothing listens yet
    config = load_config(
        {"master_server_address": master.address, "global_segment_size": 16 << 20, "connect_timeout_s": 2}
    )  # the client lends the store its memory: the new master has no other
    assert "not reachable" in probe_master(config)
    late = LateStore(partial(open_store, config), partial(probe_master, config), retry_s=0.2, max_retry_s=0.5)
    try:
        with pytest.raises(StoreError):
            late.exists(["k"])
        master.start()
        for _ in range(600):  # polled, no time asserted
            if late.connected:
                break
            time.sleep(0.1)
        assert late.connected
        assert late.put("late/key", b"v") is PutOutcome.STORED and late.exists(["late/key"]) == [True]
    finally:
        late.close()
        master.stop()


def test_the_probe_says_why_a_port_that_answers_but_is_no_master_is_not_one():
    import socket
    import threading

    from connector.config import load_config
    from connector.store.mooncake import probe_master

    listener = socket.create_server(("127.0.0.1", 0))
    held = []
    threading.Thread(target=lambda: held.append(listener.accept()), daemon=True).start()
    try:
        address = f"127.0.0.1:{listener.getsockname()[1]}"
        config = load_config({"master_server_address": address, "global_segment_size": 0, "connect_timeout_s": 2})
        why = probe_master(config)  # the setup waits in a child process; this one goes on
        assert why is not None and address in why
    finally:
        listener.close()


@pytest.mark.parametrize("interpreter", ["/bin/false", "/nonexistent/python"])
def test_a_probe_that_cannot_run_lets_the_setup_go_on_unprobed(monkeypatch, interpreter):
    """A child that cannot judge (it cannot import the client library, or cannot start) says so in the
    log and answers None: the caller sets its client up as before probes, instead of going without the
    store for good. Only a setup that failed, timed out or crashed in the child is the master's."""
    import logging
    import socket
    import sys

    from connector.config import load_config
    from connector.store.mooncake import probe_master

    listener = socket.create_server(("127.0.0.1", 0))
    try:
        address = f"127.0.0.1:{listener.getsockname()[1]}"
        config = load_config({"master_server_address": address, "global_segment_size": 0, "connect_timeout_s": 2})
        monkeypatch.setattr(sys, "executable", interpreter)
        said: list[str] = []
        handler = logging.Handler(logging.WARNING)
        handler.emit = lambda record: said.append(record.getMessage())  # vLLM's "vllm" logger may not propagate
        logging.getLogger("vllm.kvtool").addHandler(handler)
        try:
            assert probe_master(config) is None
        finally:
            logging.getLogger("vllm.kvtool").removeHandler(handler)
        assert any("set up unprobed" in line for line in said), said
    finally:
        listener.close()
