"""Saves in bounded memory whose watermark stops at their first failed put, and loads that never hold the engine."""

from __future__ import annotations

import threading
from dataclasses import replace

import torch

from connector.calls import BoundedCalls
from connector.config import load_config
from connector.data import BlockTransfer, KVToolMetadata, RequestLoad, RequestSave
from connector.core.keys import KeyKind
from connector.core.objects import HEADER_SIZE
from connector.core.prefix import PromptKeys, plan_save
from connector.worker.saver import NO_SPACE_RETRY_DELAYS_S
from connector.store.store import PutOutcome
from connector.core.watermarks import SaveState
from connector.worker.worker import WorkerSide

from .scripted_store import InlineCalls, ScriptedStore
from .test_worker import LAYERS, NS, NUM_BLOCKS, SMALL_AREAS, kv_caches, records

BLOCK_BYTES = 2 * 2 * 32 * 128 * 4  # two layers of [2, 32, 128] float32


def config(**fields):
    return load_config({"master_server_address": "127.0.0.1:1", **SMALL_AREAS, **fields})


def prompt_save(req_id, first_token, length, block_ids):
    keys = PromptKeys.build(list(range(first_token, first_token + length)), 32, 1, NS.key_component(), b"\0" * 16)
    transfers = tuple(
        BlockTransfer(block_ids[s.block_index], s.kind, s.token_start, s.token_end, s.chain_hash)
        for s in plan_save(keys)
    )
    return RequestSave(req_id, transfers, prompt_tokens=length)


class HeldStore(ScriptedStore):
    """Puts wait until released: a slow store, so that saves queue up."""

    def __init__(self):
        super().__init__()
        self.release = threading.Event()

    def put(self, key, value):
        self.release.wait()
        return super().put(key, value)


def test_saves_beyond_the_budget_are_dropped_and_counted_and_the_engine_never_waits():
    store = HeldStore()
    budget = 3 * (HEADER_SIZE + BLOCK_BYTES)  # three objects
    side = WorkerSide(NS, store, config(save_buffer_bytes=budget), saves_enabled=True)
    side.register_kv_caches(kv_caches("random"), [LAYERS], NUM_BLOCKS)
    # 85 tokens: 3 objects (two blocks, a tail). Then 100 tokens: 4 objects, of which none fits.
    side.wait_for_save(KVToolMetadata(saves=[prompt_save("a", 0, 85, [1, 2, 3])]))
    side.wait_for_save(KVToolMetadata(saves=[prompt_save("b", 1000, 100, [4, 5, 6, 7])]))
    assert side._saver.area.free_slots == 0 and side._saver.area.slots == 3  # never more than the budget
    store.release.set()
    side.shutdown()
    stats = side.take_stats()
    assert stats["saves_dropped_budget"] == 1 and stats["save_objects_dropped_budget"] == 4
    assert stats["saves_stored"] == 3
    assert side._saver.held_bytes == 0
    assert side.take_worker_meta().unsaved == {"b"}  # its answer save, if any, puts its objects


def test_a_save_that_half_fits_keeps_its_leading_blocks_and_its_watermark_stops_there():
    store = ScriptedStore()
    budget = 2 * (HEADER_SIZE + BLOCK_BYTES)
    side = WorkerSide(NS, store, config(save_buffer_bytes=budget), saves_enabled=True)
    side.register_kv_caches(kv_caches("random"), [LAYERS], NUM_BLOCKS)
    side.wait_for_save(KVToolMetadata(saves=[prompt_save("a", 0, 85, [1, 2, 3])]))
    side.shutdown()
    final = records(store)[1]
    assert (final.state, final.durable_offset, final.tail_durable) == (SaveState.FAILED, 64, False)
    assert "dropped_budget" in final.reason
    assert not any("/t/" in key for key in store.objects)
    assert side.take_worker_meta().unsaved == {"a"}


def test_a_save_is_durable_only_up_to_its_first_failed_put():
    store = ScriptedStore()
    tried = []
    store.put_outcome_for = lambda key: (
        tried.append(key) or (PutOutcome.NO_SPACE if "/b/32/" in key else PutOutcome.STORED)
    )
    side = WorkerSide(NS, store, config(), saves_enabled=True)
    side.register_kv_caches(kv_caches("random"), [LAYERS], NUM_BLOCKS)
    side.wait_for_save(KVToolMetadata(saves=[prompt_save("a", 0, 85, [1, 2, 3])]))
    side.shutdown()
    data = [key for key in tried if "/w/" not in key]
    # One batch: block 1 and the tail went with block 0 (unreachable without it); the refused block
    # was tried again after each pause, the others were not.
    assert len(data) == 3 + len(NO_SPACE_RETRY_DELAYS_S) and len(set(data)) == 3
    stats = side.take_stats()
    assert (stats["saves_no_space"], stats["saves_stored"]) == (1, 2)
    assert stats["puts_retried_no_space"] == len(NO_SPACE_RETRY_DELAYS_S)
    assert records(store)[1].durable_offset == 0
    # The scheduler hears of it (its answer save, if any, puts the prompt's objects again), once.
    assert side.take_worker_meta().unsaved == {"a"}
    assert side.take_worker_meta() is None


def test_a_put_refused_for_space_is_stored_once_the_store_has_evicted():
    store = ScriptedStore()
    refusals = {"left": 1}

    def outcome(key):
        if "/b/32/" in key and refusals["left"]:
            refusals["left"] -= 1
            return PutOutcome.NO_SPACE  # full, until the master evicts in the background
        return PutOutcome.STORED

    store.put_outcome_for = outcome
    side = WorkerSide(NS, store, config(), saves_enabled=True)
    side.register_kv_caches(kv_caches("random"), [LAYERS], NUM_BLOCKS)
    side.wait_for_save(KVToolMetadata(saves=[prompt_save("a", 0, 85, [1, 2, 3])]))
    side.shutdown()
    stats = side.take_stats()
    assert stats["saves_stored"] == 3 and "saves_no_space" not in stats
    assert stats["puts_retried_no_space"] == 1
    final = records(store)[1]
    assert (final.state, final.durable_offset, final.tail_durable) == (SaveState.DURABLE, 85, True)


def test_objects_already_in_the_store_are_not_sent_again():
    store = ScriptedStore()
    side = WorkerSide(NS, store, config(), saves_enabled=True)
    side.register_kv_caches(kv_caches("random"), [LAYERS], NUM_BLOCKS)
    side.wait_for_save(KVToolMetadata(saves=[prompt_save("a", 0, 85, [1, 2, 3])]))
    side.wait_for_save(KVToolMetadata(saves=[prompt_save("b", 0, 85, [1, 2, 3])]))
    side.shutdown()
    stats = side.take_stats()
    assert (stats["saves_stored"], stats["saves_present"]) == (3, 3)
    assert records(store)[1].state is SaveState.DURABLE


def test_shutdown_drains_for_its_time_limit_then_drops_and_counts_the_rest():
    store = HeldStore()
    side = WorkerSide(NS, store, config(), saves_enabled=True)
    side.register_kv_caches(kv_caches("random"), [LAYERS], NUM_BLOCKS)
    side.wait_for_save(KVToolMetadata(saves=[prompt_save("a", 0, 85, [1, 2, 3])]))
    side.wait_for_save(KVToolMetadata(saves=[prompt_save("b", 500, 85, [4, 5, 6])]))
    side.shutdown(timeout_s=0.0)  # the store is stuck past the drain limit: shutdown returns anyway
    store.release.set()
    side._saver._thread.join()
    stats = side.take_stats()
    assert stats.get("saves_dropped_shutdown", 0) >= 3  # b's objects at least were never tried
    assert stats.get("saves_stored", 0) <= 1


def test_an_open_breaker_skips_saves_without_copying():
    class Open:
        is_open = True

    store = ScriptedStore()
    side = WorkerSide(NS, store, config(), saves_enabled=True, breaker=Open())
    side.register_kv_caches(kv_caches("random"), [LAYERS], NUM_BLOCKS)
    side.wait_for_save(KVToolMetadata(saves=[prompt_save("a", 0, 85, [1, 2, 3])]))
    assert side._saver.held_bytes == 0
    side.shutdown()
    assert side.take_stats() == {"saves_skipped_breaker": 1}
    assert store.objects == {}
    assert side.take_worker_meta().unsaved == {"a"}


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_a_load_that_does_not_answer_in_time_fails_its_request_only_and_its_late_answer_is_dropped():
    release = threading.Event()
    store = ScriptedStore()
    source = kv_caches("random")
    saver = WorkerSide(NS, store, config(), saves_enabled=True)
    saver.register_kv_caches(source, [LAYERS], NUM_BLOCKS)
    saver.wait_for_save(KVToolMetadata(saves=[prompt_save("a", 0, 85, [1, 2, 3])]))
    saver.shutdown()

    class SlowStore(ScriptedStore):
        def get_into(self, keys, regions, lease):
            release.wait()
            return store.get_into(keys, regions, lease)

    clock = Clock()
    target = kv_caches("zeros")
    calls = BoundedCalls("test-load", limit=2)
    side = WorkerSide(NS, SlowStore(), config(load_timeout_s=5), saves_enabled=False, load_calls=calls)
    side._loader._clock = clock
    side.register_kv_caches(target, [LAYERS], NUM_BLOCKS)
    load = RequestLoad("late", prompt_save("late", 0, 85, [4, 5, 6]).transfers)
    try:
        side.start_load_kv(KVToolMetadata(loads=[load]))
        assert side.get_finished() == (set(), set())  # in flight: the engine goes on
        clock.now += 6
        assert side.get_finished() == ({"late"}, {"late"})
        release.set()
        for _ in range(100):
            if calls.in_flight == 0:
                break
            threading.Event().wait(0.05)
        assert side.get_finished() == (set(), set())
        assert all(not target[name].any() for name in LAYERS)  # the late answer wrote nothing
        assert side.take_stats()["load_failures_timeout"] == 1
    finally:
        release.set()
        calls.shutdown()


def test_loads_of_one_step_are_all_received_with_their_blocks_in_place():
    store = ScriptedStore()
    source = kv_caches("random")
    saver = WorkerSide(NS, store, config(), saves_enabled=True)
    saver.register_kv_caches(source, [LAYERS], NUM_BLOCKS)
    saver.wait_for_save(KVToolMetadata(saves=[prompt_save("a", 0, 85, [1, 2, 3])]))
    saver.shutdown()
    target = kv_caches("zeros")
    side = WorkerSide(NS, store, config(), saves_enabled=False, load_calls=InlineCalls())
    side.register_kv_caches(target, [LAYERS], NUM_BLOCKS)
    side.start_load_kv(KVToolMetadata(loads=[RequestLoad("x", prompt_save("x", 0, 85, [4, 5, 6]).transfers)]))
    assert side.get_finished() == ({"x"}, set())
    for name in LAYERS:
        assert torch.equal(source[name][3], target[name][6])
    kinds = [t.kind for t in prompt_save("x", 0, 85, [4, 5, 6]).transfers]
    assert kinds == [KeyKind.BLOCK, KeyKind.BLOCK, KeyKind.TAIL]


def test_a_save_that_fails_unexpectedly_costs_that_save_only_and_gives_its_slots_back():
    class Broken(ScriptedStore):
        def exists(self, keys):
            raise RuntimeError("a bug, not a store error")

    store = Broken()
    side = WorkerSide(NS, store, config(), saves_enabled=True)
    side.register_kv_caches(kv_caches("random"), [LAYERS], NUM_BLOCKS)
    side.wait_for_save(KVToolMetadata(saves=[prompt_save("a", 0, 85, [1, 2, 3])]))
    side.wait_for_save(KVToolMetadata(saves=[prompt_save("b", 500, 85, [4, 5, 6])]))
    side.shutdown()
    assert side.take_stats()["saves_crashed"] == 2  # the put thread lived on to the second save
    assert side._saver.area.free_slots == side._saver.area.slots


def tail_save_after_a_lookup():
    """An 85-token prompt whose lookup found its two blocks stored: the save puts only the tail."""
    from connector.data import StoredObject

    keys = PromptKeys.build(list(range(85)), 32, 1, NS.key_component(), b"\0" * 16)
    planned = plan_save(keys)  # blocks 32 and 64, the tail at 85
    tail = planned[2]
    found = tuple(StoredObject(s.kind, s.token_start, s.token_end, s.group, s.chain_hash) for s in planned[:2])
    save = RequestSave(
        "a",
        (BlockTransfer(3, tail.kind, tail.token_start, tail.token_end, tail.chain_hash),),
        already_stored=found,
        prompt_tokens=85,
    )
    return planned, save


def saved_side(store, *steps):
    """A worker that saved each step's saves into ``store``, shut down (every put done)."""
    side = WorkerSide(NS, store, config(), saves_enabled=True)
    side.register_kv_caches(kv_caches("random"), [LAYERS], NUM_BLOCKS)
    for saves in steps:
        side.wait_for_save(KVToolMetadata(saves=list(saves)))
    side.shutdown()
    return side


def saved_with(store, save):
    side = saved_side(store, [save])
    return records(store)[1], side.take_stats()


def test_objects_a_lookup_found_stored_are_asked_again_and_the_watermark_stops_at_one_gone():
    """The lookup found blocks 0 and 1 stored, seconds before the save; block 1 was evicted since. The
    put thread asks again with the save's own objects: the record stops at 32, the object is counted."""
    planned, save = tail_save_after_a_lookup()
    store = ScriptedStore()
    store.objects[planned[0].key] = b"block 0, still stored"
    final, stats = saved_with(store, save)
    assert (final.state, final.durable_offset, final.tail_durable) == (SaveState.FAILED, 32, False)
    assert "gone" in final.reason
    assert stats["saves_gone"] == 1 and stats["saves_stored"] == 1 and "saves_unchecked" not in stats


def test_objects_found_stored_before_are_not_durable_when_the_store_does_not_answer_again():
    _, save = tail_save_after_a_lookup()
    store = ScriptedStore()
    store.fail_exists = True
    final, stats = saved_with(store, save)
    assert final.durable_offset == 0 and stats["saves_unchecked"] == 2


def test_a_final_record_the_breaker_skipped_once_is_put_again(monkeypatch):
    """A put that stalled just before (Mooncake TCP's first transfer to a segment) opened the breaker,
    which skipped the save's final record: readers wait for that record, so it is put once more."""
    from connector.worker import saver as module
    from connector.calls import StoreError

    monkeypatch.setattr(module, "FINAL_RECORD_RETRY_S", 0.0)

    class SkipsTheFirstFinalRecord(ScriptedStore):
        skipped = 0

        def put(self, key, value):
            if "/w/" in key and key.endswith("/1") and not self.skipped:
                self.skipped += 1
                raise StoreError("the breaker is open: put skipped")
            return super().put(key, value)

    store = SkipsTheFirstFinalRecord()
    side = saved_side(store, [prompt_save("a", 0, 85, [1, 2, 3])])
    assert store.skipped == 1
    final = records(store)[1]
    assert (final.state, final.durable_offset) == (SaveState.DURABLE, 85)
    assert side.take_stats()["watermarks_stored"] == 2


def test_a_store_that_refuses_final_records_twice_is_not_tried_twice_again(monkeypatch):
    """Each second try holds the put thread: once one failed, later saves' final records get one try
    (for ``FINAL_RECORD_RETRY_PAUSE_S``), so saves queued behind a store that stays down drain fast."""
    from connector.worker import saver as module
    from connector.calls import StoreError

    monkeypatch.setattr(module, "FINAL_RECORD_RETRY_S", 0.0)

    class RefusesRecords(ScriptedStore):
        tries = 0  # of final records

        def put(self, key, value):
            if "/w/" in key:  # down for every record (a put that works says the store is back)
                self.tries += key.endswith("/1")
                raise StoreError("the store is down")
            return super().put(key, value)

    store = RefusesRecords()
    side = saved_side(store, [prompt_save("a", 0, 85, [1, 2, 3])], [prompt_save("b", 0, 85, [4, 5, 6])])
    assert store.tries == 3  # the first save's two tries, the second's one
    assert side.take_stats()["watermarks_failed"] == 4  # pending and final records of both saves


def test_saves_whose_objects_are_all_stored_answer_saves_and_checkpoints_are_not_reported_unsaved():
    failing = ScriptedStore()
    failing.put_outcome_for = lambda key: PutOutcome.NO_SPACE if "/b/" in key else PutOutcome.STORED
    answer = replace(prompt_save("b", 0, 85, [1, 2, 3]), answer=True)  # an answer save's failures: its own
    checkpoint = replace(prompt_save("d", 0, 85, [4, 5, 6]), checkpoint=True)  # a state short of the prompt
    refused = saved_side(failing, [answer, checkpoint])
    stats = refused.take_stats()
    assert stats["saves_no_space"] == 4 and "saves_crashed" not in stats  # both saves' block puts failed
    for side in (refused, saved_side(ScriptedStore(), [prompt_save("c", 0, 85, [4, 5, 6])])):
        meta = side.take_worker_meta()
        assert meta is None or not meta.unsaved
