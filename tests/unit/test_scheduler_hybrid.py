"""Scheduler side on hybrid models, with a scripted store: a prompt's saves copy every cache group from
vLLM's current block tables (never a freed block), Mamba boundary states are saved in the step that
computes them, and a hybrid hit vLLM grants only in part fails its load instead of computing on
unfilled bytes. (The scheduler side on one group: ``test_scheduler``.)"""

from __future__ import annotations

from types import SimpleNamespace

from connector.core.hashing import RequestIdentity
from connector.core.prefix import PromptKeys, plan_save
from connector.scheduler.scheduler import SchedulerSide

from .scripted_store import InlineCalls, ScriptedStore
from .test_scheduler import CONFIG, EMPTY_STEP, NS, PROMPT, lookup, request, step


def hybrid_producer(groups):
    return SchedulerSide(
        CONFIG, NS, ScriptedStore(), loads_enabled=False, saves_enabled=True, lookup_calls=InlineCalls(), groups=groups
    )


def test_a_hybrid_save_copies_every_group_from_vllms_current_tables_and_never_a_freed_block():
    from connector.core.groups import CacheGroup, GroupKind

    groups = (CacheGroup(0, GroupKind.FULL, 32), CacheGroup(1, GroupKind.SLIDING, 32, window=64))
    side = hybrid_producer(groups)
    tokens = list(range(100, 300))  # 200 tokens: six blocks and a tail of 8
    req = request(tokens)
    side.get_num_new_matched_tokens(req, 0)
    # The last chunk starts at 160: the sliding group freed blocks 0-2 (tokens < 97 left its window).
    # The append-only ids the scheduler output carries would still name them.
    chunk = SimpleNamespace(
        req_id="r1", block_ids=([1, 2, 3, 4, 5, 6, 7], [11, 12, 13, 14, 15, 16, 17]), num_computed_tokens=160
    )
    tables = ([1, 2, 3, 4, 5, 6, 7], [0, 0, 0, 14, 15, 16, 17])
    state = SimpleNamespace(get_block_ids=lambda req_id: tables, boundary_state_offloads={})
    (save,) = side.build_connector_meta(step([chunk], scheduled={"r1": 40}, block_state=state)).saves
    by_group = {g: [(t.block_id, t.kind.value, t.token_end) for t in save.transfers if t.group == g] for g in (0, 1)}
    assert by_group[0] == [
        (1, "b", 32),
        (2, "b", 64),
        (3, "b", 96),
        (4, "b", 128),
        (5, "b", 160),
        (6, "b", 192),
        (7, "t", 200),
    ]
    assert by_group[1] == [(14, "b", 128), (15, "b", 160), (16, "b", 192), (17, "t", 200)]
    # Put order: block k of every group before block k + 1, tails after blocks.
    assert [t.token_end for t in save.transfers] == sorted(t.token_end for t in save.transfers)


def test_mamba_boundary_states_are_saved_from_the_blocks_vllm_names_in_the_step_that_computes_them():
    from connector.core.groups import CacheGroup, GroupKind
    from connector.core.keys import KeyKind

    groups = (CacheGroup(0, GroupKind.STATE, 64), CacheGroup(1, GroupKind.FULL, 64))
    side = SchedulerSide(
        CONFIG,
        replace_block_size(NS, 64),
        ScriptedStore(),
        loads_enabled=False,
        saves_enabled=True,
        lookup_calls=InlineCalls(),
        groups=groups,
    )
    tokens = list(range(100, 230))  # 130 tokens: two Mamba blocks and a tail of 2
    req = request(tokens)
    side.get_num_new_matched_tokens(req, 0)
    chunk = SimpleNamespace(req_id="r1", block_ids=([21], [31]), num_computed_tokens=0)
    state = SimpleNamespace(get_block_ids=lambda _: ([21], [31]), boundary_state_offloads={"r1": [(0, 21, 64)]})
    first = side.build_connector_meta(step([chunk], scheduled={"r1": 64}, block_state=state))
    (checkpoint,) = first.saves
    assert checkpoint.checkpoint and [(t.group, t.kind, t.token_end, t.block_id) for t in checkpoint.transfers] == [
        (0, KeyKind.STATE, 64, 21)
    ]
    # An offer for an attention group, the null block, or a boundary past the prompt is never saved.
    state.boundary_state_offloads = {"r1": [(1, 31, 128), (0, 0, 128), (0, 23, 400)]}
    cached = SimpleNamespace(
        req_ids=["r1"], new_block_ids=[([22], [32])], resumed_req_ids=set(), num_computed_tokens=[64]
    )
    assert side.build_connector_meta(step(cached=cached, scheduled={"r1": 64}, block_state=state)).saves == []
    # The step that completes the prompt: every attention block, the tail, and the state after 130 tokens.
    state.get_block_ids = lambda _: ([21, 22, 23], [31, 32, 33])
    state.boundary_state_offloads = {"r1": [(0, 22, 128)]}
    cached = SimpleNamespace(
        req_ids=["r1"], new_block_ids=[([23], [33])], resumed_req_ids=set(), num_computed_tokens=[128]
    )
    (save,) = side.build_connector_meta(step(cached=cached, scheduled={"r1": 2}, block_state=state)).saves
    assert not save.checkpoint and save.state_groups == (0,)  # its record needs group 0's state
    assert [(t.group, t.kind.value, t.token_end, t.block_id) for t in save.transfers] == [
        (1, "b", 64, 31),
        (1, "b", 128, 32),
        (1, "t", 130, 33),
        (0, "s", 130, 23),
        (0, "s", 128, 22),
    ]


def replace_block_size(namespace, block_size):
    from dataclasses import replace

    return replace(namespace, block_size=block_size)


def test_a_hit_whose_state_group_got_no_block_fails_instead_of_computing_on_unfilled_bytes():
    from connector.core.groups import CacheGroup, GroupKind

    side, req = hybrid_consumer_with_a_hit((CacheGroup(0, GroupKind.STATE, 32), CacheGroup(1, GroupKind.FULL, 32)))
    side.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: ([0, 0, 0], [10, 11, 12])), 85)
    (load,) = side.build_connector_meta(EMPTY_STEP).loads
    assert load.transfers == () and load.failure


def test_without_vllms_current_tables_only_full_attention_blocks_are_saved():
    from connector.core.groups import CacheGroup, GroupKind

    groups = (CacheGroup(0, GroupKind.FULL, 32), CacheGroup(1, GroupKind.SLIDING, 32, window=64))
    side = hybrid_producer(groups)
    req = request(list(range(100, 185)))
    side.get_num_new_matched_tokens(req, 0)
    chunk = SimpleNamespace(req_id="r1", block_ids=([1, 2, 3], [11, 12, 13]), num_computed_tokens=0)
    (save,) = side.build_connector_meta(step([chunk], scheduled={"r1": 85}, block_state=None)).saves
    assert {t.group for t in save.transfers} == {0}


def test_a_partial_grant_of_a_hybrid_hit_fails_its_load():
    from connector.core.groups import CacheGroup, GroupKind

    groups = (CacheGroup(0, GroupKind.FULL, 32), CacheGroup(1, GroupKind.SLIDING, 32, window=64))
    side, req = hybrid_consumer_with_a_hit(groups)
    side.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: ([10, 11, 12], [20, 21, 22])), 64)
    (load,) = side.build_connector_meta(EMPTY_STEP).loads
    assert load.transfers == () and load.failure


def hybrid_consumer_with_a_hit(groups):
    """A consumer of that layout whose lookup for PROMPT + 2 tokens found all of PROMPT stored."""
    store = ScriptedStore()
    keys = PromptKeys.build(PROMPT, 32, 1, NS.key_component(), RequestIdentity().root_hash(), groups)
    for save in plan_save(keys):
        store.objects[save.key] = b"object"
    side = SchedulerSide(
        CONFIG, NS, store, loads_enabled=True, saves_enabled=False, lookup_calls=InlineCalls(), groups=groups
    )
    req = request(PROMPT + [1, 2])
    assert lookup(side, req) == (85, True)
    return side, req
