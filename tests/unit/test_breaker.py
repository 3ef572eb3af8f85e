"""The circuit breaker and the bounded call slots: a failing or hung store is skipped, never waited on."""

from __future__ import annotations

import threading

import pytest
from hypothesis import given
from hypothesis import strategies as st

from connector.store.breaker import BreakerPolicy, CircuitBreaker, GuardedStore
from connector.calls import BoundedCalls, StoreBusy, StoreError, StoreTimeout
from connector.scheduler.scheduler import SchedulerSide

from .scripted_store import CountingStore, InlineCalls, ScriptedStore
from .test_scheduler import CONFIG, EMPTY_STEP, NS, PROMPT, publish, request


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_three_failures_in_a_row_open_it_for_the_backoff_then_one_trial_goes_through():
    clock = Clock()
    breaker = CircuitBreaker(BreakerPolicy(failures_to_open=3, backoff_s=1.0), clock)
    assert not breaker.record_failure() and not breaker.record_failure()
    assert breaker.record_failure()  # the third opens it
    assert not breaker.allow() and breaker.is_open
    clock.now += 1.01
    assert breaker.allow()  # the trial call
    assert not breaker.allow()  # only one while it is out
    assert breaker.record_failure()  # the trial failed: open again, for twice as long
    clock.now += 1.5
    assert not breaker.allow()
    clock.now += 0.6
    assert breaker.allow()
    assert breaker.record_success()  # closed again
    assert breaker.allow() and breaker.allow() and not breaker.is_open


def test_a_success_resets_the_count_of_failures():
    breaker = CircuitBreaker(BreakerPolicy(failures_to_open=2), Clock())
    breaker.record_failure()
    breaker.record_success()
    assert not breaker.record_failure()
    assert breaker.allow()


def test_a_hung_call_opens_it_at_once():
    breaker = CircuitBreaker(BreakerPolicy(failures_to_open=5), Clock())
    assert breaker.record_failure(hung=True) and not breaker.allow()


@given(st.lists(st.sampled_from(["ok", "fail", "hung", "wait"]), max_size=60))
def test_the_backoff_stays_within_its_bounds_and_closed_means_allowed(events):
    clock = Clock()
    policy = BreakerPolicy(failures_to_open=3, backoff_s=0.5, max_backoff_s=4.0)
    breaker = CircuitBreaker(policy, clock)
    for event in events:
        if event == "wait":
            clock.now += 1.0
        elif breaker.allow():
            if event == "ok":
                breaker.record_success()
            else:
                breaker.record_failure(hung=event == "hung")
        assert 0.0 <= breaker.seconds_left() <= policy.max_backoff_s
        if not breaker.is_open:
            assert breaker.seconds_left() == 0.0
    clock.now += policy.max_backoff_s + 0.01
    assert breaker.allow()  # whatever happened, a trial goes through after the longest back-off


def test_an_open_breaker_skips_store_calls_and_counts_them():
    store = ScriptedStore()
    store.fail_exists = True
    clock = Clock()
    guarded = GuardedStore(store, CircuitBreaker(BreakerPolicy(failures_to_open=2), clock), "test")
    for _ in range(2):
        with pytest.raises(StoreError):
            guarded.exists(["k"])
    store.fail_exists = False
    with pytest.raises(StoreError, match="skipped"):
        guarded.exists(["k"])  # open: the healthy store is not even asked
    clock.now += 1.01
    assert guarded.exists(["k"]) == [False]  # the trial succeeds and closes it
    stats = guarded.take_stats()
    assert stats == {"store_errors_exists": 2, "breaker_opened": 1, "breaker_skipped_exists": 1}


def test_a_trial_call_that_raises_something_else_than_a_store_error_ends_the_trial():
    """A bug on a call's way to the store must not leave the breaker waiting for the trial's outcome
    (open for good: every later call skipped)."""
    store = ScriptedStore()
    store.fail_exists = True
    clock = Clock()
    guarded = GuardedStore(store, CircuitBreaker(BreakerPolicy(failures_to_open=1), clock), "test")
    with pytest.raises(StoreError):
        guarded.exists(["k"])
    clock.now += 1.01

    def broken(keys, object_bytes=0):
        raise RuntimeError("a bug")

    store.get = broken
    with pytest.raises(RuntimeError):
        guarded.get(["k"])  # the trial
    store.fail_exists = False
    clock.now += 2.01  # the back-off, doubled by the failed trial
    assert guarded.exists(["k"]) == [False]  # a new trial goes through and closes it
    assert not guarded.breaker.is_open


def test_calls_that_hang_take_every_slot_and_later_calls_fail_at_once():
    release = threading.Event()
    calls = BoundedCalls("test", limit=2)
    try:
        for _ in range(2):
            with pytest.raises(StoreTimeout):
                calls.call(release.wait, 0.01, "a hung call")
        with pytest.raises(StoreBusy):
            calls.submit(lambda: 1, "one more")  # refused, not queued behind the stuck ones
        release.set()
        # The stuck calls return and give their slots back.
        for _ in range(100):
            if calls.in_flight == 0:
                break
            threading.Event().wait(0.05)
        assert calls.call(lambda: 7, 5.0, "a call") == 7
    finally:
        release.set()
        calls.shutdown()


def test_while_the_breaker_is_open_a_request_is_a_miss_at_once_with_no_lookup():
    """A failing or slow store is bypassed: no step waits for a lookup and no request waits a step for
    one; the store is not even asked. Once the breaker lets calls through again, requests hit again."""

    class Breaker:
        is_open = False

    store, breaker = CountingStore(), Breaker()
    publish(store, PROMPT)
    side = SchedulerSide(
        CONFIG, NS, store, loads_enabled=True, saves_enabled=False, lookup_calls=InlineCalls(), breaker=breaker
    )
    assert side.get_num_new_matched_tokens(request(PROMPT + [1], "healthy"), 0) == (85, True)
    asked = store.queries
    breaker.is_open = True
    req = request(PROMPT + [2], "bypassed")
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)  # a miss in the step it arrived in
    side.build_connector_meta(EMPTY_STEP)
    assert store.queries == asked  # nothing was asked
    assert side.take_stats()["lookups_bypassed"] == 1
    breaker.is_open = False
    assert side.get_num_new_matched_tokens(request(PROMPT + [3], "again"), 0) == (85, True)
