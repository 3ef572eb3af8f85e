"""End to end on a real producer/consumer pair (block size 32): partial tails are stored and reused,
and reused KV gives the same answer as recomputing it."""

from __future__ import annotations

import random

import pytest

from kvtool.admin import wait_for_key
from kvtool.client import complete
from kvtool.verify import compare_answers

pytestmark = pytest.mark.e2e

TOLERANCE = 1e-3  # max |logprob difference| against a full recomputation
GENERATE = 6


def prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 900) for _ in range(length)]


def wait_durable(pair: dict, details: dict, timeout_s: float = 60.0) -> None:
    """Wait until the producer's save ended: its final watermark record is written after every put."""
    key = details.get("watermark_key")
    assert key, f"the producer published nothing: {details}"
    assert wait_for_key(pair["admin"], key, timeout_s), f"{key} did not appear in the store in {timeout_s} s"
    assert wait_for_key(pair["admin"], details["save_last_key"], 0), "the save ended but its last object is missing"


def produce(pair: dict, tokens: list[int]) -> dict:
    response = complete(pair["producer"], pair["model"], tokens, max_tokens=1)
    details = response["kv_transfer_params"]["kvtool"]
    wait_durable(pair, details)
    return details


def consume(pair: dict, tokens: list[int]) -> tuple[dict, dict]:
    extra = {"return_tokens_as_token_ids": True}
    answer = complete(pair["consumer"], pair["model"], tokens, max_tokens=GENERATE, logprobs=5, extra=extra)
    # prompt_logprobs makes vLLM skip every cache for this request: a full recomputation.
    reference = complete(
        pair["consumer"], pair["model"], tokens, max_tokens=GENERATE, logprobs=5, prompt_logprobs=1, extra=extra
    )
    comparison = compare_answers(answer, reference, TOLERANCE)
    assert comparison.matches, comparison.reason
    return answer["kv_transfer_params"]["kvtool"], answer


def test_sub_block_prompt_is_reused_as_a_tail(pair):
    base = prompt(1, 20)
    produced = produce(pair, base)
    assert produced["save_tail_boundary"] == 20
    details, _ = consume(pair, base + prompt(2, 17))
    assert details["external_hit_tokens"] == 20
    assert (details["block_hit_tokens"], details["tail_hit_tokens"]) == (0, 20)


def test_cross_block_prompt_is_reused_blocks_plus_tail_then_repeated(pair):
    base = prompt(3, 85)
    produced = produce(pair, base)
    assert produced["save_objects"] == 3 and produced["save_tail_boundary"] == 85
    details, _ = consume(pair, base + prompt(4, 10))
    assert details["external_hit_tokens"] == 85
    assert (details["block_hit_tokens"], details["tail_hit_tokens"]) == (64, 21)

    # Unchanged: the consumer's own cache holds the two full blocks, the store gives the tail,
    # and one prompt token is left to compute.
    repeat, _ = consume(pair, base)
    assert repeat["local_hit_tokens"] + repeat["external_hit_tokens"] == 84
    assert repeat["tail_hit_tokens"] == repeat["external_hit_tokens"] > 0


def test_a_prompt_never_published_misses(pair):
    details, _ = consume(pair, prompt(5, 70))
    assert details["external_hit_tokens"] == 0
    assert details["lookup"] == "miss"


def test_streamed_requests_are_attributed_through_the_request_log(pair):
    import json
    from pathlib import Path

    base = prompt(6, 40)
    produce(pair, base)
    tag = "stream-attribution-1"
    streamed = complete(
        pair["consumer"],
        pair["model"],
        base + prompt(7, 9),
        max_tokens=3,
        stream=True,
        kv_transfer_params={"kvtool_tag": tag},
    )
    assert streamed["usage"]["prompt_tokens_details"]["cached_tokens"] == 40
    lines = Path(pair["request_logs"]["consumer"]).read_text().splitlines()
    records = [json.loads(line) for line in lines if tag in line]
    assert len(records) == 1
    assert (records[0]["external_hit_tokens"], records[0]["block_hit_tokens"], records[0]["tail_hit_tokens"]) == (
        40,
        32,
        8,
    )
