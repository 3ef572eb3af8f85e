"""On a `--roles both` pair with a token-exact divergence grid (the tiny model, and the session's hybrid
pairs: sliding window and Mamba): a disaggregated chat reuses every previous prompt and the decoding
engine's real answer, to the token; a prompt that leaves a stored one inside a block or a tail hits
exactly their common prefix; every answer is a recomputation's."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from connector.core.hits import HitDetails
from kvtool.store.admin import open_admin, wait_for_key

from .conftest import running_pair
from .pairtools import (
    RunningPair,
    consume,
    produce,
    prompt,
    through_pointer_stalls,
    wait_save_ended,
    warm_pointer_reads,
)

pytestmark = pytest.mark.e2e

ANSWER = 20  # generated tokens a turn: the answer ends inside a block, past the prompt's last one


@pytest.fixture(scope="module")
def both_pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningPair]:
    """A tiny-model pair whose engines are both kv_both and save their answers (serve-pair --roles
    both), with a pointer at every token inside stored objects (--divergence-grid 1). The hybrid
    presets' pairs (conftest ``hybrid``) are started that way too."""
    workdir = tmp_path_factory.mktemp("both-pair-tiny")
    with running_pair(workdir, "tiny", roles="both", extra_args=("--divergence-grid", "1")) as info:
        yield info


def test_a_three_turn_chat_reuses_every_previous_prompt_and_answer_to_the_token(both_pair):
    three_turn_chat(both_pair)


def test_a_three_turn_chat_on_hybrid_models(hybrid):
    """Every group's answer is saved: the sliding window's blocks, and on Mamba the running state
    after prompt + answer (less the last generated token)."""
    three_turn_chat(hybrid)


def three_turn_chat(both_pair: RunningPair) -> None:
    turn = prompt(40, 50)
    computed = 0  # tokens whose KV some engine computed before: the ideal reuse of the next turn
    for number in range(3):
        # The prefill engine (max_tokens=1): the previous prompt and the answer the consumer decoded.
        produced, _ = consume(both_pair, turn, engine="producer", max_tokens=1)
        assert produced.reused_tokens == computed, f"turn {number}: {produced}"
        wait_save_ended(both_pair, produced)
        # The decoding engine: the whole prompt but the token it must compute, then its answer.
        details, answer = consume(both_pair, turn, max_tokens=ANSWER)
        assert details.reused_tokens == len(turn) - 1, f"turn {number}: {details}"
        generated = answer["choices"][0]["token_ids"]
        assert len(generated) == ANSWER
        # Its answer save: prompt + answer but the last generated token, which has no KV.
        assert details.answer_tokens == len(turn) + ANSWER - 1 and details.answer_save_objects > 0
        assert wait_for_key(open_admin(both_pair.admin), details.answer_last_key, 60.0), details.answer_last_key
        computed = len(turn) + ANSWER - 1
        turn = turn + generated + prompt(41 + number, 7)


@pytest.mark.parametrize(
    "common, length",
    [(50, 70), (75, 90), (12, 30)],
    ids=["inside-a-block", "inside-a-tail", "inside-a-sub-block-prompt"],
)
def test_a_prompt_leaving_a_stored_one_inside_an_object_hits_exactly_the_common_prefix(both_pair, common, length):
    leave_inside_an_object(both_pair, common, length)


@pytest.mark.parametrize(
    "common, length",
    [(50, 70), (75, 90), (12, 30)],
    ids=["inside-a-block", "inside-a-tail", "inside-a-sub-block-prompt"],
)
def test_divergence_points_on_the_sliding_window_hybrid(hybrid, common, length):
    if hybrid.preset != "swa":
        pytest.skip("a Mamba model stores states at block boundaries and L - 1 only (test_hybrid covers it)")
    leave_inside_an_object(hybrid, common, length)


def leave_inside_an_object(both_pair: RunningPair, common: int, length: int) -> None:
    warm_pointer_reads(both_pair)

    def attempt(number: int) -> HitDetails:
        seed = 60 + common + 1000 * number
        stored = prompt(seed, 85 if common > 20 else 20)  # 85: blocks ending at 32, 64 and a tail at 85
        produce(both_pair, stored)
        diverging = stored[:common] + prompt(seed + 10, length - common)
        assert diverging[common] != stored[common]
        details, _ = consume(both_pair, diverging)
        if details.pointer_read_failed:  # the hit without the pointer: the whole blocks before it
            assert details.reused_tokens == common // both_pair.block_size * both_pair.block_size, details
        else:
            assert details.reused_tokens == common, details
            assert details.lookup == "hit"
        return details

    through_pointer_stalls(attempt)


def test_on_the_default_configuration_a_divergence_point_is_found_exactly(pair):
    """The session pair runs the auto grid (a quarter block: 8 tokens of 32) and extend_min_tokens 16:
    a prompt leaving a stored one inside a block reuses their exact common prefix (the pointer records'
    token ids); one leaving it 6 tokens past a block boundary, before the block's first grid point,
    reuses the whole blocks only (a block to load for 6 tokens does not pay)."""
    assert pair.divergence_grid == 8
    warm_pointer_reads(pair)
    for common, expected in ((56, 56), (53, 53), (78, 78), (70, 64)):

        def attempt(number: int, common: int = common, expected: int = expected) -> HitDetails:
            seed = 90 + 1000 * number
            stored = prompt(seed, 85)
            produce(pair, stored)
            diverging = stored[:common] + prompt(seed + 1 + common, 20)
            assert diverging[common] != stored[common]
            details, _ = consume(pair, diverging)
            fallback = common // pair.block_size * pair.block_size  # whole blocks, without the pointer
            assert details.reused_tokens == (fallback if details.pointer_read_failed else expected), (common, details)
            return details

        through_pointer_stalls(attempt)
