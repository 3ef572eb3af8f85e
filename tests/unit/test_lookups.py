"""Asynchronous lookups: one batch a step for every new request, never waited on, a miss past the time-out."""

from __future__ import annotations

import threading

from connector.calls import BoundedCalls, StoreError
from connector.core.hashing import RequestIdentity
from connector.scheduler.lookups import LookupBatcher
from connector.core.prefix import PromptKeys, plan_save
from connector.core.search import find_stored_prefix

from .scripted_store import CountingStore, InlineCalls, ScriptedStore

ROOT = RequestIdentity().root_hash()


def keys(tokens):
    return PromptKeys.build(tokens, 32, 1, "ns", ROOT)


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def publish(store, tokens):
    for save in plan_save(keys(tokens)):
        store.objects[save.key] = b"x"


def test_every_request_of_a_step_goes_out_in_one_batch_of_at_most_two_queries():
    store = CountingStore()
    prompts = {f"r{i}": list(range(i * 1000, i * 1000 + 20 + 17 * i)) for i in range(6)}
    publish(store, prompts["r1"])
    publish(store, prompts["r4"][:40])  # r4 hits a stored shorter prompt: the second query
    batcher = LookupBatcher(store.exists, 2.0, calls=InlineCalls())
    for req_id, tokens in prompts.items():
        batcher.want(req_id, keys(tokens))
        assert batcher.poll(req_id) is None  # not sent yet: vLLM retries next step
    batcher.flush()
    assert store.queries == 2 and batcher.batches == 1
    for req_id, tokens in prompts.items():
        # The same hit as a lookup of its own (which may ask other keys: a batch asks the first block's
        # candidates first for its first prompts only, ``search._first_block_probes``).
        alone, batched = find_stored_prefix(keys(tokens), store.exists), batcher.poll(req_id)
        assert (batched.tokens, batched.hit_tokens) == (alone.tokens, alone.hit_tokens)
    assert batcher.poll("r1").tokens == len(prompts["r1"]) and batcher.poll("r4").tokens == 40


def test_a_lookup_that_does_not_answer_in_time_is_a_miss_and_later_requests_wait_for_the_next_batch():
    release = threading.Event()
    store = ScriptedStore()
    clock = Clock()
    calls = BoundedCalls("test-lookup", limit=1)

    def hanging_exists(query):
        release.wait()
        return store.exists(query)

    batcher = LookupBatcher(hanging_exists, 2.0, clock=clock, calls=calls)
    try:
        batcher.want("a", keys(range(50)))
        batcher.flush()
        assert batcher.poll("a") is None  # in flight: the scheduler is not held
        batcher.want("b", keys(range(60)))
        batcher.flush()  # a job is still out: b waits for the next batch, no second thread
        assert calls.in_flight == 1
        clock.now += 2.5
        assert isinstance(batcher.poll("a"), StoreError) and batcher.timeouts == 1
        assert isinstance(batcher.poll("b"), StoreError)  # b too has waited past its time-out
        release.set()
    finally:
        release.set()
        calls.shutdown()


def test_a_failing_store_answers_every_request_of_the_batch_with_the_error():
    store = ScriptedStore()
    store.fail_exists = True
    batcher = LookupBatcher(store.exists, 2.0, calls=InlineCalls())
    batcher.want("a", keys(range(50)))
    batcher.want("b", keys(range(70)))
    batcher.flush()
    assert isinstance(batcher.poll("a"), StoreError) and isinstance(batcher.poll("b"), StoreError)


def test_a_forgotten_request_is_asked_afresh():
    store = ScriptedStore()
    batcher = LookupBatcher(store.exists, 2.0, calls=InlineCalls())
    batcher.want("a", keys(range(50)))
    batcher.flush()
    assert batcher.poll("a").tokens == 0
    publish(store, list(range(50)))
    batcher.forget("a")
    batcher.want("a", keys(range(50)))
    batcher.flush()
    assert batcher.poll("a").tokens == 50


def test_an_answer_goes_only_to_the_lookup_its_job_was_sent_for():
    """Forgotten while its job is out (an abort), then asked again under the same id for another prompt
    (vLLM's request ids not randomized): the old job's answer, for the old prompt, is not the new one's."""
    release = threading.Event()
    store = ScriptedStore()
    publish(store, list(range(50)))
    calls = BoundedCalls("test-lookup", limit=1)

    def gated_exists(query):
        release.wait(timeout=30)
        return store.exists(query)

    batcher = LookupBatcher(gated_exists, 30.0, calls=calls)
    try:
        batcher.want("a", keys(range(50)))
        batcher.flush()
        batcher.forget("a")
        batcher.want("a", keys(range(1000, 1050)))  # another prompt, nothing of it stored
        release.set()
        outcome = None
        for _ in range(3):  # the old job answers, then (whenever it is sent) the new prompt's own
            batcher.settle(30.0)
            if (outcome := batcher.poll("a")) is not None:
                break
        assert outcome is not None and outcome.tokens == 0  # never the old prompt's 50 stored tokens
    finally:
        release.set()
        calls.shutdown()
