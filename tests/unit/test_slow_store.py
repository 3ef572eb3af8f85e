"""A slow store costs hits, never time (issue 38): a call that answers slower than ``slow_call_ms``
counts toward the breaker like a failure, so that a store answering slowly is bypassed (requests are
misses at once, nothing waits) until a trial call answers quickly again; a request waits for its lookup
at most what its best hit could save; and a lookup given up on is reported to the breaker."""

from __future__ import annotations

import concurrent.futures
import logging
import threading

import pytest

from connector.store.breaker import BreakerPolicy, CircuitBreaker, GuardedStore, report_slow
from connector.calls import BoundedCalls
from connector.counters import Counters
from connector.scheduler.lookups import LookupAbandoned, LookupBatcher
from connector.scheduler.lookupwait import WAIT_FLOOR_S, LookupPacing
from connector.core.profit import CostModel
from connector.scheduler.scheduler import SchedulerSide

from .scripted_store import InlineCalls, ScriptedStore
from .test_lookups import keys
from .test_scheduler import CONFIG, EMPTY_STEP, NS, PROMPT, publish, request

SLOW_S = 0.05


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class DelayedStore(ScriptedStore):
    """Each existence query takes ``delay_s`` of the test's clock (the store answers, slowly)."""

    def __init__(self, clock: Clock):
        super().__init__()
        self.clock = clock
        self.delay_s = 0.0
        self.queries = 0

    def exists(self, keys):
        self.queries += 1
        self.clock.now += self.delay_s
        return super().exists(keys)


def guarded(clock: Clock) -> tuple[DelayedStore, GuardedStore]:
    store = DelayedStore(clock)
    breaker = CircuitBreaker(BreakerPolicy(failures_to_open=3, backoff_s=1.0, max_backoff_s=10.0), clock=clock)
    return store, GuardedStore(store, breaker, "scheduler", slow_call_s=SLOW_S, clock=clock)


def test_slow_answers_open_the_breaker_and_a_quick_trial_closes_it(caplog):
    clock = Clock()
    store, guard = guarded(clock)
    store.delay_s = 0.2  # answers, 4x over the threshold
    with caplog.at_level(logging.WARNING, logger="vllm.kvtool"):
        for _ in range(3):
            assert guard.exists(["k"]) == [False]  # a slow answer is still an answer
        assert guard.breaker.is_open
        asked = store.queries
        for _ in range(5):
            try:
                guard.exists(["k"])
            except Exception as exc:  # noqa: BLE001
                assert "bypassed" in str(exc)
        assert store.queries == asked  # bypassed: not asked
        store.delay_s = 0.001
        clock.now += 1.5  # past the back-off: one trial, quick
        assert guard.exists(["k"]) == [False]
        assert not guard.breaker.is_open
    stats = guard.take_stats()
    assert stats["store_slow_exists"] == 3 and stats["store_bypassed_slow"] == 1 and stats["breaker_opened"] == 1
    said = [r.getMessage() for r in caplog.records]
    assert any("the store is slow (exists answered in 200 ms, over slow_call_ms 50)" in m for m in said), said
    assert any("answers quickly again" in m and "bypassed" in m for m in said), said


def test_a_slow_trial_keeps_the_store_bypassed_with_a_longer_back_off():
    clock = Clock()
    store, guard = guarded(clock)
    store.delay_s = 0.2
    for _ in range(3):
        guard.exists(["k"])
    first = guard.breaker.seconds_left()
    clock.now += first + 0.01
    guard.exists(["k"])  # the trial: slow again
    assert guard.breaker.is_open and guard.breaker.seconds_left() > first


def test_a_quick_store_never_counts_slow():
    clock = Clock()
    store, guard = guarded(clock)
    store.delay_s = SLOW_S / 2
    for _ in range(20):
        guard.exists(["k"])
    assert not guard.breaker.is_open and "store_slow_exists" not in guard.take_stats()


def test_a_lookup_past_what_its_hit_could_save_is_abandoned_and_reported():
    clock, late = Clock(), []
    pending: concurrent.futures.Future = concurrent.futures.Future()

    class HeldCalls:
        def submit(self, fn, what):
            return pending  # the store has not answered

    on_late = lambda why, store_s: late.append((why, store_s))  # noqa: E731
    batcher = LookupBatcher(lambda k: [False] * len(k), 2.0, clock=clock, calls=HeldCalls(), on_late=on_late)
    batcher.want("a", keys(list(range(100))), wait_s=0.05)
    clock.now += 0.5  # the engine ran a long step before it sent the batch: not the store's time
    batcher.flush()
    assert batcher.poll("a") is None
    clock.now += 0.04
    assert batcher.poll("a") is None  # 40 ms on the store: within its 50 ms
    batcher.want("b", keys(list(range(200, 300))), wait_s=0.05)  # held back by the job out
    clock.now += 0.02
    outcome = batcher.poll("a")
    assert isinstance(outcome, LookupAbandoned) and "60 ms" in str(outcome)
    assert batcher.poll("b") is None  # asked 20 ms ago: within its bound
    clock.now += 0.04
    assert isinstance(batcher.poll("b"), LookupAbandoned)  # held back 60 ms by the slow job
    assert len(late) == 2 and batcher.take_stats()["lookups_abandoned"] == 2
    assert [store_s for _, store_s in late] == [0.0, 0.0]  # no store call was out: the job never ran


def test_a_lookup_given_up_on_says_how_long_its_store_call_has_been_out():
    clock, late = Clock(), []
    entered, release = threading.Event(), threading.Event()

    def exists(keys):
        entered.set()
        release.wait(10)
        return [False] * len(keys)

    calls = BoundedCalls("test-lookup", limit=1)
    on_late = lambda why, store_s: late.append(store_s)  # noqa: E731
    batcher = LookupBatcher(exists, 2.0, clock=clock, calls=calls, on_late=on_late)
    batcher.want("a", keys(list(range(100))), wait_s=0.05)
    batcher.flush()
    assert entered.wait(10)
    clock.now += 0.3  # the store call has been out 300 ms
    assert isinstance(batcher.poll("a"), LookupAbandoned)
    release.set()
    assert late == [pytest.approx(0.3)]


def scheduler_side(slow_call_ms: float = 150.0) -> tuple[SchedulerSide, CircuitBreaker]:
    breaker = CircuitBreaker(BreakerPolicy(failures_to_open=1))
    config = CONFIG.model_copy(update={"slow_call_ms": slow_call_ms})
    side = SchedulerSide(config, NS, ScriptedStore(), loads_enabled=True, saves_enabled=False, breaker=breaker)
    return side, breaker


def test_a_lookup_late_while_a_store_call_is_slow_bypasses_the_store():
    side, breaker = scheduler_side()
    side._pacing.late("the lookup took over 1200 ms", store_s=1.1)
    assert breaker.is_open and side.take_stats()["store_slow_lookup"] == 1


def test_a_lookup_late_for_want_of_cpu_is_a_miss_but_keeps_the_store(caplog):
    """A CPU engine's forward pass holds the cores the lookup thread runs on: the lookup is late with no
    store call out (or a quick one). The request is a miss; the store is not bypassed for it."""
    side, breaker = scheduler_side()
    with caplog.at_level(logging.WARNING, logger="vllm.kvtool"):
        side._pacing.late("lookup timed out after 2 s", store_s=0.0)
        side._pacing.late("lookup timed out after 2 s", store_s=0.01)
    assert not breaker.is_open
    stats = side.take_stats()
    assert stats["lookups_late_busy"] == 2 and "store_slow_lookup" not in stats
    assert sum("too busy" in r.getMessage() for r in caplog.records) == 1  # warned once


def test_a_request_waits_at_most_the_prefill_its_best_hit_saves():
    model = CostModel.given(load_fixed_ms=2.0, load_mb_per_s=1000.0, prefill_us_per_token=500.0)
    pacing = LookupPacing(model, None, timeout_s=5.0)
    assert pacing.request_wait_s(10) == WAIT_FLOOR_S  # 5 ms of prefill: the floor
    assert abs(pacing.request_wait_s(6000) - 3.0) < 1e-6  # 3 s of prefill
    assert pacing.request_wait_s(100_000) == 5.0  # never past the time-out
    assert LookupPacing(CostModel(), None, timeout_s=2.0).request_wait_s(10) == 2.0  # nothing measured yet


def test_a_slow_store_becomes_misses_at_once_and_hits_again_once_it_is_quick():
    """The scheduler side over a store that turns slow: within the breaker's three slow calls its
    requests are misses at once, with no lookup; once the store is quick again, past the back-off, the
    next request's lookup is the trial and hits."""
    clock = Clock()
    store, guard = guarded(clock)
    publish(store, PROMPT)
    side = SchedulerSide(
        CONFIG, NS, guard, loads_enabled=True, saves_enabled=False, lookup_calls=InlineCalls(), breaker=guard.breaker
    )
    assert side.get_num_new_matched_tokens(request(PROMPT + [1], "healthy"), 0) == (85, True)
    store.delay_s = 1.2
    answers = []
    for number in range(6):
        req = request(PROMPT + [10 + number], f"slow-{number}")
        answer = side.get_num_new_matched_tokens(req, 0)
        if answer[0] is None:
            side.build_connector_meta(EMPTY_STEP)
            answer = side.get_num_new_matched_tokens(req, 0)
        answers.append(answer)
    assert guard.breaker.is_open
    asked = store.queries
    assert answers[-2:] == [(0, False), (0, False)]  # bypassed: misses at once
    assert store.queries == asked
    store.delay_s = 0.001
    clock.now += 20.0  # past any back-off
    assert side.get_num_new_matched_tokens(request(PROMPT + [99], "recovered"), 0) == (85, True)
    assert not guard.breaker.is_open
    stats = side.take_stats()
    assert stats["lookups_bypassed"] >= 2 and stats.get("store_bypassed_slow", 0) >= 1


def test_report_slow_counts_and_opens_like_a_failure():
    breaker, stats = CircuitBreaker(BreakerPolicy(failures_to_open=2)), Counters()
    report_slow(breaker, stats, "scheduler", "lookup", "a lookup given up")
    assert not breaker.is_open
    report_slow(breaker, stats, "scheduler", "lookup", "a lookup given up")
    assert breaker.is_open and breaker.bypassed_at is not None
    assert stats.take() == {"store_slow_lookup": 2, "breaker_opened": 1, "store_bypassed_slow": 1}
