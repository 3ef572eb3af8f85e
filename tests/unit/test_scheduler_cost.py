"""The scheduler side's cost model at work: fed the worker's measurements and the requests' delays, it
declines the hits whose load costs more than the prefill they save (the model itself: test_profit.py)."""

from __future__ import annotations

from types import SimpleNamespace

from connector.scheduler.scheduler import SchedulerSide

from .scripted_store import CountingStore, InlineCalls, ScriptedStore
from .test_scheduler import CONFIG, EMPTY_STEP, NS, PROMPT, allocate, lookup, publish, request


def fed_consumer(store, *, load_s: float, prefill_s_per_token: float, block_bytes: int = 1 << 20, **role):
    """A consumer (or, with ``role``'s SchedulerSide flags, another engine) whose cost model has seen
    loads that wait ``load_s`` plus 1 ms per MB, and forward passes of ``prefill_s_per_token`` a token,
    as the worker reports them with each step."""
    from connector.data import KVToolWorkerMeta

    side = SchedulerSide(
        role.pop("config", CONFIG),
        NS,
        store,
        loads_enabled=True,
        lookup_calls=InlineCalls(),
        block_bytes=(block_bytes,),
        **{"saves_enabled": False, **role},
    )
    loads = [(n * block_bytes, n * block_bytes * 1e-9, load_s + n * block_bytes * 1e-9) for n in range(1, 7)]
    steps = [(t, 0.001 + t * prefill_s_per_token) for t in (1, 16, 64, 256, 1024)]
    side.record_worker_meta(KVToolWorkerMeta({}, loads, steps))
    return side


def unfed_consumer(store, block_bytes: int = 1 << 20) -> SchedulerSide:
    """A consumer whose cost model has seen nothing yet."""
    return SchedulerSide(
        CONFIG,
        NS,
        store,
        loads_enabled=True,
        saves_enabled=False,
        lookup_calls=InlineCalls(),
        block_bytes=(block_bytes,),
    )


def test_a_hit_that_costs_more_to_load_than_to_compute_is_not_taken_and_says_why():
    store = ScriptedStore()
    publish(store, PROMPT)
    # A load waits 1 ms and moves 1 GB/s; a token's prefill costs 0.1 ms: 87 tokens could pay for a load
    # (the lookup is made), but the hit's three 1 GB objects take 3 s to load for 8.5 ms of prefill.
    side = fed_consumer(store, load_s=0.001, prefill_s_per_token=1e-4, block_bytes=1 << 30)
    req = request(PROMPT + [1, 2, 3])
    assert lookup(side, req) == (0, False)
    details = side.request_finished(req)[1]["kvtool"]
    assert details["lookup"] == "miss" and details["external_hit_tokens"] == 0
    assert details["load_skipped"].startswith("unprofitable: a load of")
    assert side.take_stats()["loads_unprofitable"] == 1


def test_no_lookup_is_made_when_no_hit_could_pay_and_the_request_says_why():
    """A load waits 50 ms and a token's prefill costs 0.01 ms: no hit of an 88-token prompt can pay,
    so the request is computed without waiting for a lookup's round trip. Decided once a request."""
    store = CountingStore()
    publish(store, PROMPT)
    side = fed_consumer(store, load_s=0.050, prefill_s_per_token=1e-5)
    req = request(PROMPT + [1, 2, 3])
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)  # at once: no step waits for an answer
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)  # not scheduled yet: asked again
    side.build_connector_meta(EMPTY_STEP)
    assert store.queries == 0
    details = side.request_finished(req)[1]["kvtool"]
    assert details["lookup"].startswith("not looked up: no hit could pay: a load costs 5")
    assert details["external_hit_tokens"] == 0
    assert side.take_stats()["lookups_not_worth"] == 1


def test_a_prompt_the_engine_holds_but_its_last_token_is_never_looked_up():
    store = CountingStore()
    publish(store, PROMPT)
    side = unfed_consumer(store)  # the cost model knows nothing yet: every hit would be taken
    req = request(PROMPT[:65])
    assert side.get_num_new_matched_tokens(req, 64) == (0, False)
    assert store.queries == 0
    assert side.request_finished(req)[1]["kvtool"]["lookup"].endswith("every token a hit could claim")


def test_an_engine_that_saves_looks_up_even_where_no_hit_could_pay():
    """Its lookup also tells its save what is stored already (kv_both)."""
    store = CountingStore()
    publish(store, PROMPT)
    side = fed_consumer(store, load_s=0.050, prefill_s_per_token=1e-5, saves_enabled=True)
    assert lookup(side, request(PROMPT + [1, 2, 3])) == (0, False)
    assert store.queries >= 1


def test_a_partial_block_that_does_not_pay_is_dropped_and_the_full_blocks_are_loaded():
    store = ScriptedStore()
    publish(store, PROMPT)  # 85 tokens: two blocks and a tail of 21
    publish(store, PROMPT[:70])  # two blocks and a tail of 6
    # An object loads in about 1 ms (plus 1 ms a load) and a token's prefill costs 0.06 ms: the blocks
    # pay (64 tokens, 3.8 ms, for 3.1 ms); a tail of 21 tokens pays (1.3 ms for 1.05 ms); 6 do not.
    side = fed_consumer(store, load_s=0.001, prefill_s_per_token=6e-5)
    req = request(PROMPT[:70] + [7, 7, 7])
    assert lookup(side, req) == (64, True)
    assert side.request_finished(req)[1]["kvtool"]["load_skipped"].startswith("trimmed:")
    assert lookup(side, request(PROMPT + [1, 2, 3], request_id="r2")) == (85, True)
    assert side.take_stats()["loads_trimmed"] == 1


def test_without_measurements_every_hit_is_taken():
    store = ScriptedStore()
    publish(store, PROMPT)
    side = unfed_consumer(store, block_bytes=1 << 30)
    assert lookup(side, request(PROMPT + [1, 2, 3])) == (85, True)


def test_each_loaded_request_tells_the_cost_model_its_whole_delay_when_it_is_computed():
    """From its lookup's answer to the step that computes it; not a request whose load failed."""
    from connector.data import KVToolWorkerMeta

    store = ScriptedStore()
    publish(store, PROMPT)
    side = fed_consumer(store, load_s=0.001, prefill_s_per_token=1e-3)  # every one of these hits pays
    for number, failed in ((1, False), (2, True), (3, False)):
        req = request(PROMPT + [number], request_id=f"r{number}")
        assert lookup(side, req) == (85, True)
        allocate(side, req, 85)
        side.build_connector_meta(EMPTY_STEP)  # the load goes out
        if failed:
            side.record_worker_meta(KVToolWorkerMeta({req.request_id: (0, "checksum")}))
        side.record_transfers({req.request_id}, None)
        step = SimpleNamespace(
            scheduled_new_reqs=[], scheduled_cached_reqs=None, num_scheduled_tokens={f"r{number}": 1}
        )
        side.build_connector_meta(step)
    assert side._judge.model.delay.samples == 2


def test_a_request_looked_up_to_explore_takes_its_hit_though_it_does_not_pay():
    """One request in 16 that no hit could pay for is looked up anyway, and takes its hit: the loads
    keep being measured, so a model that priced them too high once can learn otherwise."""
    from connector.core.profit import EXPLORE_EVERY

    store = CountingStore()
    publish(store, PROMPT)
    side = fed_consumer(store, load_s=0.050, prefill_s_per_token=1e-5)
    for number in range(EXPLORE_EVERY - 1):
        assert side.get_num_new_matched_tokens(request(PROMPT + [number], request_id=f"r{number}"), 0) == (0, False)
    assert store.queries == 0
    assert lookup(side, request(PROMPT + [99], request_id="explorer")) == (85, True)
    assert side.take_stats()["loads_explored"] == 1


def test_a_skipped_request_asked_again_with_more_to_gain_is_judged_again():
    """Preempted, a request holds less locally: what was not worth a lookup for 2 tokens may be for 87."""
    store = CountingStore()
    publish(store, PROMPT)
    side = fed_consumer(store, load_s=0.003, prefill_s_per_token=1e-4)  # a load: 3 ms; 30 tokens pay for it
    req = request(PROMPT + [1, 2, 3])
    assert side.get_num_new_matched_tokens(req, 85) == (0, False)  # 2 tokens to gain: not looked up
    assert store.queries == 0
    assert lookup(side, req, num_computed=0) == (85, True)  # preempted: 87 to gain, looked up and loaded


def test_a_consumer_that_saves_its_answers_looks_up_even_where_no_hit_could_pay():
    from connector.config import load_config

    store = CountingStore()
    publish(store, PROMPT)
    config = load_config({"master_server_address": "127.0.0.1:1", "save_answers": True})
    side = fed_consumer(store, load_s=0.050, prefill_s_per_token=1e-5, config=config, answers_enabled=True)
    assert lookup(side, request(PROMPT + [1, 2, 3])) == (0, False)
    assert store.queries >= 1
