"""Faults injected below the store adapter of the running pair: every request completes, every answer
equals a recomputation, the hit details and metrics name the cause, and watermarks stay behind data."""

from __future__ import annotations

import time

import httpx
import pytest

from connector.config import load_config
from connector.store.store import open_store
from connector.core.watermarks import SaveState, WatermarkRecord
from kvtool import prometheus
from kvtool.client import complete

from .pairtools import RunningPair, consume, faults, hit_details, produce, prompt, wait_save_ended, wait_store_serving

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def reader(pair):
    """A store client of the test's own, lending no memory, to read watermark records."""
    client = open_store(load_config({"master_server_address": pair.master, "global_segment_size": 0}))
    yield client
    client.close()


def metric(pair: RunningPair, role: str, name: str) -> float:
    return prometheus.total(httpx.get(f"{pair.url(role)}/metrics", timeout=10).text, name) or 0.0


def wait_metric(pair: RunningPair, role: str, name: str, above: float, timeout_s: float = 30.0) -> float:
    deadline = time.monotonic() + timeout_s
    while True:
        value = metric(pair, role, name)
        if value > above or time.monotonic() > deadline:
            return value
        time.sleep(0.5)


@pytest.mark.parametrize("how,cause", [("flip", "checksum"), ("truncate", "truncated"), ("namespace", "namespace")])
def test_a_corrupted_object_is_rejected_and_recomputed(pair, how, cause):
    base = prompt(100 + len(how), 85)
    produce(pair, base)
    before = metric(pair, "consumer", f"vllm:kvtool_load_failures_{cause}_total")
    with faults(pair, corrupt_get=how):
        details, _ = consume(pair, base + prompt(7, 12))  # the answer equals the recomputation
    assert details.load_failure == cause
    assert details.external_hit_tokens == 0
    assert wait_metric(pair, "consumer", f"vllm:kvtool_load_failures_{cause}_total", before) > before


def test_a_request_aborted_while_its_load_fails_leaves_no_stale_blocks_for_a_local_hit(pair):
    """vLLM caches a synchronous load's blocks before the load runs; with the recompute policy a failed
    load leaves them cached, and a request aborted before its recomputation leaves them there, so a
    later prompt with the same prefix would hit them locally. kvtool's loads are asynchronous: blocks
    are cached only once their load succeeded, and a failed load frees them uncached."""
    base = prompt(115, 80)
    produce(pair, base)
    before = metric(pair, "consumer", "vllm:kvtool_load_failures_checksum_total")
    with faults(pair, corrupt_get="flip", get_delay_s=1.5):
        with pytest.raises(httpx.TimeoutException):  # the client gives up: vLLM aborts the request mid-load
            httpx.post(
                f"{pair.consumer}/v1/completions",
                json={"model": pair.model, "prompt": base + prompt(116, 4), "max_tokens": 4, "temperature": 0},
                timeout=0.5,
            )
        assert wait_metric(pair, "consumer", "vllm:kvtool_load_failures_checksum_total", before) > before
    # The same prefix again, the store healthy: whatever is reused, the answer equals a recomputation.
    details, _ = consume(pair, base + prompt(117, 4))
    assert details.reused_tokens == len(base)


def test_objects_gone_after_a_positive_lookup_are_a_recompute(pair):
    """The segment's owner died between "exists" and the load: the load finds nothing."""
    base = prompt(110, 50)
    produce(pair, base)
    with faults(pair, fail_get=True):
        details, _ = consume(pair, base + prompt(8, 20))
    assert details.load_failure == "missing" and details.external_hit_tokens == 0


def test_a_slow_store_is_a_miss_within_the_lookup_timeout(pair):
    base = prompt(120, 40)
    produce(pair, base)
    with faults(pair, delay_s=4.0):  # past the 2 s lookup time-out, and far past what the hit could save
        details, _ = consume(pair, base + prompt(9, 10))
    # Given up at the time-out, or sooner (what its hit could save, once the cost model has measured
    # the engine), or not even asked (the store bypassed): a miss either way.
    assert details.lookup.startswith("error:"), details.lookup
    assert any(why in details.lookup for why in ("timed out", "took over", "bypassed")), details.lookup
    assert details.external_hit_tokens == 0
    # Back to normal once the circuit breaker's back-off (1 s after a time-out) has passed: hits again.
    deadline, seed = time.monotonic() + 60, 10
    while True:
        details, _ = consume(pair, base + prompt(seed, 10))
        if not details.lookup.startswith("error:") or time.monotonic() > deadline:
            break
        seed += 1
        time.sleep(0.5)
    assert details.reused_tokens == 40  # block 0 is local by now
    assert details.tail_hit_tokens == 8


def test_a_store_slowed_below_slow_call_ms_is_used_and_above_it_bypassed_until_quick_again(pair):
    """Issue 38: a store that answers slowly costs hits, never time. 20 ms a call (under slow_call_ms,
    150) keeps it in use: hits. 400 ms a call (over it, under every lookup bound) is bypassed within the
    breaker's three slow calls: requests are misses at once, every answer exact. Quick again, it is used
    again after the back-off, without a restart."""
    base = prompt(200, 40)
    produce(pair, base)
    bypassed_before = metric(pair, "consumer", "vllm:kvtool_store_bypassed_slow_total")
    with faults(pair, delay_s=0.02):
        details, _ = consume(pair, base + prompt(201, 10))
    assert (details.lookup, details.external_hit_tokens) == ("hit", 40)
    assert metric(pair, "consumer", "vllm:kvtool_store_bypassed_slow_total") == bypassed_before

    with faults(pair, delay_s=0.4):
        lookups = [consume(pair, base + prompt(202 + n, 10))[0].lookup for n in range(5)]
    assert any("bypassed" in lookup for lookup in lookups), lookups
    assert metric(pair, "consumer", "vllm:kvtool_store_bypassed_slow_total") > bypassed_before

    deadline, seed = time.monotonic() + 60, 210
    while True:  # quick again: the breaker's trial lookup (after a back-off of 1-10 s) closes it
        details, _ = consume(pair, base + prompt(seed, 10))
        if not details.lookup.startswith("error:") or time.monotonic() > deadline:
            break
        seed += 1
        time.sleep(0.5)
    assert details.lookup == "hit" and details.tail_hit_tokens == 8  # block 0 is local by now


def test_a_full_store_keeps_the_tail_a_miss_and_the_watermark_at_the_last_block(pair, reader):
    base = prompt(130, 85)
    with faults(pair, put_outcome="no_space", put_kinds=["t"]):
        published = produce(pair, base, expect_stored=False)
    (value,) = reader.get([published.watermark_key])
    record = WatermarkRecord.decode(value)
    assert (record.state, record.durable_offset, record.tail_durable) == (SaveState.FAILED, 64, False)
    assert "no_space" in record.reason
    details, _ = consume(pair, base + prompt(11, 10))
    assert (details.external_hit_tokens, details.tail_hit_tokens) == (64, 0)


def test_a_durable_save_publishes_its_watermark_at_the_prompt_length(pair, reader):
    base = prompt(140, 53)
    published = produce(pair, base)
    (value,) = reader.get([published.watermark_key])
    record = WatermarkRecord.decode(value)
    assert (record.state, record.durable_offset, record.tail_boundary, record.tail_durable) == (
        SaveState.DURABLE,
        53,
        53,
        True,
    )


def test_the_same_prompt_published_twice_at_once_gives_one_object_and_no_error(pair):
    from concurrent.futures import ThreadPoolExecutor

    base = prompt(150, 70)
    wait_store_serving(pair)
    with ThreadPoolExecutor(2) as pool:
        answers = list(pool.map(lambda _: complete(pair.producer, pair.model, base, max_tokens=1), range(2)))
    assert all(a["choices"][0]["finish_reason"] for a in answers)
    for answer in answers:  # both saves ended (the second finds the first's objects, or races it): then look
        wait_save_ended(pair, hit_details(answer))
    details, _ = consume(pair, base + prompt(12, 5))
    assert details.external_hit_tokens == 70


@pytest.mark.parametrize("bad_prompt", [[], list(range(10, 10 + 2100))], ids=["empty", "longer-than-the-model"])
def test_bad_prompts_get_a_clear_error_and_the_engine_keeps_serving(pair, bad_prompt):
    from kvtool.errors import ServerError

    with pytest.raises(ServerError) as info:
        complete(pair.consumer, pair.model, bad_prompt, max_tokens=2)
    assert "HTTP 400" in str(info.value)
    base = prompt(160 + len(bad_prompt), 30)  # a prompt of its own per case
    produce(pair, base)
    details, _ = consume(pair, base + prompt(13, 5))
    assert details.external_hit_tokens == 30


def test_a_lookup_while_the_save_is_in_flight_is_a_miss_or_a_whole_hit(pair):
    base = prompt(170, 85)
    seen = []
    with faults(pair, put_delay_s=0.4):  # each put of the producer's save takes 0.4 s
        published = hit_details(complete(pair.producer, pair.model, base, max_tokens=1))
        for extra in range(4):  # look up while the three objects land one by one
            details, _ = consume(pair, base + prompt(180 + extra, 4))  # answers equal the recomputation
            seen.append(details.reused_tokens)
    assert published.save_objects == 3
    # Only whole objects are ever visible: the reuse is a prefix of stored blocks or the whole prompt.
    assert all(hit in (0, 32, 64, 85) for hit in seen), seen
