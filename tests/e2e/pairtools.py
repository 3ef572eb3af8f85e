"""Requests against the session pair, shared by the end-to-end tests."""

from __future__ import annotations

import json
import os
import random
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from connector.config import load_config
from kvtool.pair.ready import ReadyFile, read_ready_file
from connector.core.hits import HitDetails
from connector.store.store import PutOutcome, StoreError, TimedStore, open_store
from kvtool import prometheus
from kvtool.store.admin import metrics_text, open_admin, wait_for_key
from kvtool.client import complete
from kvtool.procs import http_ok
from kvtool.verify import compare_answers

TOLERANCE = 1e-3  # max |logprob difference| against a full recomputation
# A load that failed before any check ran: its transfer failed or timed out, or it stalled past what
# recomputing costs and was given up as slow (Mooncake TCP's first transfer to a segment, README known issues).
TRANSPORT_CAUSES = ("missing", "timeout", "store_error", "slow")
GENERATE = 6


def held_back(details: HitDetails) -> bool:
    """Whether the store, not the stored data, kept this request from loading: its load failed for a
    transport cause (``TRANSPORT_CAUSES``), or its lookup was not answered because the store was failing or
    slow (a stall opens the breaker, which then bypasses the store for a while: ``error: ...``). A miss
    either way, with an exact answer; a test asks again once the store is used again."""
    return details.load_failure in TRANSPORT_CAUSES or details.lookup.startswith("error:")


class RunningPair(ReadyFile):
    """A pair as the end-to-end tests hold it: the ready file serve-pair first wrote (typed,
    ``kvtool.pair.ready.ReadyFile``) and what the test set it up with."""

    ready_file: str | None = None  # serve-pair rewrites it (a restarted master, a fleet's engine out or back)
    fault_control_file: str | None = None  # the fault plan its kvtool connectors re-read
    preset: str = "tiny"  # the generated model's preset

    def url(self, engine: str) -> str:
        """An engine's base URL: ``producer`` or ``consumer`` (a fleet: its router), or a URL as it is."""
        return engine if engine.startswith("http") else getattr(self, engine)


@dataclass(frozen=True)
class PairMaster:
    """The pair's mooncake_master, as serve-pair's ready file describes it right now."""

    pair: RunningPair

    @property
    def address(self) -> str:
        return self.pair.master

    @property
    def admin(self) -> str:
        return self.pair.admin

    def ready(self) -> ReadyFile:
        return read_ready_file(Path(self.pair.ready_file))

    def pid(self) -> int | None:
        return self.ready().master_pid

    def restarts(self) -> int:
        return self.ready().restarts.get("master", 0)

    def healthy(self) -> bool:
        return http_ok(self.admin + "/health", timeout=1.0)


def prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 900) for _ in range(length)]


def hit_details(response: dict) -> HitDetails:
    """The kvtool hit details of a /v1/completions response (the connector returns them on every one)."""
    details = HitDetails.from_response(response)
    assert details is not None, f"the response carries no kvtool hit details: {response.get('kv_transfer_params')}"
    return details


# The store's capacity when a test first found it serving, by admin URL: every engine's segment mounted.
_capacity: dict[str, float] = {}
STORE_SERVING_TIMEOUT_S = 120.0


def wait_store_serving(pair: RunningPair, timeout_s: float = STORE_SERVING_TIMEOUT_S) -> None:
    """Wait until the pair's store serves: its master answers and every segment the engines lend is
    mounted on it (its capacity is back at what it was when first seen); after a wait, a test client's
    put and existence query must be answered too. A master that an earlier test killed or froze is
    replaced by serve-pair with no segment mounted: its puts fail for "insufficient space" until the
    engines' clients mount theirs again, and a test that published then would find nothing stored
    (issue 41). One HTTP request when the store serves (no client of its own: clients coming and going
    on the master are what the README's known first-transfer stall follows)."""
    admin, deadline, waited = pair.admin, time.monotonic() + timeout_s, False
    while True:
        try:
            capacity = prometheus.total(metrics_text(admin, timeout_s=5.0), "master_total_capacity_bytes") or 0.0
            why = f"{capacity:.0f} bytes of segments mounted of {_capacity.get(admin, 0.0):.0f}"
        except Exception as exc:  # noqa: BLE001 - a master being replaced does not answer: wait
            capacity, why = 0.0, f"its admin did not answer ({exc})"
        if capacity > 0 and capacity >= _capacity.get(admin, 0.0):
            _capacity.setdefault(admin, capacity)
            if not waited:
                return
            why = _answers_a_put(pair)
            if why is None:
                return
        waited = True
        assert time.monotonic() < deadline, f"the pair's store did not serve in {timeout_s:.0f} s: {why}"
        time.sleep(0.5)


def _answers_a_put(pair: RunningPair) -> str | None:
    """None when a test client's put of a fresh key and an existence query of it both succeed. Not asked
    where the pair names no master address to make a client with (a multi-host lab's), nor of a master
    group (``etcd://``): Mooncake's etcd client is one per process and keeps the first group it joined,
    so a client made here would leave a later test's group (tests/integration/test_ha.py) unreachable
    from this process. There the master's capacity must do."""
    if not pair.master or pair.master.startswith("etcd://"):
        return None
    key = f"kvtool-test/serving/{uuid.uuid4().hex}"
    try:
        with store_client(pair) as client:
            if client.put(key, b"serving") is not PutOutcome.STORED:
                return "a put was refused"
            if client.exists([key]) != [True]:
                return "a stored key was not found"
            client.remove(key)
    except StoreError as exc:
        return f"a store call failed ({exc})"
    return None


def _saved(pair: RunningPair, tokens: list[int], timeout_s: float = 60.0) -> tuple[HitDetails, str | None]:
    """Ask the producer for ``tokens`` and wait until its save ended (its final watermark record is
    written after every put, on every TP rank); the hit details and what is missing (None: every rank's
    last object is stored). The store is waited for first (``wait_store_serving``)."""
    wait_store_serving(pair)
    details = hit_details(complete(pair.producer, pair.model, tokens, max_tokens=1))
    assert details.watermark_key, f"the producer published nothing: {details}"
    store = open_admin(pair.admin)
    for ranked in details.on_every_rank(details.watermark_key):  # a TP engine's ranks each write their own
        if not wait_for_key(store, ranked, timeout_s):
            return details, f"{ranked} did not appear in the store in {timeout_s} s"
    for ranked in details.on_every_rank(details.save_last_key):
        if not store.exists(ranked):
            return details, f"the save ended without its last object ({ranked})"
    return details, None


def wait_save_ended(pair: RunningPair, details: HitDetails, timeout_s: float = 60.0) -> None:
    """Wait until the producer's save ended: its final watermark record is written after every put."""
    key = details.watermark_key
    assert key, f"the producer published nothing: {details}"
    store = open_admin(pair.admin)
    for ranked in details.on_every_rank(key):  # a TP engine's ranks each write their own
        assert wait_for_key(store, ranked, timeout_s), f"{ranked} did not appear in the store in {timeout_s} s"


def produce(pair: RunningPair, tokens: list[int], expect_stored: bool = True) -> HitDetails:
    if expect_stored:
        details, missing = _saved(pair, tokens)
        assert missing is None, missing
        return details
    wait_store_serving(pair)
    details = hit_details(complete(pair.producer, pair.model, tokens, max_tokens=1))
    wait_save_ended(pair, details)
    return details


def produce_whole(pair: RunningPair, seed: int, length: int, tries: int = 3) -> tuple[list[int], HitDetails]:
    """A fresh prompt of ``length`` tokens stored whole on every rank: up to ``tries`` prompts (seeds
    ``seed``, ``seed + 1000``, ...). A put that meets Mooncake's first-transfer stall fails closed (the
    save ends without that object: the README's known issues), which a warm-up makes rare but cannot
    rule out on a TP pair's four segments; a save that is never whole in ``tries`` fails the test."""
    missing = None
    for number in range(tries):
        tokens = prompt(seed + 1000 * number, length)
        details, missing = _saved(pair, tokens)
        if missing is None:
            return tokens, details
    raise AssertionError(f"no whole save in {tries} prompts: {missing}")


def consume(
    pair: RunningPair, tokens: list[int], engine: str = "consumer", max_tokens: int = GENERATE
) -> tuple[HitDetails, dict]:
    """Ask ``engine`` and check its answer against a full recomputation; its hit details and response
    (``choices[0]["token_ids"]``: the generated token ids).

    The recomputation: on the tiny model a request with prompt_logprobs (vLLM skips every cache for
    it); on a hybrid preset (``pair.preset``) one under a fresh cache_salt, which nothing stored
    or cached can match."""
    extra = {"return_tokens_as_token_ids": True, "return_token_ids": True, "ignore_eos": True}
    answer = complete(pair.url(engine), pair.model, tokens, max_tokens=max_tokens, logprobs=5, extra=extra)
    if pair.preset == "tiny":
        recompute: dict = {"prompt_logprobs": 1, "extra": extra}
    else:
        recompute = {"extra": {**extra, "cache_salt": uuid.uuid4().hex}}
    reference = complete(pair.url(engine), pair.model, tokens, max_tokens=max_tokens, logprobs=5, **recompute)
    assert hit_details(reference).reused_tokens == 0, "the reference reused KV"
    comparison = compare_answers(answer, reference, TOLERANCE)
    assert comparison.matches, comparison.reason
    return hit_details(answer), answer


_pointer_reads_warm: set[str] = set()  # consumers whose lookups read pointers (by URL)


STALL_RETRY_S = 180.0


def consume_while_held_back(pair: RunningPair, tokens: list[int], engine: str = "consumer") -> HitDetails:
    """``consume`` (which checks the answer against a recomputation), asked again while the store held the
    request back (``held_back``: a load that stalled on a first transfer from a segment, README known
    issues, or the store bypassed after one), at most ``STALL_RETRY_S``; the last request's details."""
    deadline = time.monotonic() + STALL_RETRY_S
    while True:
        details, _ = consume(pair, tokens, engine)
        if not held_back(details) or time.monotonic() > deadline:
            return details
        time.sleep(2.0)  # past the breaker's back-off, should the stall have opened it


def warm_pointer_reads(pair: RunningPair, timeout_s: float = 120.0) -> None:
    """Wait until the consumer's lookups read pointer records: a divergence point inside a stored block
    hits. The scheduler side's first read from a peer's segment can stall (Mooncake TCP, about 30 s;
    the README's known issues); meanwhile lookups fall back to whole blocks, as they must."""
    if pair.consumer in _pointer_reads_warm:
        return  # its prompts are stored already: a second warm-up would publish nothing
    block, grid = pair.block_size, pair.divergence_grid
    deadline, seed = time.monotonic() + timeout_s, 7000
    while True:
        stored = prompt(seed, 2 * block)
        produce(pair, stored)
        common = block + grid
        details, _ = consume(pair, stored[:common] + prompt(seed + 1, 8))
        if details.reused_tokens == common:
            _pointer_reads_warm.add(pair.consumer)
            return
        assert time.monotonic() < deadline, f"no pointer hit in {timeout_s:.0f} s: {details}"
        time.sleep(2.0)
        seed += 2


def warm_loads(pair: RunningPair, blocks: int = 16, in_a_row: int = 2, timeout_s: float = 300.0) -> None:
    """Wait until the producer stores whole prompts and the consumer loads them with no failed load,
    ``in_a_row`` fresh prompts of ``blocks`` blocks in a row: every worker's store client has then
    written to and fetched from the segments the store spreads objects over. A client's first transfer
    to or from a peer's segment can stall (Mooncake TCP, 30-60 s: the README's known issues): a put
    fails and its save ends without that object, or a load fails. A test that asserts what was stored,
    or why a load failed, must not meet that stall instead of what it checks."""
    block, deadline, seed, good = pair.block_size, time.monotonic() + timeout_s, 8000, 0
    while good < in_a_row:
        tokens = prompt(seed, blocks * block + 3)
        _, missing = _saved(pair, tokens)
        if missing is None:
            details, _ = consume(pair, tokens)  # checked against a recomputation, whatever it loaded
            whole = details.load_failure is None and details.reused_tokens == len(tokens) - 1
            good, why = (good + 1, "") if whole else (0, str(details))
        else:
            good, why = 0, missing
        assert good or time.monotonic() < deadline, f"no whole save and load in {timeout_s:.0f} s: {why}"
        seed += 1


def through_pointer_stalls(attempt, timeout_s: float = 150.0) -> HitDetails:
    """Run ``attempt(try_number)`` (a fresh stored prompt and its diverging one each time; it asserts
    what the consumer reused) until its lookup read the pointer records its hit relied on.

    A lookup whose pointer read failed (``pointer_read_failed``: the transfer from a peer's segment
    stalled, the README's known Mooncake issue) falls back to the hit it has without the pointer; its
    answer was still checked against a recomputation by ``consume``. Any other miss fails at once.
    """
    deadline = time.monotonic() + timeout_s
    for number in range(1000):
        details = attempt(number)
        if not details.pointer_read_failed:
            return details
        assert time.monotonic() < deadline, f"pointer reads failed for {timeout_s:.0f} s: {details}"
        time.sleep(3.0)
    raise AssertionError("unreachable")


@contextmanager
def store_client(pair: RunningPair) -> Iterator[TimedStore]:
    """A store client of the test's own on the pair's master, lending no memory."""
    client = open_store(load_config({"master_server_address": pair.master, "global_segment_size": 0}))
    try:
        yield client
    finally:
        client.close()


def remove(pair: RunningPair, key: str, timeout_s: float = 30.0) -> None:
    """Remove one object, retrying while a recent read's lease holds it (-706)."""
    with store_client(pair) as client:
        deadline = time.monotonic() + timeout_s
        while (code := client.remove(key)) != 0:
            assert time.monotonic() < deadline, f"remove of {key} kept returning {code}"
            time.sleep(0.5)


@contextmanager
def faults(pair: RunningPair, **plan) -> Iterator[None]:
    """A fault plan (connector/faults.py) the pair's connectors apply while the block runs."""
    path = Path(pair.fault_control_file)
    staging = path.with_suffix(".tmp")
    staging.write_text(json.dumps(plan))
    os.replace(staging, path)
    try:
        yield
    finally:
        path.unlink(missing_ok=True)
