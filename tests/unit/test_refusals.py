"""Puts refused for space: a full store, or a restarted master with no segment mounted yet (issue 41)."""

from __future__ import annotations

import logging
import time

from connector.store.backend import PutOutcome
from connector.calls import StoreError
from connector.store.refusals import Refusals
from connector.worker.worker import WorkerSide
from connector.data import KVToolMetadata

from .scripted_store import ScriptedStore
from .test_saver import config, prompt_save
from .test_worker import LAYERS, NS, NUM_BLOCKS, kv_caches, records


def wait_for_records(store: ScriptedStore, count: int, timeout_s: float = 30.0) -> None:
    """Until the saver's put thread has written ``count`` watermark records (a sync point, not a timing)."""
    deadline = time.monotonic() + timeout_s
    while len(records(store)) < count:
        assert time.monotonic() < deadline, f"{len(records(store))} watermark records of {count}"
        time.sleep(0.01)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_refusal_while_the_newest_stored_key_is_held_is_a_full_store():
    held = {"k1"}
    refusals = Refusals(lambda keys: [key in held for key in keys], clock=Clock())
    refusals.stored("k1")
    assert refusals.judge() is PutOutcome.NO_SPACE


def test_a_refusal_after_the_store_lost_the_newest_stored_key_is_not_ready():
    held: set[str] = set()  # the master restarted: it holds nothing
    refusals = Refusals(lambda keys: [key in held for key in keys], clock=Clock())
    refusals.stored("k1")
    assert refusals.judge() is PutOutcome.NOT_READY


def test_with_nothing_stored_yet_a_refusal_is_a_full_store_and_a_store_that_does_not_answer_is_not_ready():
    def failing(keys):
        raise StoreError("down")

    assert Refusals(failing, clock=Clock()).judge() is PutOutcome.NO_SPACE
    refusals = Refusals(failing, clock=Clock())
    refusals.stored("k1")
    assert refusals.judge() is PutOutcome.NOT_READY


def test_the_verdict_is_asked_at_most_once_a_recheck_and_anew_after_a_put_is_taken():
    asked, clock, held = [], Clock(), {"k1"}

    def exists(keys):
        asked.append(list(keys))
        return [key in held for key in keys]

    refusals = Refusals(exists, clock=clock, recheck_s=1.0)
    refusals.stored("k1")
    assert [refusals.judge() for _ in range(5)] == [PutOutcome.NO_SPACE] * 5 and len(asked) == 1
    held.clear()  # the master restarted meanwhile
    assert refusals.judge() is PutOutcome.NO_SPACE  # the verdict holds for its second
    clock.now += 1.5
    assert refusals.judge() is PutOutcome.NOT_READY and len(asked) == 2
    refusals.stored("k2")
    held.add("k2")
    assert refusals.judge() is PutOutcome.NO_SPACE and asked[-1] == ["k2"]


def test_each_episode_is_logged_when_it_starts_and_a_not_ready_one_when_it_ends(caplog):
    held: set[str] = set()
    clock = Clock()
    refusals = Refusals(lambda keys: [key in held for key in keys], clock=clock)
    refusals.stored("k1")
    held.clear()
    with caplog.at_level(logging.WARNING, logger="vllm.kvtool"):
        for _ in range(3):
            refusals.judge()
        clock.now += 2.0
        refusals.stored("k2")
    said = [record.getMessage() for record in caplog.records]
    assert len(said) == 2, said
    assert "no longer holds what this engine stored" in said[0]
    assert "takes puts again after 2.0 s not ready (3 puts refused meanwhile)" in said[1]


def test_a_saver_counts_the_puts_a_restarted_master_refuses_as_not_ready():
    store = ScriptedStore()
    side = WorkerSide(NS, store, config(), saves_enabled=True)
    side.register_kv_caches(kv_caches("random"), [LAYERS], NUM_BLOCKS)
    side.wait_for_save(KVToolMetadata(saves=[prompt_save("a", 0, 85, [1, 2, 3])]))
    wait_for_records(store, 2)  # save a ended (pending and final records): its keys are the newest stored
    # The master restarts: every key is lost, and every put is refused for space until segments mount.
    store.objects.clear()
    store.put_outcome_for = lambda key: PutOutcome.NO_SPACE
    side.wait_for_save(KVToolMetadata(saves=[prompt_save("b", 1000, 85, [4, 5, 6])]))
    side.shutdown()
    stats = side.take_stats()
    assert stats.get("saves_not_ready") == 3 and "saves_no_space" not in stats, stats
    assert stats.get("watermarks_not_ready", 0) >= 1


def test_a_saver_still_counts_a_full_store_as_no_space():
    store = ScriptedStore()
    side = WorkerSide(NS, store, config(), saves_enabled=True)
    side.register_kv_caches(kv_caches("random"), [LAYERS], NUM_BLOCKS)
    side.wait_for_save(KVToolMetadata(saves=[prompt_save("a", 0, 85, [1, 2, 3])]))
    wait_for_records(store, 2)
    store.put_outcome_for = lambda key: PutOutcome.NO_SPACE if "/w/" not in key else PutOutcome.STORED
    side.wait_for_save(KVToolMetadata(saves=[prompt_save("b", 1000, 85, [4, 5, 6])]))
    side.shutdown()
    stats = side.take_stats()
    assert stats.get("saves_no_space") == 3 and "saves_not_ready" not in stats, stats
