"""A pair on a master group in high-availability mode: etcd and two ``mooncake_master --enable_ha``, the
engines naming the group (``serve-pair --master etcd://...``). The leader is killed mid-run: every request
is still answered, equal to a recomputation, as a miss while the group fails over; the engines' clients
follow the new leader on their own and reuse resumes. What Mooncake keeps: object metadata lives in the
leader's memory, so the prompts stored before the failover are misses after it (never wrong answers)."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator

import pytest

from kvtool.store.master import LocalEtcd, LocalMaster, ha_master_flags

from .conftest import running_pair
from .pairtools import consume, produce, prompt
from .test_restart import hits_again

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def ha_pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[dict, LocalMaster, LocalMaster]]:
    workdir = tmp_path_factory.mktemp("ha-pair")
    etcd = LocalEtcd().start()
    masters: list[LocalMaster] = []
    try:
        for name in ("master-a", "master-b"):
            masters.append(LocalMaster(workdir / f"{name}.log", ha_master_flags(etcd)).start())
            masters[-1].wait_for_role("leader" if name == "master-a" else "standby")
        with running_pair(workdir, "tiny", extra_args=("--master", f"etcd://{etcd.endpoint}")) as info:
            assert info.master == f"etcd://{etcd.endpoint}" and info.admin is None
            yield info, masters[0], masters[1]
    finally:
        for master in reversed(masters):
            master.stop()
        etcd.stop()


def test_the_leader_killed_mid_run_engines_keep_answering_and_reuse_resumes(ha_pair):
    info, leader, standby = ha_pair
    pair = info.model_copy(update={"admin": leader.admin})  # the helpers wait for saves on the leader's admin port
    hits_again(pair, seed=3000)
    stored = prompt(3100, 45)
    produce(pair, stored)  # stored on the leader, never asked of the consumer yet

    os.killpg(leader.pid, signal.SIGKILL)
    # While the group fails over, and after: answered, equal to a recomputation, and a miss (the new
    # leader never knew the prompt stored before).
    answered = 0
    while standby.role() != "leader" or answered < 3:
        details, _ = consume(pair, stored + prompt(3200 + answered, 5))
        assert details.external_hit_tokens == 0, details
        answered += 1
        assert answered < 200, "the standby master never took over"
    pair = info.model_copy(update={"admin": standby.admin})
    hits_again(pair, seed=3300)  # the engines follow the new leader: a new save is loaded again
