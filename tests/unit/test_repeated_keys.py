"""A key two users of one batch need reaches the store once (``UniqueKeysStore``), on the paths that
gather such batches: one scheduler step's lookups (two prompts that share a pointer read it, and
check the object it names, in one batch) and a load whose objects name one key twice. The store is
a fake that answers a repeated key the way Mooncake 0.3.13.post1's client does (wrong bytes, success
reported): through the guard no hit is lost and no wrong byte loaded; without it, they are."""

from __future__ import annotations

import torch

from connector.data import KVToolMetadata, RequestLoad
from connector.scheduler.lookups import LookupBatcher
from connector.core.objects import pointer_size
from connector.store.uniquekeys import UniqueKeysStore

from .scripted_store import InlineCalls, RepeatedKeyStore
from .test_divergence import STORED, diverging, keys_for, save_with_pointers
from .test_worker import BLOCK, LAYERS, kv_caches, save, transfers, worker

GRID = 8
# Two prompts of one step that leave the stored one at token 75, past its pointer at 72 (inside its
# tail): each one's hit relies on reading that one pointer record.
PROMPTS = {"r1": diverging(75, 90), "r2": STORED[:75] + [9] * 20}


def stored_with_pointers() -> RepeatedKeyStore:
    backend = RepeatedKeyStore()
    save_with_pointers(backend, kv_caches("random"), STORED, (3, 5, 1), grid=GRID)
    assert backend.repeated == []  # a save's batches name each key once
    return backend


def step_lookups(store) -> dict[str, int]:
    """Both prompts looked up in one batch, as one scheduler step sends them; each one's hit."""
    batcher = LookupBatcher(
        store.exists, 2.0, calls=InlineCalls(), read=lambda keys: store.get(keys, pointer_size(BLOCK))
    )
    for req_id, tokens in PROMPTS.items():
        batcher.want(req_id, keys_for(tokens, GRID))
    batcher.flush()
    assert batcher.batches == 1
    return {req_id: batcher.poll(req_id).hit_tokens for req_id in PROMPTS}


def test_two_prompts_of_a_step_that_share_a_pointer_both_get_their_whole_hit():
    backend = stored_with_pointers()
    assert step_lookups(UniqueKeysStore(backend)) == {"r1": 75, "r2": 75}
    assert backend.repeated == []


def test_without_the_guard_the_client_loses_one_of_the_two_hits():
    """What the guard prevents: the pointer asked twice in one read, its second copy is rejected."""
    backend = stored_with_pointers()
    assert sorted(step_lookups(backend).values()) == [64, 75]  # one falls back to the stored blocks
    assert "get" in [call for call, _ in backend.repeated]


def load_twice_named(store, source):
    """A load that reads the prompt's first block object into blocks 0 and 2 (and the rest into 6 and
    7): one batch naming that key twice. The loads that failed, and the caches it loaded into."""
    target = kv_caches("zeros")
    side = worker(store, target, saves=False)
    twice = transfers((0, 6, 7)) + transfers((2, 6, 7))[:1]
    side.start_load_kv(KVToolMetadata(loads=[RequestLoad("req-2", twice)]))
    received, failed = side.get_finished()
    side.shutdown()
    assert received == {"req-2"}
    return failed, target


def test_a_load_that_names_an_object_twice_loads_the_right_bytes_into_both_blocks():
    source = kv_caches("random")
    backend = RepeatedKeyStore()
    save(backend, source)
    failures, target = load_twice_named(UniqueKeysStore(backend), source)
    assert failures == set()
    for name in LAYERS:
        for src, dst in [(3, 0), (3, 2), (5, 6), (1, 7)]:
            assert torch.equal(source[name][src], target[name][dst])
    assert backend.repeated == []


def test_without_the_guard_the_repeated_object_fails_its_check_and_the_load_is_a_miss():
    source = kv_caches("random")
    backend = RepeatedKeyStore()
    save(backend, source)
    failures, _ = load_twice_named(backend, source)
    assert failures == {"req-2"}  # the object check caught the wrong bytes: recomputed, not loaded
    assert [call for call, _ in backend.repeated] == ["get_into"]


def test_two_requests_loading_the_same_objects_send_separate_batches():
    """Each load is a batch of its own (``loader.fetch``): requests sharing a prefix never repeat a key."""
    source = kv_caches("random")
    backend = RepeatedKeyStore()
    save(backend, source)
    target = kv_caches("zeros")
    side = worker(UniqueKeysStore(backend), target, saves=False)
    loads = [RequestLoad("a", transfers((0, 6, 7))), RequestLoad("b", transfers((2, 4, 5)))]
    side.start_load_kv(KVToolMetadata(loads=loads))
    assert side.get_finished() == ({"a", "b"}, set())
    side.shutdown()
    for name in LAYERS:
        assert torch.equal(target[name][0], source[name][3]) and torch.equal(target[name][2], source[name][3])
    assert backend.repeated == []
