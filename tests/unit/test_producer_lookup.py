"""A producer's lookup: only whether the objects its save would put are stored."""

from __future__ import annotations

import pytest

from connector.core.prefix import plan_save
from connector.scheduler.scheduler import SchedulerSide

from .scripted_store import InlineCalls, ScriptedStore
from .test_scheduler import CONFIG, NS, PROMPT, first_chunk, publish, request, step


def test_a_producer_asks_only_whether_its_own_objects_are_stored():
    """A producer never loads: its lookup is one existence query for the objects its save would put
    (no tail candidates of other lengths, no pointer read), and its save skips those found."""
    store = ScriptedStore()
    publish(store, PROMPT[:64])
    asked: list[list[str]] = []
    exists = store.exists
    store.exists = lambda keys: asked.append(list(keys)) or exists(keys)
    store.get = lambda keys, object_bytes=0: pytest.fail("a producer read a pointer")
    side = SchedulerSide(CONFIG, NS, store, loads_enabled=False, saves_enabled=True, lookup_calls=InlineCalls())
    req = request(PROMPT)
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)
    side.build_connector_meta(step())  # sends the step's lookups
    keys = side._track(req).keys
    assert asked == [[ref.key for ref in plan_save(keys)]]
    outcome = side._lookups.poll(req.request_id)
    assert sorted(outcome.present) == sorted(ref.key for ref in plan_save(keys)[:2])  # the two stored blocks


def test_a_producer_whose_lookup_fails_saves_every_object():
    """A failing store makes a producer's lookup an error, never a claim that something is stored:
    the save then copies every object of the prompt (the put thread asks the store again)."""
    store = ScriptedStore()
    publish(store, PROMPT[:64])
    store.fail_exists = True
    side = SchedulerSide(CONFIG, NS, store, loads_enabled=False, saves_enabled=True, lookup_calls=InlineCalls())
    req = request(PROMPT)
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)
    meta = side.build_connector_meta(first_chunk([4, 5, 6], 85))
    (save,) = meta.saves
    assert [(t.block_id, t.kind.value, t.token_end) for t in save.transfers] == [
        (4, "b", 32),
        (5, "b", 64),
        (6, "t", 85),
    ]
    assert save.already_stored == ()
