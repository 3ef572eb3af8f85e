"""Scheduler side with a scripted store: store errors are misses, hits are planned and reported."""

from __future__ import annotations

from types import SimpleNamespace

from connector.config import load_config
from connector.core.hashing import RequestIdentity
from connector.core.keys import Namespace
from connector.core.prefix import PromptKeys, plan_save
from connector.scheduler.scheduler import SchedulerSide

from .scripted_store import InlineCalls, ScriptedStore

NS = Namespace(model="m", dtype="float32", kv_layout="cpu", block_size=32, num_layers=2, num_kv_heads=2, head_size=64)
CONFIG = load_config({"master_server_address": "127.0.0.1:1"})
PROMPT = list(range(100, 185))


def request(tokens, request_id="r1", **extra):
    fields = {
        "request_id": request_id,
        "prompt_token_ids": tokens,
        "num_computed_tokens": 0,
        "cache_salt": None,
        "lora_request": None,
        "mm_features": [],
        "kv_transfer_params": None,
    }
    fields.update(extra)
    return SimpleNamespace(**fields)


def publish(store, tokens, salt=None):
    keys = PromptKeys.build(tokens, 32, 1, NS.key_component(), RequestIdentity(cache_salt=salt).root_hash())
    for save in plan_save(keys):
        store.objects[save.key] = b"object"


EMPTY_STEP = SimpleNamespace(scheduled_new_reqs=[], scheduled_cached_reqs=None, num_scheduled_tokens={})


def lookup(side, req, num_computed=0):
    """vLLM's view of an asynchronous lookup: None in the step that asks, the answer in the next."""
    first = side.get_num_new_matched_tokens(req, num_computed)
    if first != (None, False):
        return first
    side.build_connector_meta(EMPTY_STEP)  # ends the step: the batch goes out (and answers, inline)
    return side.get_num_new_matched_tokens(req, num_computed)


def allocate(side, req, num_external):
    """What vLLM's scheduler does after a lookup: allocate blocks and tell the connector what it took."""
    blocks = SimpleNamespace(get_block_ids=lambda: (list(range(10, 10 + len(req.prompt_token_ids) // 32 + 1)),))
    side.update_state_after_alloc(req, blocks, num_external)


def consumer(store):
    return SchedulerSide(CONFIG, NS, store, loads_enabled=True, saves_enabled=False, lookup_calls=InlineCalls())


def test_a_stored_partial_tail_is_offered_token_exact():
    store = ScriptedStore()
    publish(store, PROMPT)
    side = consumer(store)
    req = request(PROMPT + [1, 2, 3])
    assert lookup(side, req) == (85, True)
    allocate(side, req, 85)
    (load,) = side.build_connector_meta(
        SimpleNamespace(scheduled_new_reqs=[], scheduled_cached_reqs=None, num_scheduled_tokens={})
    ).loads
    assert [t.block_id for t in load.transfers] == [10, 11, 12]
    details = side.request_finished(req)[1]["kvtool"]
    assert (details["external_hit_tokens"], details["block_hit_tokens"], details["tail_hit_tokens"]) == (85, 64, 21)


def test_a_lookup_error_is_a_miss_not_a_failure():
    store = ScriptedStore()
    publish(store, PROMPT)
    store.fail_exists = True
    side = consumer(store)
    assert lookup(side, request(PROMPT + [1])) == (0, False)
    details = side.request_finished(request(PROMPT + [1]))[1]["kvtool"]
    assert details["lookup"].startswith("error:") and details["external_hit_tokens"] == 0
    assert side.take_stats()["lookup_errors"] == 1


def test_no_store_means_no_hits():
    side = SchedulerSide(CONFIG, NS, None, loads_enabled=True, saves_enabled=True)
    assert side.get_num_new_matched_tokens(request(PROMPT), 0) == (0, False)


def test_another_users_salt_never_hits():
    store = ScriptedStore()
    publish(store, PROMPT, salt="alice")
    side = consumer(store)
    assert lookup(side, request(PROMPT + [1], cache_salt="bob")) == (0, False)
    assert lookup(side, request(PROMPT + [1], "r2", cache_salt="alice")) == (85, True)


def test_the_local_block_aligned_hit_is_not_claimed_again():
    store = ScriptedStore()
    publish(store, PROMPT)
    assert lookup(consumer(store), request(PROMPT), 64) == (20, True)


def test_a_producer_saves_in_the_step_that_completes_the_prompt_and_skips_stored_objects():
    store = ScriptedStore()
    publish(store, PROMPT[:64])  # the two full blocks are already stored
    side = SchedulerSide(CONFIG, NS, store, loads_enabled=False, saves_enabled=True, lookup_calls=InlineCalls())
    req = request(PROMPT, kv_transfer_params={"kvtool_tag": "t9"})
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)  # a producer never waits for its lookup
    chunk = SimpleNamespace(req_id="r1", block_ids=([4, 5, 6],), num_computed_tokens=0)
    cached = SimpleNamespace(req_ids=[], new_block_ids=[], resumed_req_ids=set(), num_computed_tokens=[])
    first = side.build_connector_meta(
        SimpleNamespace(scheduled_new_reqs=[chunk], scheduled_cached_reqs=cached, num_scheduled_tokens={"r1": 48})
    )
    assert first.saves == []  # chunked prefill: the prompt is not complete yet
    cached = SimpleNamespace(req_ids=["r1"], new_block_ids=[None], resumed_req_ids=set(), num_computed_tokens=[48])
    second = side.build_connector_meta(
        SimpleNamespace(scheduled_new_reqs=[], scheduled_cached_reqs=cached, num_scheduled_tokens={"r1": 37})
    )
    (save,) = second.saves
    assert [(t.block_id, t.kind.value, t.token_end) for t in save.transfers] == [(6, "t", 85)]
    assert [(o.kind.value, o.token_end) for o in save.already_stored] == [("b", 32), ("b", 64)]
    assert (save.prompt_tokens, save.tag) == (85, "t9")
    assert "/b/64/" in save.last_block_key and "/t/85/" in save.tail_key
    details = side.request_finished(req)[1]["kvtool"]
    assert details["save_tail_boundary"] == 85 and details["watermark_key"].endswith("/1")


def test_a_failed_load_is_reported_as_what_was_really_reused():
    from connector.data import KVToolWorkerMeta

    store = ScriptedStore()
    publish(store, PROMPT)
    side = consumer(store)
    req = request(PROMPT + [1, 2])
    assert lookup(side, req) == (85, True)
    allocate(side, req, 85)
    side.record_worker_meta(KVToolWorkerMeta({"r1": (64, "checksum")}))
    details = side.request_finished(req)[1]["kvtool"]
    assert (details["external_hit_tokens"], details["block_hit_tokens"], details["tail_hit_tokens"]) == (64, 64, 0)
    assert details["lookup"] == "load failed: checksum" and details["load_failure"] == "checksum"


def test_a_hit_served_from_vllms_own_cache_is_reported_as_local():
    store = ScriptedStore()
    publish(store, PROMPT[:64])
    side = consumer(store)
    req = request(PROMPT)
    assert lookup(side, req, 64) == (0, False)
    allocate(side, req, 0)
    details = side.request_finished(req)[1]["kvtool"]
    assert (details["local_hit_tokens"], details["external_hit_tokens"]) == (64, 0)


def test_a_hit_the_scheduler_does_not_take_is_not_reported():
    store = ScriptedStore()
    publish(store, PROMPT)
    side = consumer(store)
    req = request(PROMPT + [5])
    assert lookup(side, req) == (85, True)
    allocate(side, req, 0)  # e.g. a request that skips the prefix cache
    details = side.request_finished(req)[1]["kvtool"]
    assert details["external_hit_tokens"] == 0 and details["lookup"] == "hit not taken by the scheduler"


def test_the_allocation_vllm_repeats_when_a_loaded_request_is_scheduled_changes_nothing():
    store = ScriptedStore()
    publish(store, PROMPT)
    side = consumer(store)
    req = request(PROMPT + [1, 2, 3])
    assert lookup(side, req) == (85, True)  # load_kv_async: the request waits for its load
    allocate(side, req, 85)
    assert len(side.build_connector_meta(EMPTY_STEP).loads) == 1
    allocate(side, req, 0)  # the load ended; vLLM schedules the request and tells the connector again
    assert side.build_connector_meta(EMPTY_STEP).loads == []
    details = side.request_finished(req)[1]["kvtool"]
    assert (details["lookup"], details["external_hit_tokens"]) == ("hit", 85)


def test_after_a_failed_load_the_request_is_recomputed_not_looked_up_again():
    from connector.data import KVToolWorkerMeta

    store = ScriptedStore()
    publish(store, PROMPT)
    side = consumer(store)
    req = request(PROMPT + [1])
    assert lookup(side, req) == (85, True)
    allocate(side, req, 85)
    side.record_worker_meta(KVToolWorkerMeta({"r1": (0, "checksum")}))
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)  # vLLM's retry: no second load
    allocate(side, req, 0)
    details = side.request_finished(req)[1]["kvtool"]
    assert (details["external_hit_tokens"], details["lookup"]) == (0, "load failed: checksum")


def test_a_prompt_with_embeddings_never_hits_a_text_prompt_of_the_same_ids():
    import torch

    store = ScriptedStore()
    publish(store, PROMPT)  # a text prompt
    side = consumer(store)
    embeds = torch.ones(len(PROMPT) + 1, 8)
    assert lookup(side, request(PROMPT + [1], prompt_embeds=embeds)) == (0, False)
    assert lookup(side, request(PROMPT + [1], "r2")) == (85, True)


def test_a_request_whose_identity_cannot_be_read_is_neither_looked_up_nor_stored():
    store = ScriptedStore()
    publish(store, PROMPT)
    side = SchedulerSide(CONFIG, NS, store, loads_enabled=True, saves_enabled=True, lookup_calls=InlineCalls())
    req = request(PROMPT + [1], prompt_embeds="not a tensor")
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)
    chunk = SimpleNamespace(req_id="r1", block_ids=([4, 5, 6],), num_computed_tokens=0)
    cached = SimpleNamespace(req_ids=[], new_block_ids=[], resumed_req_ids=set(), num_computed_tokens=[])
    meta = side.build_connector_meta(
        SimpleNamespace(scheduled_new_reqs=[chunk], scheduled_cached_reqs=cached, num_scheduled_tokens={"r1": 86})
    )
    assert meta.saves == [] and meta.loads == []
    assert side.take_stats()["requests_unhashable"] == 1
    assert side.request_finished(req)[1]["kvtool"]["lookup"].startswith("not looked up: prompt embeddings")


def step(new=(), cached=None, scheduled=None, block_state=None):
    cached = cached or SimpleNamespace(req_ids=[], new_block_ids=[], resumed_req_ids=set(), num_computed_tokens=[])
    return SimpleNamespace(
        scheduled_new_reqs=list(new),
        scheduled_cached_reqs=cached,
        num_scheduled_tokens=scheduled or {},
        kv_connector_block_state=block_state,
    )


def first_chunk(block_ids, tokens, req_id="r1"):
    """The scheduler output of a step that schedules a new request's first ``tokens`` tokens."""
    new = SimpleNamespace(req_id=req_id, block_ids=(list(block_ids),), num_computed_tokens=0)
    return step(new=[new], scheduled={req_id: tokens})


def test_a_request_that_reads_no_cached_prefix_is_answered_at_once_without_a_lookup():
    """vLLM drops the hit of a prompt_logprobs request anyway: no lookup, no step spent waiting for one."""
    store = ScriptedStore()
    publish(store, PROMPT)
    asked = []
    store.exists = lambda keys: asked.append(keys) or [True] * len(keys)
    side = consumer(store)
    req = request(PROMPT + [1], skip_reading_prefix_cache=True)
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)
    side.build_connector_meta(EMPTY_STEP)
    assert asked == []
    details = side.request_finished(req)[1]["kvtool"]
    assert details["lookup"].startswith("not looked up") and details["external_hit_tokens"] == 0


def test_a_producer_request_that_reads_no_cached_prefix_still_saves_its_prompt():
    store = ScriptedStore()
    side = SchedulerSide(CONFIG, NS, store, loads_enabled=False, saves_enabled=True, lookup_calls=InlineCalls())
    req = request(PROMPT, skip_reading_prefix_cache=True)
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)
    meta = side.build_connector_meta(first_chunk([4, 5, 6], 85))
    (save,) = meta.saves
    assert [(t.block_id, t.kind.value, t.token_end) for t in save.transfers] == [
        (4, "b", 32),
        (5, "b", 64),
        (6, "t", 85),
    ]


def test_after_vllm_resets_its_caches_the_engine_neither_looks_up_nor_saves():
    """pause_generation(clear_cache=True) before a weight update calls the connector's reset_cache: what
    the store holds may not be this engine's KV any more, nor its KV the store's."""
    from connector.connector import KVToolConnector

    from .scripted_store import CountingStore

    store = CountingStore()
    publish(store, PROMPT)
    side = SchedulerSide(CONFIG, NS, store, loads_enabled=True, saves_enabled=True, lookup_calls=InlineCalls())
    connector = KVToolConnector.__new__(KVToolConnector)  # the hook alone: no engine to build one around
    connector._scheduler, connector.config, connector._stopped_sharing = side, CONFIG, False
    assert connector.reset_cache() is True
    assert connector.reset_cache() is True and connector._stopped_sharing  # every pause resets: said once
    req = request(PROMPT)
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)
    assert side.build_connector_meta(first_chunk([10, 11, 12], len(PROMPT))).saves == []
    assert side.request_finished(req, ([10, 11, 12],))[0] is False
    assert store.queries == 0
    worker_side = KVToolConnector.__new__(KVToolConnector)
    worker_side._scheduler = None
    assert worker_side.reset_cache() is None  # the worker's role: nothing to reset


def test_an_engine_set_to_keep_sharing_goes_on_after_a_reset():
    """on_cache_reset: keep_sharing, for engines paused or put to sleep whose weights never change."""
    from connector.connector import KVToolConnector

    store = ScriptedStore()
    publish(store, PROMPT)
    side = consumer(store)
    connector = KVToolConnector.__new__(KVToolConnector)
    keep = load_config({"master_server_address": "127.0.0.1:1", "on_cache_reset": "keep_sharing"})
    connector._scheduler, connector.config, connector._stopped_sharing = side, keep, False
    assert connector.reset_cache() is True
    assert lookup(side, request(PROMPT)) == (84, True)
