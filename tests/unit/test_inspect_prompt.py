"""`kvtool inspect prompt`: the miss-reason rules and the predicted hit, on store snapshots."""

import pytest

from connector.core.hashing import RequestIdentity
from connector.core.objects import PointerRecord, encode_pointer
from connector.core.keys import KeyKind, Namespace
from connector.core.objects import ObjectHeader, encode_object
from connector.core.prefix import PromptKeys, plan_load, plan_save
from connector.core.search import find_stored_prefix
from kvtool.errors import UserError
from kvtool.inspect.misses import (
    EVICTED,
    FAILED_CHECK,
    NEVER_STORED,
    OTHER_NAMESPACE,
    Coverage,
    StoreSnapshot,
    check_object,
    miss_reason,
)
from kvtool.inspect.prompt import choose_namespace, expected_header, inspect_prompt
from kvtool.inspect.tokens import parse_token_ids

NS = Namespace(model="m", dtype="float32", kv_layout="cpu", block_size=32, num_layers=2, num_kv_heads=2, head_size=64)
OTHER = Namespace(
    model="other", dtype="float32", kv_layout="cpu", block_size=32, num_layers=2, num_kv_heads=2, head_size=64
)
TOKENS = list(range(100, 185))  # 85 tokens: two full blocks and a 21-token tail


def prompt_keys(tokens=TOKENS, namespace=NS, salt=None):
    return PromptKeys.build(tokens, 32, 1, namespace.key_component(), RequestIdentity(cache_salt=salt).root_hash())


def saved(keys):
    return {s.key for s in plan_save(keys)}


def by_end(result):
    return {(b.kind, b.end_token): b for b in result.boundaries}


# ---- miss_reason ----------------------------------------------------------------------------


def test_a_present_object_that_passes_is_no_miss():
    assert miss_reason(True, KeyKind.BLOCK, 32, [], [], None) is None


def test_a_present_object_that_fails_names_the_check():
    assert miss_reason(True, KeyKind.TAIL, 85, [], [], "checksum: bad") == f"{FAILED_CHECK}: checksum: bad"


def test_absent_everywhere_is_never_stored():
    assert miss_reason(False, KeyKind.TAIL, 85, [], [], None) == NEVER_STORED


def test_another_namespace_wins_over_a_watermark():
    coverage = [Coverage("r", 85, 85, True)]
    reason = miss_reason(False, KeyKind.TAIL, 85, ["abcdef0123456789"], coverage, None)
    assert reason.startswith(OTHER_NAMESPACE) and "abcdef0123456789" in reason


@pytest.mark.parametrize(
    ("kind", "end", "coverage", "evicted"),
    [
        (KeyKind.BLOCK, 64, Coverage("r", 64, None, False), True),
        (KeyKind.BLOCK, 96, Coverage("r", 64, None, False), False),  # past the durable offset
        (KeyKind.TAIL, 85, Coverage("r", 85, 85, True), True),
        (KeyKind.TAIL, 85, Coverage("r", 64, 85, False), False),  # the tail put failed: never durable
        (KeyKind.TAIL, 80, Coverage("r", 85, 85, True), False),  # another boundary
    ],
)
def test_a_watermark_says_evicted_only_for_what_it_made_durable(kind, end, coverage, evicted):
    reason = miss_reason(False, kind, end, [], [coverage], None)
    assert reason.startswith(EVICTED) if evicted else reason == NEVER_STORED


# ---- check_object ---------------------------------------------------------------------------


def stored_object(keys, kind, end, namespace=NS, payload=b"p" * 64, **changes):
    want = expected_header(keys, kind, end)
    fields = dict(
        namespace_fingerprint=namespace.fingerprint(),
        chain_hash=want.chain_hash,
        kind=kind,
        dtype="float32",
        num_layers=2,
        token_start=want.token_start,
        token_end=want.token_end,
        payload_len=len(payload),
    )
    fields.update(changes)
    return encode_object(ObjectHeader(**fields), payload)


def test_a_good_object_passes_its_check():
    keys = prompt_keys()
    ns = NS.key_component()
    assert check_object(stored_object(keys, KeyKind.TAIL, 85), ns, expected_header(keys, KeyKind.TAIL, 85)) is None
    assert check_object(stored_object(keys, KeyKind.BLOCK, 64), ns, expected_header(keys, KeyKind.BLOCK, 64)) is None


@pytest.mark.parametrize(
    ("mangle", "cause"),
    [
        (lambda data: data[:-1], "truncated"),
        (lambda data: data[:-1] + bytes([data[-1] ^ 1]), "checksum"),
        (lambda data: b"XXXX" + data[4:], "foreign"),
        (lambda data: data[:10], "truncated"),
    ],
)
def test_a_damaged_object_fails_with_its_cause(mangle, cause):
    keys = prompt_keys()
    data = mangle(stored_object(keys, KeyKind.TAIL, 85))
    assert check_object(data, NS.key_component(), expected_header(keys, KeyKind.TAIL, 85)).startswith(cause)


def test_an_object_written_for_other_tokens_or_namespace_fails():
    keys = prompt_keys()
    want = expected_header(keys, KeyKind.TAIL, 85)
    ns = NS.key_component()
    assert check_object(stored_object(keys, KeyKind.TAIL, 85, namespace=OTHER), ns, want).startswith("namespace")
    assert check_object(stored_object(keys, KeyKind.TAIL, 85, token_end=84), ns, want).startswith("mismatch")
    assert check_object(stored_object(keys, KeyKind.TAIL, 85, chain_hash=bytes(16)), ns, want).startswith("hash")
    assert check_object(None, ns, want).startswith("unreadable")


# ---- inspect_prompt -------------------------------------------------------------------------


def test_a_fully_stored_prompt_hits_one_token_short_like_the_connector():
    keys = prompt_keys()
    present = saved(keys)
    result = inspect_prompt(keys, StoreSnapshot(frozenset(present)))
    expected = plan_load(keys, find_stored_prefix(keys, lambda ks: [k in present for k in ks]), local_tokens=0)
    assert (result.hit_tokens, result.block_hit_tokens, result.tail_hit_tokens) == (84, 64, 20)
    assert result.hit_tokens == expected.external_tokens
    rows = by_end(result)
    assert rows[("block", 32)].stored and rows[("block", 64)].in_hit and rows[("tail", 85)].stored
    # The hit is capped one token short, but it is still loaded from the tail object.
    assert rows[("tail", 85)].miss_reason is None and rows[("tail", 85)].in_hit
    assert result.save_tail_boundary == 85


def test_an_extended_prompt_hits_the_shorter_prompts_tail():
    keys = prompt_keys()
    longer = prompt_keys(TOKENS + list(range(500, 520)))
    result = inspect_prompt(longer, StoreSnapshot(frozenset(saved(keys))))
    assert (result.hit_tokens, result.tail_hit_tokens) == (85, 21)
    assert by_end(result)[("tail", 85)].in_hit
    assert by_end(result)[("tail", 105)].miss_reason == NEVER_STORED  # its own save boundary is listed


def test_a_prompt_leaving_a_stored_one_shows_the_pointer_it_hits_through():
    def with_grid(tokens):
        return PromptKeys.build(tokens, 32, 1, NS.key_component(), RequestIdentity().root_hash(), grid=8)

    stored = with_grid(TOKENS)
    present = {ref.key for obj in plan_save(stored) for ref in (obj, *stored.pointers_inside(obj))}
    diverging = with_grid(TOKENS[:74] + list(range(500, 520)))  # leaves the stored tail after 74 tokens
    result = inspect_prompt(diverging, StoreSnapshot(frozenset(present)))
    assert (result.hit_tokens, result.block_hit_tokens, result.tail_hit_tokens) == (72, 64, 8)
    rows = by_end(result)
    assert rows[("pointer", 72)].stored and rows[("pointer", 72)].in_hit
    assert ("pointer", 80) not in rows  # not stored, not listed (its prefix differs)
    # Read, the pointer names the stored tail and carries its token ids from 72: the hit goes on to the
    # exact divergence point. With the tail evicted: the block boundary.
    pointer, tail = stored.pointer_ref(72), stored.tail_ref(85)
    record = encode_pointer(
        PointerRecord(
            NS.fingerprint(), pointer.chain_hash, 0, 72, KeyKind.TAIL, 85, tail.chain_hash, tuple(TOKENS[72:85])
        )
    )
    read = inspect_prompt(diverging, StoreSnapshot(frozenset(present), pointer_records={pointer.key: record}))
    assert (read.hit_tokens, read.block_hit_tokens, read.tail_hit_tokens) == (74, 64, 10)
    evicted = StoreSnapshot(frozenset(present - {tail.key}), pointer_records={pointer.key: record})
    assert inspect_prompt(diverging, evicted).hit_tokens == 64


def test_every_miss_is_named():
    keys = prompt_keys()
    other_keys = prompt_keys(namespace=OTHER)
    present = {keys.block_key(0), other_keys.block_key(1), keys.tail_key(85)}
    snapshot = StoreSnapshot(
        frozenset(present),
        coverage=[Coverage("req-1", 85, 85, True)],
        check_failures={keys.tail_key(85): "checksum: payload checksum does not match"},
    )
    result = inspect_prompt(keys, snapshot)
    rows = by_end(result)
    assert rows[("block", 32)].miss_reason is None
    assert rows[("block", 64)].miss_reason.startswith(OTHER_NAMESPACE)
    assert rows[("tail", 85)].miss_reason.startswith(FAILED_CHECK + ": checksum")
    assert result.hit_tokens == 32 and result.loadable_hit_tokens == 32
    evicted = inspect_prompt(
        keys, StoreSnapshot(frozenset({keys.block_key(0)}), coverage=[Coverage("req-1", 85, 85, True)])
    )
    assert by_end(evicted)[("block", 64)].miss_reason.startswith(EVICTED)
    assert by_end(evicted)[("tail", 85)].miss_reason.startswith(EVICTED)


def test_a_failed_check_lowers_the_loadable_hit_not_the_reported_one():
    keys = prompt_keys()
    present = saved(keys)
    result = inspect_prompt(keys, StoreSnapshot(frozenset(present), check_failures={keys.block_key(1): "checksum: x"}))
    assert (result.hit_tokens, result.loadable_hit_tokens) == (84, 32)


def test_a_cache_salt_changes_every_key():
    keys, salted = prompt_keys(), prompt_keys(salt="user-2")
    result = inspect_prompt(salted, StoreSnapshot(frozenset(saved(keys))))
    assert result.hit_tokens == 0
    assert all(b.miss_reason == NEVER_STORED for b in result.boundaries)


def test_uninteresting_tail_boundaries_are_counted_not_listed():
    keys = prompt_keys()
    result = inspect_prompt(keys, StoreSnapshot(frozenset()))
    assert [(b.kind, b.end_token) for b in result.boundaries] == [("block", 32), ("block", 64), ("tail", 85)]
    assert result.hidden_never_stored == 31 + 31 + 20
    everything = inspect_prompt(keys, StoreSnapshot(frozenset()), show_all=True)
    assert len(everything.boundaries) == 3 + result.hidden_never_stored


def test_the_namespace_is_the_only_one_or_must_be_chosen():
    assert choose_namespace(None, ["a" * 16]) == "a" * 16
    assert choose_namespace("b" * 16, ["a" * 16]) == "b" * 16
    with pytest.raises(UserError, match="several kvtool namespaces"):
        choose_namespace(None, ["a" * 16, "b" * 16])
    with pytest.raises(UserError, match="--namespace"):
        choose_namespace(None, [])


def test_a_namespace_that_cannot_be_one_is_one_sentence_naming_those_stored():
    with pytest.raises(UserError, match="16 lower-case hex digits .the store holds 0123456789abcdef"):
        choose_namespace("xyz", ["0123456789abcdef"])
    assert choose_namespace("fedcba9876543210", []) == "fedcba9876543210"  # not stored yet: its misses are listed


def test_token_ids_parse_from_lists_and_separated_text():
    assert parse_token_ids("1,2, 3") == [1, 2, 3]
    assert parse_token_ids("[4, 5]") == [4, 5]
    assert parse_token_ids("4 5\n6\n") == [4, 5, 6]
    assert parse_token_ids("hello world") is None
    assert parse_token_ids("[INST] hello [/INST]") is None  # text that starts like a list: text
    for bad in ("[1, -2]", '[1, 2, "x"]', "[]", "[1.0, 2.0]", "[true, 2]", "[4294967296]", "4294967296"):
        with pytest.raises(UserError, match="token id"):
            parse_token_ids(bad)


def test_a_prompt_file_that_is_empty_or_not_text_is_one_sentence(tmp_path):
    from kvtool.inspect.tokens import prompt_tokens

    (tmp_path / "empty").write_text("  \n")
    (tmp_path / "binary").write_bytes(b"\xff\xfe\x00bad")
    with pytest.raises(UserError, match="is empty"):
        prompt_tokens(None, None, tmp_path / "empty", None)
    with pytest.raises(UserError, match="not UTF-8"):
        prompt_tokens(None, None, tmp_path / "binary", None)


def test_watermark_records_are_matched_to_a_prompt_by_the_keys_they_name():
    from connector.core.hashing import RequestIdentity
    from connector.core.prefix import PromptKeys
    from connector.core.watermarks import SaveState, WatermarkRecord
    from kvtool.inspect.misses import record_coverage

    tokens = list(range(300, 385))
    keys = PromptKeys.build(tokens, 32, 1, "0123456789abcdef", RequestIdentity().root_hash())

    def record(durable, tail_durable, last_block, tail):
        return WatermarkRecord("r", None, 85, durable, 85, tail_durable, SaveState.DURABLE, None, 1.0, last_block, tail)

    same = record_coverage(record(85, True, keys.block_key(1), keys.tail_key(85)), keys)
    assert (same.durable_offset, same.tail_boundary, same.tail_durable) == (85, 85, True)
    failed_tail = record_coverage(record(64, False, keys.block_key(1), keys.tail_key(85)), keys)
    assert (failed_tail.durable_offset, failed_tail.tail_durable) == (64, False)
    longer_prompt = PromptKeys.build(tokens + list(range(40)), 32, 1, "0123456789abcdef", RequestIdentity().root_hash())
    # A longer prompt extending the recorded one shares its blocks and its tail.
    longer = record_coverage(record(85, True, keys.block_key(1), keys.tail_key(85)), longer_prompt)
    assert (longer.durable_offset, longer.tail_durable) == (85, True)
    shorter_prompt = PromptKeys.build(tokens[:70], 32, 1, "0123456789abcdef", RequestIdentity().root_hash())
    shorter = record_coverage(record(85, True, keys.block_key(1), keys.tail_key(85)), shorter_prompt)
    assert (shorter.durable_offset, shorter.tail_boundary) == (64, None)
    assert record_coverage(record(85, True, "kvtool/other", "kvtool/other-tail"), keys) is None


def test_without_a_ready_file_the_prompt_is_keyed_on_the_connectors_default_grid():
    """The --admin form knew no grid and took none: a prompt leaving a stored one inside a block showed
    a miss where the consumer hits through a pointer."""
    from connector.config import divergence_grid, load_config
    from kvtool.inspect.prompt import default_grid

    for block_size in (16, 32, 256):
        assert default_grid(block_size) == divergence_grid(load_config({"master_server_address": "x:1"}), block_size)
        assert default_grid(block_size) > 0


@pytest.mark.parametrize(
    ("block_size", "hash_unit", "named"),
    [(-32, None, "--block-size"), (0, None, "--block-size"), (32, 64, "--hash-unit"), (32, -1, "--hash-unit")],
)
def test_a_block_size_or_hash_unit_that_cannot_be_is_one_sentence(block_size, hash_unit, named):
    from kvtool.inspect.prompt import prompt_report
    from kvtool.inspect.target import Target

    with pytest.raises(UserError, match=named):  # before the store is asked anything
        prompt_report(Target(admin="http://127.0.0.1:1"), TOKENS, None, block_size, hash_unit, None, [], False, False)
