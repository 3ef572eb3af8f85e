"""serve-pair supervises its Mooncake master: killed (SIGKILL) or frozen (SIGSTOP), the master is
replaced on the same ports, the consumer keeps answering meanwhile (misses, each equal to a
recomputation), and hits come back after: on the tiny model's pair and on each hybrid preset's
(kv_both engines). Runs last on each pair: every restart empties the store."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest

from kvtool.client import complete

from .pairtools import PairMaster, consume, produce, prompt

pytestmark = pytest.mark.e2e

REPLACE_TIMEOUT_S = 90.0
RECONNECT_TIMEOUT_S = 90.0
STREAM_TOKENS = 300


def is_running_master(pid: int) -> bool:
    try:
        return b"mooncake_master" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def supervisor_log(pair) -> str:
    path = Path(pair.log_dir) / "supervisor.log"
    return path.read_text() if path.exists() else "(no supervisor.log)"


def consume_until_replaced(pair, pair_master, old_pid: int, seed: int) -> int:
    """Ask the consumer for new prompts until serve-pair runs a new, healthy master; return its pid.

    Every answer, during the outage too, must come (no hang), be a miss, and equal a recomputation.
    """
    deadline = time.monotonic() + REPLACE_TIMEOUT_S
    answered = 0
    while True:
        details, _ = consume(pair, prompt(seed + answered, 45) + prompt(seed + 1000 + answered, 5))
        assert details.external_hit_tokens == 0, details
        answered += 1
        pid = pair_master.pid()
        if pid != old_pid and pair_master.healthy():
            return pid
        assert time.monotonic() < deadline, (
            f"serve-pair did not replace master {old_pid} in {REPLACE_TIMEOUT_S:.0f} s:\n{supervisor_log(pair)}"
        )
        time.sleep(0.2)


def hits_again(pair, seed: int) -> None:
    """The engines' clients reconnect on their own, and each engine's circuit breaker lets the store
    back in after its back-off: publish and consume fresh prompts until a save lands and the consumer
    hits it. Every answer on the way must equal a recomputation (consume checks it).

    Each test starts with it too: the pair must hit before the master is killed or frozen, whatever
    an earlier test left (a breaker still backing off, a master just replaced)."""
    deadline = time.monotonic() + RECONNECT_TIMEOUT_S
    while True:
        again = prompt(seed, 45)
        try:
            produce(pair, again, expect_stored=True)
        except AssertionError:
            if time.monotonic() > deadline:
                raise
        else:
            details, _ = consume(pair, again + prompt(seed + 5000, 5))
            if details.external_hit_tokens == 45 or time.monotonic() > deadline:
                assert details.external_hit_tokens == 45, details
                return
        seed += 1
        time.sleep(1)


def test_a_killed_master_is_restarted_by_serve_pair(pair, pair_master):
    killed_master(pair, pair_master, seed=200)


def test_a_frozen_master_is_replaced_by_serve_pair(pair, pair_master):
    frozen_master(pair, pair_master, seed=600)


def test_a_hybrid_pairs_killed_master_is_restarted(hybrid):
    killed_master(hybrid, PairMaster(hybrid), seed=1200)


def test_a_hybrid_pairs_frozen_master_is_replaced(hybrid):
    frozen_master(hybrid, PairMaster(hybrid), seed=1600)


def killed_master(pair, pair_master, seed: int) -> None:
    hits_again(pair, seed)
    old, restarts = pair_master.pid(), pair_master.restarts()
    os.kill(old, signal.SIGKILL)

    new = consume_until_replaced(pair, pair_master, old, seed=seed + 100)
    assert not is_running_master(old)
    # Once, or more when a start did not pass its health check in time on a loaded machine.
    assert pair_master.restarts() >= restarts + 1, supervisor_log(pair)
    assert pair_master.address == pair.master and pair_master.ready().admin == pair.admin
    assert f"(pid {old}) was killed by SIGKILL" in supervisor_log(pair)
    assert f"again as pid {new}" in supervisor_log(pair)
    hits_again(pair, seed + 200)


def frozen_master(pair, pair_master, seed: int) -> None:
    hits_again(pair, seed)
    old, restarts = pair_master.pid(), pair_master.restarts()
    os.kill(old, signal.SIGSTOP)  # its ports stay open and nothing answers: only a health check tells
    # A stream decodes through the freeze while new prompts arrive: no engine step waits on the store
    # (its pace, inter-token latency, is measured in benchmarks/decode_stall; tests never time it).
    streamed: dict = {}
    decoding = threading.Thread(
        target=lambda: streamed.update(
            complete(
                pair.consumer,
                pair.model,
                prompt(seed + 50, 30),
                max_tokens=STREAM_TOKENS,
                stream=True,
                extra={"ignore_eos": True},
            )
        )
    )
    decoding.start()
    try:
        new = consume_until_replaced(pair, pair_master, old, seed=seed + 100)
    finally:
        if is_running_master(old) and pair_master.pid() == old:
            os.kill(old, signal.SIGCONT)  # not replaced: let the pair go on (and stop) normally
        decoding.join(timeout=REPLACE_TIMEOUT_S)
    assert not decoding.is_alive(), "the stream hung while the master was frozen"
    assert streamed["usage"]["completion_tokens"] == STREAM_TOKENS
    assert not is_running_master(old)
    assert pair_master.restarts() >= restarts + 1, supervisor_log(pair)
    log = supervisor_log(pair)
    assert f"(pid {old}) has failed its health check" in log and "killed it (SIGKILL)" in log
    assert f"again as pid {new}" in log
    hits_again(pair, seed + 200)
