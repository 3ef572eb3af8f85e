"""Several hosts: the master, a standalone store, the producer and the consumer each in a network namespace
of their own (tests/netns.py: veth pairs to a bridge in a namespace of its own; nothing is added to the
root namespace), talking over the namespaces' addresses, not loopback. The test's requests come from a
fifth namespace. Reuse crosses hosts (the producer saves to the store host, the consumer loads from it);
then one host is cut off (its link set down): requests are still answered, equal to a recomputation, as
misses; when the link comes back, hits resume. Every namespace is removed at the end."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtool.model import ensure_default_model
from kvtool.pair.config import ServePairConfig
from kvtool.pair.engines import engine_argv, engine_env
from kvtool.procs import LOOPBACK, ManagedProcess, ProcessSet, ReadinessCheck
from kvtool.store.mooncake import find_binary, master_argv, mooncake_env, standalone_store_argv
from tests.netns import Lab, can_make_namespaces

from .pairtools import RunningPair, consume, produce, prompt
from .test_restart import hits_again

pytestmark = pytest.mark.e2e

MASTER_PORT, ADMIN_PORT, STORE_PORT, ENGINE_PORT = 50051, 9003, 50052, 8000
READY_TIMEOUT_S = 300.0


def asked_from_the_client(lab: Lab, **check) -> ReadinessCheck:
    """A readiness check the client host asks (the root namespace has no address in the lab)."""
    return ReadinessCheck(**check, through=lambda ask: lab.call_in("client", ask))


def engine(lab: Lab, procs: ProcessSet, cfg: ServePairConfig, role: str, address: str) -> ManagedProcess:
    """A vLLM server of the pair config's ``role``, bound and advertised on its host's address."""
    argv = engine_argv(cfg, role)  # type: ignore[arg-type]
    argv[argv.index("--host") + 1] = address
    argv[argv.index("--port") + 1] = str(ENGINE_PORT)
    at = argv.index("--kv-transfer-config") + 1
    transfer = json.loads(argv[at])
    transfer["kv_connector_extra_config"]["mooncake"]["local_hostname"] = address  # what the other hosts reach
    argv[at] = json.dumps(transfer)
    env = engine_env(cfg, role)  # type: ignore[arg-type]
    env.update({"VLLM_HOST_IP": address, "MC_TCP_BIND_ADDRESS": address})
    ready = asked_from_the_client(lab, http_url=f"http://{address}:{ENGINE_PORT}/health")
    return procs.start(role, lab.command(role, argv), env=env, readiness=ready, cwd=Path(__file__).resolve().parents[2])


def bound_to(address: str) -> dict[str, str]:
    """A Mooncake process's environment, its transfer engine bound to its host's address."""
    return {**mooncake_env(), "MC_TCP_BIND_ADDRESS": address}


class HostPair(RunningPair):
    """The pair across the lab's hosts, as the shared helpers take a pair (no ready file: this test starts
    its processes itself; no master named: the helpers' store checks would ask it from this namespace)."""

    addresses: dict[str, str]  # host -> its address in the lab


@pytest.fixture(scope="module")
def lab() -> Iterator[Lab]:
    why = can_make_namespaces()
    if why is not None:
        pytest.fail(f"the multi-host test needs network namespaces: {why}")
    made = Lab()
    try:
        yield made
    finally:
        made.remove()


@pytest.fixture(scope="module")
def hosts(lab: Lab, tmp_path_factory: pytest.TempPathFactory) -> Iterator[HostPair]:
    workdir = tmp_path_factory.mktemp("multi-host")
    addresses = {host: lab.add_host(host) for host in ("master", "store", "producer", "consumer", "client")}
    master, store = addresses["master"], addresses["store"]
    procs = ProcessSet(workdir)
    try:
        master_command = master_argv(MASTER_PORT, ADMIN_PORT, find_binary("mooncake_master"), host=master)
        admin = f"http://{master}:{ADMIN_PORT}"
        ready = asked_from_the_client(lab, http_url=f"{admin}/health")
        procs.wait_ready([procs.start("master", lab.command("master", master_command), bound_to(master), ready)], 60)
        store_command = standalone_store_argv(
            f"{master}:{MASTER_PORT}", STORE_PORT, 512 << 20, find_binary("mooncake_client"), host=store
        )
        ready = asked_from_the_client(lab, tcp_port=STORE_PORT, tcp_host=store)
        procs.wait_ready([procs.start("store", lab.command("store", store_command), bound_to(store), ready)], 60)
        cfg = ServePairConfig(
            model=ensure_default_model(preset="tiny"),
            log_dir=workdir,
            external_master=f"{master}:{MASTER_PORT}",
            store="standalone",
            ready_file=None,
        )
        engines = [engine(lab, procs, cfg, role, addresses[role]) for role in ("producer", "consumer")]
        procs.wait_ready(engines, READY_TIMEOUT_S)
        yield HostPair(
            producer=f"http://{addresses['producer']}:{ENGINE_PORT}",
            consumer=f"http://{addresses['consumer']}:{ENGINE_PORT}",
            model=str(cfg.model),
            block_size=cfg.block_size,
            hash_unit=cfg.hash_unit,
            max_model_len=cfg.max_model_len,
            connector=cfg.connector,
            roles=cfg.roles,
            admin=admin,
            addresses=addresses,
        )
    finally:
        procs.stop_all()


def test_hosts_talk_over_their_own_addresses_never_loopback(lab, hosts):
    assert all(not address.startswith("127.") and address != LOOPBACK for address in hosts.addresses.values())
    # Reuse crosses hosts: the producer's save lands on the store host, the consumer loads it from there.
    lab.call_in("client", lambda: hits_again(hosts, seed=4000))


@pytest.mark.parametrize("host", ["store", "master"])
def test_a_host_cut_off_mid_run_costs_misses_never_wrong_answers_and_hits_resume(lab, hosts, host):
    pair = hosts
    lab.call_in("client", lambda: hits_again(pair, seed=4100 if host == "store" else 4500))
    stored = prompt(4200 if host == "store" else 4600, 45)
    lab.call_in("client", lambda: produce(pair, stored))  # on the store host, not asked of the consumer yet
    lab.cut(host)
    try:
        for number in range(3):  # answered while the host is unreachable: exact, and nothing loaded
            details, _ = lab.call_in("client", lambda number=number: consume(pair, stored + prompt(4300 + number, 5)))
            assert details.external_hit_tokens == 0, details
    finally:
        lab.reconnect(host)
    lab.call_in("client", lambda: hits_again(pair, seed=4400 if host == "store" else 4800))
