"""A master group in high-availability mode (etcd, two ``mooncake_master --enable_ha``): the leader is
killed while the connector's store client works. Every call meanwhile fails closed within its time-out (a
miss, never a hang); the client follows the new leader on its own, and saves and lookups work again.
What Mooncake keeps: the objects' metadata lives in the leader's memory, so what was stored before the
failover is gone (a miss, never a wrong answer)."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from connector.calls import StoreError
from connector.config import load_config
from connector.store.store import PutOutcome, open_store
from kvtool.store.master import LocalEtcd, LocalMaster, ha_master_flags
from tests.master import LOOPBACK

FAILOVER_TRIES = 120  # calls, each bounded by the store's time-outs, half a second apart
CONNECT_TIMEOUT_S = 90.0  # a client's set-up finding the leader after the group started


@pytest.fixture
def ha_group(tmp_path):
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", LOOPBACK)
    etcd = LocalEtcd().start()
    first = LocalMaster(tmp_path / "master-a.log", ha_master_flags(etcd)).start()
    first.wait_for_role("leader")  # the first to start leads
    second = LocalMaster(tmp_path / "master-b.log", ha_master_flags(etcd)).start()
    second.wait_for_role("standby")
    try:
        yield etcd, first, second
    finally:
        second.stop()
        first.stop()
        etcd.stop()


def test_inspect_says_which_master_leads_and_that_a_standby_holds_nothing(ha_group):
    from typer.testing import CliRunner

    from kvtool.cli import app

    _, leader, standby = ha_group
    for master, role in ((leader, "leader"), (standby, "standby")):
        result = CliRunner().invoke(app, ["inspect", "store", "--admin", master.admin, "--format", "json"])
        assert result.exit_code == 0, result.output
        report = json.loads(result.output)
        assert report["ha_role"] == role
    assert any("standby of a high-availability group" in note for note in report["notes"])


def connected(config, timeout_s: float = CONNECT_TIMEOUT_S):
    """A store client of the group, set up again until it finds the leader: a group's clients find it
    through etcd 5 to 30 s after the group starts (a set-up before then returns -1), as an engine's
    do (connector.store.latestore tries again in the background)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return open_store(config)
        except StoreError:
            if time.monotonic() > deadline:
                raise
            time.sleep(1.0)


def test_clients_follow_the_new_leader_and_calls_fail_closed_meanwhile(ha_group):
    etcd, leader, standby = ha_group
    config = load_config(
        {
            "mooncake": {
                "master_server_address": f"etcd://{etcd.endpoint}",
                "global_segment_size": 32 << 20,
                "local_buffer_size": 16 << 20,
            },
            "lookup_timeout_s": 1.0,
        }
    )
    store = connected(config)
    try:
        assert store.put("kvtool-test/before", b"stored before the failover") is PutOutcome.STORED
        assert store.exists(["kvtool-test/before"]) == [True]

        os.killpg(leader.pid, signal.SIGKILL)
        failed = 0
        for attempt in range(FAILOVER_TRIES):
            try:
                outcome = store.put(f"kvtool-test/after-{attempt}", b"stored after the failover")
            except StoreError:
                failed += 1  # a miss, returned within the time-out
                outcome = None
            if outcome is PutOutcome.STORED:
                break
            time.sleep(0.5)
        else:
            pytest.fail("no put was stored after the leader died")
        assert standby.role() == "leader"
        key = f"kvtool-test/after-{attempt}"
        assert store.exists([key, "kvtool-test/before"]) == [True, False]  # the old leader's objects are gone
        assert store.get([key]) == [b"stored after the failover"]
    finally:
        store.close()
