"""End to end on a real producer/consumer pair (block size 32): partial tails are stored and reused,
and reused KV gives the same answer as recomputing it."""

from __future__ import annotations

import httpx
import pytest

from kvtool import prometheus
from kvtool.client import complete

from .pairtools import consume, produce, prompt

pytestmark = pytest.mark.e2e


def test_sub_block_prompt_is_reused_as_a_tail(pair):
    base = prompt(1, 20)
    produced = produce(pair, base)
    assert produced.save_tail_boundary == 20
    details, _ = consume(pair, base + prompt(2, 17))
    assert details.external_hit_tokens == 20
    assert (details.block_hit_tokens, details.tail_hit_tokens) == (0, 20)


def test_cross_block_prompt_is_reused_blocks_plus_tail_then_repeated(pair):
    base = prompt(3, 85)
    produced = produce(pair, base)
    assert produced.save_objects == 3 and produced.save_tail_boundary == 85
    # vLLM calls the per-step hook the producer's copies wait at (connector.worker.stepcopies): its saves are
    # copied off the engine's step, and what they stored is what the consumer's answer below checks.
    metrics = httpx.get(f"{pair.producer}/metrics", timeout=10).text
    assert (prometheus.total(metrics, "vllm:kvtool_saves_copied_off_step_total") or 0) > 0
    details, _ = consume(pair, base + prompt(4, 10))
    assert details.external_hit_tokens == 85
    assert (details.block_hit_tokens, details.tail_hit_tokens) == (64, 21)

    # Unchanged: the consumer's own cache holds the two full blocks, the store gives the tail,
    # and one prompt token is left to compute.
    repeat, _ = consume(pair, base)
    assert repeat.reused_tokens == 84
    assert repeat.tail_hit_tokens == repeat.external_hit_tokens > 0


def test_a_prompt_never_published_misses(pair):
    details, _ = consume(pair, prompt(5, 70))
    assert details.external_hit_tokens == 0
    assert details.lookup == "miss"


def test_streamed_requests_are_attributed_through_the_request_log(pair):
    from pathlib import Path

    from kvtool.bench.runner import RequestLogReader

    base = prompt(6, 40)
    produce(pair, base)
    tag = "stream-attribution-1"
    # The log's lines are written off the engine's thread, a moment after the response: read as the
    # bench does, waiting for the tag (from the file's end now: a line written before is not this one).
    reader = RequestLogReader(Path(pair.request_logs["consumer"]))
    streamed = complete(
        pair.consumer,
        pair.model,
        base + prompt(7, 9),
        max_tokens=3,
        stream=True,
        kv_transfer_params={"kvtool_tag": tag},
    )
    assert streamed["usage"]["prompt_tokens_details"]["cached_tokens"] == 40
    record = reader.record(tag)
    assert record is not None, "no request log line carries the tag"
    log = Path(pair.request_logs["consumer"]).read_text()
    assert sum(1 for line in log.splitlines() if f'"tag":"{tag}"' in line) == 1  # one line only
    assert (record.external_hit_tokens, record.block_hit_tokens, record.tail_hit_tokens) == (
        40,
        32,
        8,
    )
