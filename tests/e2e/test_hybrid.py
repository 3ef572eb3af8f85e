"""Hybrid models on a real pair: every cache group saved and loaded to the exact boundary.

One pair per preset (conftest ``hybrid``: ``swa``, Gemma3-style sliding window + full attention,
prefilling in chunks of 64 tokens; ``mamba``, GraniteMoeHybrid-style Mamba2 + attention), both engines
kv_both. Every answer is compared with a recomputation under a fresh ``cache_salt`` (an engine's own
local reuse is never the reference), top-5 logprobs within 1e-3.
"""

from __future__ import annotations

import uuid
import pytest

from connector.core.hashing import RequestIdentity
from connector.core.keys import KeyKind, object_key
from connector.core.prefix import PromptKeys
from kvtool.client import complete
from kvtool.verify import compare_answers

from . import pairtools
from .pairtools import (
    GENERATE,
    TOLERANCE,
    HitDetails,
    RunningPair,
    faults,
    hit_details,
    produce,
    prompt,
    remove,
    store_client,
    wait_save_ended,
    warm_pointer_reads,
)

pytestmark = pytest.mark.e2e


def consume(pair: RunningPair, tokens: list[int]) -> HitDetails:
    """The consumer's answer, checked against a recomputation under a fresh cache_salt."""
    extra = {"return_tokens_as_token_ids": True}
    answer = complete(pair.consumer, pair.model, tokens, max_tokens=GENERATE, logprobs=5, extra=extra)
    reference = complete(
        pair.consumer,
        pair.model,
        tokens,
        max_tokens=GENERATE,
        logprobs=5,
        extra={**extra, "cache_salt": uuid.uuid4().hex},
    )
    assert hit_details(reference).reused_tokens == 0, "the reference reused KV"
    comparison = compare_answers(answer, reference, TOLERANCE)
    assert comparison.matches, comparison.reason
    return hit_details(answer)


def group_keys(pair: RunningPair, tokens: list[int], namespace: str, kind: KeyKind) -> list[str]:
    """The keys of that kind at the prompt's end, in every group that could have one (groups 0-3)."""
    keys = PromptKeys.build(tokens, pair.block_size, pair.hash_unit, namespace, RequestIdentity().root_hash())
    end, digest = len(tokens), keys.chain_hash(len(tokens))
    return [object_key(namespace, group, kind, end, digest) for group in range(4)]


def test_a_prompt_shorter_than_one_block_is_reused_whole(hybrid):
    base = prompt(3001, 20)
    produce(hybrid, base)
    assert consume(hybrid, base + prompt(3002, 11)).external_hit_tokens == 20


def test_a_tail_crossing_a_block_boundary_is_reused_to_the_token(hybrid):
    length = hybrid.block_size + 21
    base = prompt(3003, length)
    produced = produce(hybrid, base)
    assert produced.save_tail_boundary == length
    details = consume(hybrid, base + prompt(3004, 9))
    assert details.external_hit_tokens == length
    assert (details.block_hit_tokens, details.tail_hit_tokens) == (hybrid.block_size, 21)


def test_a_one_token_tail_is_reused(hybrid):
    length = hybrid.block_size + 1
    base = prompt(3005, length)
    produce(hybrid, base)
    assert consume(hybrid, base + prompt(3006, 6)).external_hit_tokens == length


def test_a_turn_extension_reuses_the_previous_turn_then_itself(hybrid):
    first = prompt(3007, 50)
    produce(hybrid, first)
    second = first + prompt(3008, 45)
    produce(hybrid, second)
    details = consume(hybrid, second + prompt(3009, 10))
    assert details.external_hit_tokens == len(second)


def test_an_unseen_prompt_is_a_miss_and_exact(hybrid):
    details = consume(hybrid, prompt(3010, 70))
    assert details.reused_tokens == 0 and details.lookup == "miss"


def test_the_same_prompt_unchanged_at_the_consumer(hybrid):
    """The disaggregated continuation: the consumer must compute the prompt's last token itself.

    Attention groups reuse ``L - 1`` tokens from the objects at ``L``. A Mamba group needs the state
    after exactly ``L - 1`` tokens: the mamba producer runs with ``--prefix-match-unit 1``, so its
    prefill stops there and vLLM offers that state's block, which it saves (ModelPreset.engine_args_for).
    """
    base = prompt(3011, hybrid.block_size + 30)
    produce(hybrid, base)
    assert consume(hybrid, base).external_hit_tokens == len(base) - 1


def test_a_prompt_diverging_after_a_stored_block_reuses_that_block(hybrid):
    """Every group holds the first block's data at its boundary: the sliding window's blocks, and the
    Mamba state saved in the step that computed the first block."""
    block = hybrid.block_size
    # On swa the pair's token-exact pointers find the divergence point itself; a Mamba model has no
    # state there, so it hits the boundary.
    diverging_at(hybrid, 3016, 2 * block + 10, block + 5, block + 5 if hybrid.preset == "swa" else block)


def test_a_prompt_diverging_inside_a_stored_block_hits_where_every_group_can(hybrid):
    """A divergence point on the pair's grid inside the second block: on swa both attention groups have
    a pointer there; on mamba there is no state there, so the hit is the last state boundary."""
    block, grid = hybrid.block_size, hybrid.divergence_grid
    common = block + 2 * grid
    diverging_at(hybrid, 3018, 2 * block + 10, common, common if hybrid.preset == "swa" else block)


def diverging_at(pair: RunningPair, seed: int, length: int, common: int, expected: int) -> None:
    """Store ``length`` tokens, then send a prompt sharing their first ``common``: it reuses ``expected``.

    On swa the hit past the block boundary comes through a pointer record; a lookup whose pointer read
    failed (the README's known Mooncake stall) falls back to the whole blocks, still exact, and the test
    tries a fresh prompt (pairtools.through_pointer_stalls). A Mamba model never reads a pointer.
    """
    if pair.preset == "swa":
        warm_pointer_reads(pair)

    def attempt(number: int) -> HitDetails:
        base = prompt(seed + 1000 * number, length)
        produce(pair, base)
        details = consume(pair, base[:common] + prompt(seed + 1 + 1000 * number, 20))
        fallback = common // pair.block_size * pair.block_size
        assert details.external_hit_tokens == (fallback if details.pointer_read_failed else expected), details
        return details

    pairtools.through_pointer_stalls(attempt)


def test_a_corrupted_object_of_one_group_is_a_recompute_and_exact(hybrid):
    """Only one group's objects are spoiled (the state on mamba, tails on swa): the whole load fails."""
    base = prompt(3012, hybrid.block_size + 12)
    produce(hybrid, base)
    spoiled = ["s"] if hybrid.preset == "mamba" else ["t"]
    with faults(hybrid, corrupt_get="flip", get_kinds=spoiled):
        details = consume(hybrid, base + prompt(3013, 8))
    assert details.external_hit_tokens == 0 and details.load_failure == "checksum", details


def test_a_missing_object_of_one_group_drops_the_hit_consistently(hybrid):
    base = prompt(3014, hybrid.block_size + 17)
    produced = produce(hybrid, base)
    kind = KeyKind.STATE if hybrid.preset == "mamba" else KeyKind.TAIL
    candidates = group_keys(hybrid, base, produced.namespace, kind)
    with store_client(hybrid) as client:
        stored = [key for key, found in zip(candidates, client.exists(candidates), strict=True) if found]
    assert stored, f"no {kind.name.lower()} object of the prompt in any group"
    remove(hybrid, stored[-1])  # one group's object only
    details = consume(hybrid, base + prompt(3015, 5))
    # Without one group's tail (swa) the hit falls back to the block boundary every group holds. Without
    # the state at the prompt's end (mamba) it falls back to the producer's state one token short of it
    # (its prefill stops there), which the tail at the prompt's end covers in the attention group.
    expected = hybrid.block_size if hybrid.preset == "swa" else len(base) - 1
    assert details.external_hit_tokens == expected, details


def test_a_prompt_prefilled_in_chunks_is_reused_whole(hybrid):
    """160 tokens: on swa three chunks of 64, and by the last one the window (64) has left the first
    two blocks, which vLLM freed; what the last step still holds is what a hit on the whole prompt
    needs. On mamba, chunks of one Mamba block with a state saved at each boundary."""
    base = prompt(3030, 160)
    produce(hybrid, base)
    assert consume(hybrid, base + prompt(3031, 9)).external_hit_tokens == 160


def test_a_prefix_of_a_chunked_prompt_hits_only_where_every_group_was_saved(hybrid):
    """A prompt that shares the first 70 tokens of a chunked 160-token one: on swa the sliding-window
    blocks under them were freed before the prompt was complete and never saved, so it is a miss (never
    a load of blocks another request may own); on mamba the state at the block boundary 64 was saved in
    the step that computed it. Either way the answer is a recomputation's."""
    base = prompt(3032, 160)
    produce(hybrid, base)
    details = consume(hybrid, base[:70] + prompt(3033, 12))
    assert details.external_hit_tokens == (0 if hybrid.preset == "swa" else 64), details


def test_a_kv_both_engine_whose_load_fails_publishes_only_what_it_recomputed(hybrid):
    """Both engines are kv_both: the consumer's load fails (a flipped byte in every group), it
    recomputes and saves the prompt; the producer then loads what the consumer published, and answers
    as a recomputation does."""
    base = prompt(3040, hybrid.block_size + 12)
    produce(hybrid, base)
    extended = base + prompt(3041, 20)
    with faults(hybrid, corrupt_get="flip"):
        failed = consume(hybrid, extended)
    assert failed.external_hit_tokens == 0 and failed.load_failure == "checksum", failed
    wait_save_ended(hybrid, failed)
    details, _ = pairtools.consume(hybrid, extended + prompt(3042, 6), engine="producer")
    assert details.reused_tokens == len(extended), details
