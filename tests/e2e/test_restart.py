"""The Mooncake master killed mid-run and restarted with every key lost: misses while it is down,
hits again after, and every answer equals a recomputation throughout. Runs last: it empties the store."""

from __future__ import annotations

import time

import pytest

from .pairtools import consume, produce, prompt

pytestmark = pytest.mark.e2e


def test_master_killed_then_restarted(pair, pair_master):
    base = prompt(200, 45)
    produce(pair, base)
    details, _ = consume(pair, base + prompt(201, 5))
    assert details["external_hit_tokens"] == 45

    pair_master.stop()
    # Down: the lookup fails (or finds nothing); the request is served by recomputing.
    down, _ = consume(pair, prompt(202, 45) + prompt(203, 5))
    assert down["external_hit_tokens"] == 0

    pair_master.start()
    # The clients reconnect on their own within seconds; publish until a save ends, then it hits.
    again = prompt(204, 45)
    deadline = time.monotonic() + 90
    while True:
        try:
            produce(pair, again, expect_stored=True)
            break
        except AssertionError:
            if time.monotonic() > deadline:
                raise
            again = prompt(int(time.monotonic()), 45)
            time.sleep(2)
    details, _ = consume(pair, again + prompt(205, 5))
    assert details["external_hit_tokens"] == 45
