"""Answer saves: a decoding engine saves prompt + answer at request end, holding the request's blocks
until its worker has copied them, and never holding them when there is nothing to save."""

from __future__ import annotations


import torch

from connector.data import KVToolMetadata, answer_watermark_id
from connector.core.groups import CacheGroup, GroupKind
from connector.core.hashing import RequestIdentity
from connector.core.keys import Namespace, decode_key, request_hash
from connector.core.prefix import PromptKeys
from connector.core.search import find_stored_prefix
from connector.scheduler.scheduler import SchedulerSide
from connector.worker.worker import WorkerSide

from .scripted_store import InlineCalls, ScriptedStore
from .test_scheduler import CONFIG, NS, PROMPT, allocate, first_chunk, lookup, publish, request, step

ANSWER = list(range(500, 520))  # 20 generated tokens: the last one has no KV when the request ends


def decoded(tokens, answer, request_id="r1"):
    """A request that prefilled ``tokens`` and generated ``answer``, as vLLM holds it when it ends."""
    return request(
        tokens,
        request_id,
        all_token_ids=list(tokens) + list(answer),
        output_token_ids=list(answer),
        num_computed_tokens=len(tokens) + len(answer) - 1,
        num_output_tokens=len(answer),
    )


def engine(store, *, saves=False, groups=None, namespace=NS):
    return SchedulerSide(
        CONFIG,
        namespace,
        store,
        loads_enabled=True,
        saves_enabled=saves,
        answers_enabled=True,
        lookup_calls=InlineCalls(),
        groups=groups,
    )


def keys_of(tokens):
    return PromptKeys.build(tokens, 32, 1, NS.key_component(), RequestIdentity().root_hash())


def loaded_consumer(store):
    """A consumer whose request loaded the stored 85-token prompt (84 tokens) and then decoded ANSWER."""
    publish(store, PROMPT)  # 85 tokens: blocks 32 and 64, the tail at 85
    side = engine(store)
    req = decoded(PROMPT, ANSWER)
    assert lookup(side, req) == (84, True)
    allocate(side, req, 84)
    side.build_connector_meta(step())
    side.record_transfers({"r1"}, None)  # the worker reported the load received
    return side, req


def test_a_consumer_saves_the_blocks_the_answer_filled_and_its_exact_tail_not_what_it_loaded():
    store = ScriptedStore()
    side, req = loaded_consumer(store)
    hold, params = side.request_finished(req, ([10, 11, 12, 13],))
    assert hold is True  # vLLM keeps the blocks until the worker reports the copy
    assert side.has_pending_block_frees()  # vLLM waits a step for them rather than preempt
    (save,) = side.build_connector_meta(step()).saves
    assert save.answer and save.prompt_tokens == 104
    side.record_transfers(None, {"r1"})
    assert not side.has_pending_block_frees()
    assert [(t.block_id, t.kind.value, t.token_end) for t in save.transfers] == [(12, "b", 96), (13, "t", 104)]
    details = params["kvtool"]
    assert (details["answer_tokens"], details["answer_save_objects"]) == (104, 2)
    assert "/p/88/" in details["answer_last_key"]  # put last: the last pointer (the 8-token grid), in block 96
    # Once stored, the next turn (prompt + the whole answer + a new message) finds all of it.
    keys = keys_of(PROMPT + ANSWER)
    for key in (keys.block_key(2), keys.tail_key(104)):
        store.objects[key] = b"object"
    assert find_stored_prefix(keys_of(PROMPT + ANSWER + [7, 8, 9]), store.exists).hit_tokens == 104


def test_a_kv_both_engine_does_not_save_its_prompt_twice():
    store = ScriptedStore()
    side = engine(store, saves=True)
    req = decoded(PROMPT, ANSWER)
    side.get_num_new_matched_tokens(req, 0)
    prompt_meta = side.build_connector_meta(first_chunk([10, 11, 12], 85))
    assert [t.token_end for t in prompt_meta.saves[0].transfers] == [32, 64, 85]
    assert side.request_finished(req, ([10, 11, 12, 13],))[0]
    (answer,) = side.build_connector_meta(step()).saves
    assert [t.token_end for t in answer.transfers] == [96, 104]


def test_an_answer_save_puts_again_the_prompt_objects_its_prompt_save_left_unstored():
    from connector.data import KVToolWorkerMeta

    store = ScriptedStore()
    side = engine(store, saves=True)
    req = decoded(PROMPT, ANSWER)
    side.get_num_new_matched_tokens(req, 0)
    side.build_connector_meta(first_chunk([10, 11, 12], 85))
    side.record_worker_meta(KVToolWorkerMeta(unsaved=frozenset({"r1"})))  # a put of that save failed
    assert side.request_finished(req, ([10, 11, 12, 13],))[0]
    (answer,) = side.build_connector_meta(step()).saves
    # The prompt's blocks again (the put thread skips those stored), then the answer's.
    assert [t.token_end for t in answer.transfers] == [32, 64, 96, 104]


def test_objects_a_lookup_found_are_not_taken_as_stored_once_the_prompt_save_found_them_gone():
    """The put thread's recheck found an object the lookup had found evicted since: the answer save
    asks the store again for every object of the prompt, those its lookup found included."""
    from connector.data import KVToolWorkerMeta

    side, req = loaded_consumer(ScriptedStore())
    side.record_worker_meta(KVToolWorkerMeta(unsaved=frozenset({"r1"})))
    assert side.request_finished(req, ([10, 11, 12, 13],))[0]
    (answer,) = side.build_connector_meta(step()).saves
    assert [t.token_end for t in answer.transfers] == [32, 64, 96, 104] and answer.already_stored == ()


def test_nothing_to_save_holds_no_block():
    store = ScriptedStore()
    side = engine(store)
    # Aborted while its load was in flight: no token generated, its blocks may hold nothing.
    never_ran = request(PROMPT, all_token_ids=PROMPT, num_computed_tokens=0, num_output_tokens=0)
    side.get_num_new_matched_tokens(never_ran, 0)
    assert side.request_finished(never_ran, ([10, 11, 12],))[0] is False
    # One generated token (max_tokens=1) on a consumer: the prompt itself, not yet stored, is the save.
    one = decoded(PROMPT, [7], "r2")
    side.get_num_new_matched_tokens(one, 0)
    assert side.request_finished(one, ([10, 11, 12],))[0] is True
    # A store that answers nothing at start-up: no answer saves at all.
    offline = SchedulerSide(CONFIG, NS, None, loads_enabled=True, saves_enabled=False, answers_enabled=True)
    req = decoded(PROMPT, ANSWER, "r3")
    offline.get_num_new_matched_tokens(req, 0)
    assert offline.request_finished(req, ([10, 11, 12, 13],))[0] is False


def test_a_mamba_answer_saves_the_running_state_from_the_block_of_its_last_computed_token():
    """The state after prompt + answer (less the last generated token) is the running state, which
    align mode keeps in the block of its last computed token (earlier ones are the null block)."""
    groups = (CacheGroup(0, GroupKind.STATE, 32), CacheGroup(1, GroupKind.FULL, 32))
    side = engine(ScriptedStore(), groups=groups)
    req = decoded(PROMPT, ANSWER)
    side.get_num_new_matched_tokens(req, 0)
    assert side.request_finished(req, ([0, 0, 0, 4], [10, 11, 12, 13]))[0] is True
    (save,) = side.build_connector_meta(step()).saves
    computed = len(PROMPT) + len(ANSWER) - 1
    states = [(t.block_id, t.token_end) for t in save.transfers if t.group == 0]
    assert states == [(4, computed)]
    assert all(t.chain_hash == keys_of(PROMPT + ANSWER).chain_hash(t.token_end) for t in save.transfers)


def test_a_mamba_answer_stopped_with_a_step_in_flight_saves_its_last_token_too():
    """Async scheduling: the request stopped on its last sampled token while the step computing that
    token was in flight; it has run when the worker copies the save, so the state is after every token."""
    groups = (CacheGroup(0, GroupKind.STATE, 32), CacheGroup(1, GroupKind.FULL, 32))
    side = engine(ScriptedStore(), groups=groups)
    req = decoded(PROMPT, ANSWER)
    req.num_computed_tokens, req.num_in_flight_tokens = len(PROMPT) + len(ANSWER), 1
    side.get_num_new_matched_tokens(req, 0)
    assert side.request_finished(req, ([0, 0, 0, 4], [10, 11, 12, 13]))[0] is True
    (save,) = side.build_connector_meta(step()).saves
    whole = len(PROMPT) + len(ANSWER)
    assert save.prompt_tokens == whole
    assert [(t.block_id, t.token_end) for t in save.transfers if t.group == 0] == [(4, whole)]
    assert [t.token_end for t in save.transfers if t.group == 1] == [32, 64, 96, whole]
    assert all(t.chain_hash == keys_of(PROMPT + ANSWER).chain_hash(t.token_end) for t in save.transfers)


def test_a_mamba_answer_with_anything_else_in_flight_saves_nothing():
    groups = (CacheGroup(0, GroupKind.STATE, 32), CacheGroup(1, GroupKind.FULL, 32))
    side = engine(ScriptedStore(), groups=groups)
    for number, (in_flight, stale) in enumerate([(3, 0), (1, 1)]):  # drafts; a stale share after a preemption
        req = decoded(PROMPT, ANSWER, f"r{number}")
        req.num_computed_tokens = len(PROMPT) + len(ANSWER) - 1 + in_flight
        req.num_in_flight_tokens, req.num_stale_output_tokens = in_flight, stale
        side.get_num_new_matched_tokens(req, 0)
        assert side.request_finished(req, ([0, 0, 0, 4], [10, 11, 12, 13]))[0] is False
    assert side.stats["answer_saves_skipped_in_flight"] == 2
    # A stop inside accepted drafts: the state ran past the answer's last token; no state names it.
    req = decoded(PROMPT, ANSWER, "past")
    req.num_computed_tokens = len(PROMPT) + len(ANSWER) + 2
    side.get_num_new_matched_tokens(req, 0)
    assert side.request_finished(req, ([0, 0, 0, 4], [10, 11, 12, 13]))[0] is False
    assert side.stats["answer_saves_skipped_in_flight"] == 3


def test_a_sliding_window_answer_skips_the_blocks_its_window_left():
    groups = (CacheGroup(0, GroupKind.FULL, 32), CacheGroup(1, GroupKind.SLIDING, 32, window=32))
    side = engine(ScriptedStore(), groups=groups)
    req = decoded(PROMPT, ANSWER)
    side.get_num_new_matched_tokens(req, 0)
    assert side.request_finished(req, ([1, 2, 3, 4], [0, 0, 13, 14]))[0]
    (save,) = side.build_connector_meta(step()).saves
    assert [(t.group, t.block_id, t.token_end) for t in save.transfers if t.group == 1] == [(1, 13, 96), (1, 14, 104)]


def test_the_worker_reports_an_answer_save_sent_once_it_copied_it_or_could_not():
    layers = ["model.layers.0.attn"]
    caches = {name: torch.randn(8, 2, 32, 16) for name in layers}
    ns = Namespace(
        model="m", dtype="float32", kv_layout="cpu", block_size=32, num_layers=1, num_kv_heads=2, head_size=8
    )
    store = ScriptedStore()
    side = engine(store, namespace=ns)
    req = decoded(PROMPT, ANSWER)
    side.get_num_new_matched_tokens(req, 0)
    side.request_finished(req, ([1, 2, 3, 4],))
    meta = side.build_connector_meta(step())
    worker = WorkerSide(ns, store, CONFIG, saves_enabled=True, load_calls=InlineCalls())
    worker.register_kv_caches(caches, [layers], 8)
    worker.wait_for_save(meta)
    assert worker.take_sent() == {"r1"} and worker.take_sent() == set()
    worker.shutdown()
    objects = [decode_key(key) for key in store.objects]
    assert sorted(o.end_token for o in objects if o.kind.value in "bt") == [32, 64, 96, 104]
    # With pointers at every 8 tokens inside each object (the auto grid: a quarter block; no block-start
    # pointers, since that grid's first point is within extend_min_tokens of a block's start).
    assert sorted(o.end_token for o in objects if o.kind.value == "p") == [8, 16, 24, 40, 48, 56, 72, 80, 88]
    # Its watermark records are its own, apart from the prompt save's of the same request.
    assert {o.request_hash for o in objects if o.request_hash} == {request_hash(answer_watermark_id("r1"))}
    # A worker that cannot save (no store) still lets vLLM free the blocks.
    disabled = WorkerSide(ns, None, CONFIG, saves_enabled=True)
    disabled.wait_for_save(KVToolMetadata(saves=meta.saves))
    assert disabled.take_sent() == {"r1"}


def test_a_request_that_ends_while_its_load_still_fills_its_blocks_saves_nothing():
    """Preempted after decoding, looked up again with a hit, then aborted while that load is in flight:
    its blocks hold nothing yet, and vLLM holds them itself until the load is reported."""
    store = ScriptedStore()
    publish(store, PROMPT)
    side = engine(store)
    req = decoded(PROMPT, ANSWER)
    req.num_computed_tokens = 84  # vLLM counts the hit as computed while the load runs
    assert lookup(side, req) == (84, True)
    allocate(side, req, 84)
    side.build_connector_meta(step())
    assert side.request_finished(req, ([10, 11, 12],))[0] is False
    assert side.build_connector_meta(step()).saves == []
    assert side.take_stats()["answer_saves_skipped_loading"] == 1


def test_a_request_that_ends_before_its_failing_load_is_reported_saves_nothing():
    """The load sent for a hit is one that fails on purpose (vLLM gave an object no block): vLLM still
    holds the blocks until the worker reports it, and they hold nothing the request computed."""
    from types import SimpleNamespace

    store = ScriptedStore()
    publish(store, PROMPT)
    side = engine(store)
    req = decoded(PROMPT, ANSWER)
    req.num_computed_tokens = 84
    assert lookup(side, req) == (84, True)
    side.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: ([10],)), 84)  # blocks 1-2 missing
    (load,) = side.build_connector_meta(step()).loads
    assert load.failure == "no block for an object"
    assert side.request_finished(req, ([10],))[0] is False  # ended (an abort) before the worker reported it
    assert side.build_connector_meta(step()).saves == []
    assert side.take_stats()["answer_saves_skipped_loading"] == 1


def test_an_answer_save_never_names_tokens_still_in_flight():
    """Speculative drafts and async-scheduled steps are counted in num_computed_tokens before they are
    accepted (num_in_flight_tokens): the answer save names only the tokens whose KV is final."""
    store = ScriptedStore()
    side = engine(store)
    req = decoded(PROMPT, ANSWER)
    req.num_in_flight_tokens = 3
    assert lookup(side, req) == (0, False)
    allocate(side, req, 0)
    side.build_connector_meta(step())
    _, params = side.request_finished(req, ([10, 11, 12, 13],))
    (save,) = side.build_connector_meta(step()).saves
    final = len(PROMPT) + len(ANSWER) - 1 - 3
    assert params["kvtool"]["answer_tokens"] == final
    assert max(t.token_end for t in save.transfers) == final
    keys = keys_of(PROMPT + ANSWER)
    assert all(t.chain_hash == keys.chain_hash(t.token_end) for t in save.transfers)


def test_an_answer_save_counts_no_token_past_the_answer_a_stop_inside_accepted_drafts_cut():
    """A stop string inside accepted drafts cuts the answer but not num_computed_tokens: the save, its
    record and the hit details count the tokens there are, not the KV computed past them."""
    store = ScriptedStore()
    side = engine(store)
    req = decoded(PROMPT, ANSWER)
    req.num_computed_tokens = len(PROMPT) + len(ANSWER) + 3  # three accepted drafts past the stop
    assert lookup(side, req) == (0, False)
    allocate(side, req, 0)
    side.build_connector_meta(step())
    _, params = side.request_finished(req, ([10, 11, 12, 13],))
    (save,) = side.build_connector_meta(step()).saves
    whole = len(PROMPT) + len(ANSWER)
    assert params["kvtool"]["answer_tokens"] == whole == save.prompt_tokens
    assert max(t.token_end for t in save.transfers) == whole


def test_an_answer_saves_record_never_counts_prompt_blocks_its_prompt_save_failed_to_store():
    """A kv_both engine's prompt save planned blocks 32 and 64 (and the tail), but none of its puts landed
    (the store was full): the answer save names those blocks in its record, the put thread finds them
    absent, and the record says nothing is durable (not the answer's 104 tokens)."""
    from connector.core.watermarks import WatermarkRecord

    layers = ["model.layers.0.attn"]
    caches = {name: torch.randn(8, 2, 32, 16) for name in layers}
    ns = Namespace(
        model="m", dtype="float32", kv_layout="cpu", block_size=32, num_layers=1, num_kv_heads=2, head_size=8
    )
    store = ScriptedStore()
    side = engine(store, saves=True, namespace=ns)
    req = decoded(PROMPT, ANSWER)
    side.get_num_new_matched_tokens(req, 0)
    side.build_connector_meta(first_chunk([1, 2, 3], 85))  # the prompt save, dropped below: never put
    assert side.request_finished(req, ([1, 2, 3, 4],))[0]
    (answer,) = side.build_connector_meta(step()).saves
    assert [(o.token_start, o.token_end) for o in answer.already_stored] == [(0, 32), (32, 64)]
    worker = WorkerSide(ns, store, CONFIG, saves_enabled=True, load_calls=InlineCalls())
    worker.register_kv_caches(caches, [layers], 8)
    worker.wait_for_save(KVToolMetadata(saves=[answer]))
    worker.shutdown()
    (final,) = [
        WatermarkRecord.decode(value)
        for key, value in store.objects.items()
        if decode_key(key).kind.value == "w" and decode_key(key).seq == 1
    ]
    assert (final.prompt_tokens, final.durable_offset) == (104, 0)
    assert worker.take_stats()["saves_gone"] == 2
