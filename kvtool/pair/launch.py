"""Running a pair: start the Mooncake master (and store) and both engines, supervise, stop them all.

kvtool serve-pair (run_pair) and kvtool bench --launch (launched_pair) both come through here, so
both keep the master up: it is restarted on its own ports when it dies or hangs (kvtool.pair.supervise),
while an engine that dies still stops everything.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext

from kvtool.errors import EXIT_INTERRUPTED, ServerError
from kvtool.files import write_json_atomically
from kvtool.pair.config import FLEET_PREFIX, REPO_ROOT, Reporter, ServePairConfig
from kvtool.pair.engines import engine_argv, engine_env
from kvtool.pair.members import FleetMembers, fleet_members
from kvtool.pair.preflight import preflight
from kvtool.procs import LOOPBACK, ManagedProcess, ProcessDied, ProcessSet, ReadinessCheck
from kvtool.pair.ready import ReadyFile, ReadyFileWriter, admin_url_for, ready_info
from kvtool.pair.scale import FleetScaler
from kvtool.pair.warmup import warm_fleet
from kvtool.pair.router import ROUTER_LABEL, ROUTER_PROCESS, router_argv, router_binary, router_readiness
from kvtool.store.mooncake import (
    find_binary,
    lmcache_argv,
    lmcache_binary,
    master_argv,
    mooncake_config_path,
    mooncake_env,
    store_argv,
    vllm_mooncake_file_config,
)
from kvtool.pair.supervise import DEFAULT_POLICY, Policy, Supervisor, Watch

MASTER_LABEL = "mooncake_master"
STORE_LABEL = "the standalone store (mooncake_client)"
LMCACHE_LABEL = "LMCache's multiprocess server"


class Interrupted(Exception):
    def __init__(self, signal_name: str) -> None:
        super().__init__(signal_name)
        self.signal_name = signal_name


@contextmanager
def signals_raise_interrupted() -> Iterator[None]:
    """SIGINT and SIGTERM raise Interrupted; the cleanup that follows runs with both ignored."""

    def handler(signum: int, _frame: object) -> None:
        raise Interrupted(signal.Signals(signum).name)

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig in previous:
            signal.signal(sig, signal.SIG_IGN)


def _restore_default_signals() -> None:
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def start_mooncake(cfg: ServePairConfig, procs: ProcessSet, say: Reporter) -> dict[str, str]:
    """Start the master and the standalone store as configured, wait until ready; return their labels."""
    labels: dict[str, str] = {}
    if cfg.profile.mooncake_config_file:
        assert cfg.master_address is not None
        write_json_atomically(
            mooncake_config_path(cfg),
            vllm_mooncake_file_config(cfg.master_address, cfg.engine_segment_bytes, cfg.local_buffer_bytes),
        )
    wanted = []  # in order: the store registers with the master
    if cfg.starts_master:
        wanted.append(
            (
                "master",
                MASTER_LABEL,
                f"on {cfg.master_address} (admin {admin_url_for(cfg)})",
                master_argv(cfg.master_port, cfg.admin_port, find_binary("mooncake_master")),
                ReadinessCheck(http_url=f"{admin_url_for(cfg)}/health"),
                30,
            )
        )
    if cfg.starts_store:
        wanted.append(
            (
                "store",
                STORE_LABEL,
                f"on {LOOPBACK}:{cfg.store_port}",
                store_argv(cfg, find_binary("mooncake_client")),
                ReadinessCheck(tcp_port=cfg.store_port),
                60,
            )
        )
    if cfg.starts_lmcache:
        wanted.append(
            (
                "lmcache",
                LMCACHE_LABEL,
                f"on {LOOPBACK}:{cfg.store_port}",
                lmcache_argv(cfg, lmcache_binary()),
                ReadinessCheck(tcp_port=cfg.store_port),
                120,
            )
        )
    for name, label, where, argv, readiness, timeout_s in wanted:
        say(f"starting {label} {where}")
        procs.wait_ready([procs.start(name, argv, env=mooncake_env(), readiness=readiness)], timeout_s=timeout_s)
        labels[name] = label
    return labels


def start_engines(cfg: ServePairConfig, procs: ProcessSet, say: Reporter) -> None:
    """Start the engines (a pair's producer and consumer, a fleet's N) side by side; wait until all are healthy."""
    engines = [
        procs.start(
            role,
            engine_argv(cfg, role),
            env=engine_env(cfg, role),
            readiness=ReadinessCheck(http_url=cfg.base_url(role) + "/health"),
            cwd=REPO_ROOT,
        )
        for role in cfg.engine_names
    ]
    what = f"{cfg.engines} vLLM engines" if cfg.is_fleet else "producer and consumer vLLM servers"
    say(f"starting {what} (about a minute; logs in {cfg.log_dir})")
    began = time.monotonic()
    procs.wait_ready(engines, timeout_s=cfg.startup_timeout_s)
    say(f"all healthy after {time.monotonic() - began:.0f} s")


def start_router(cfg: ServePairConfig, procs: ProcessSet, say: Reporter) -> None:
    """vLLM's router in front of the fleet's engines, once they are all healthy."""
    say(f"starting {ROUTER_LABEL} on {cfg.router_url} ({cfg.router_policy} over {cfg.engines} engines)")
    router = procs.start(ROUTER_PROCESS, router_argv(cfg, router_binary()), readiness=router_readiness(cfg))
    procs.wait_ready([router], timeout_s=60)


@contextmanager
def launched_pair(
    cfg: ServePairConfig,
    say: Reporter,
    signal_guard: Callable[[], AbstractContextManager[None]] = nullcontext,
    policy: Policy = DEFAULT_POLICY,
) -> Iterator[tuple[ReadyFile, ProcessSet]]:
    """Start the pair, yield its ready info (written to cfg.ready_file too) and stop everything on exit.

    From the moment the master (and store) are ready until the pair stops, a supervisor thread
    restarts them when they die or hang. ``signal_guard`` wraps start-up and the caller's body,
    e.g. signals_raise_interrupted.
    """
    preflight(cfg)
    cfg.log_dir.mkdir(parents=True, exist_ok=True)
    procs = ProcessSet(cfg.log_dir)
    ready = ReadyFileWriter(cfg.ready_file)
    procs.on_departed = lambda _name: ready.refresh()  # a fleet's engine let go: the file lists the rest
    watch: Watch | None = None
    members: FleetMembers | None = None  # a fleet's engines in the router's rotation (restarted when they end)
    scaler: FleetScaler | None = None  # a fleet's engines added and removed on request (``kvtool scale``)
    try:
        with signal_guard():
            labels = start_mooncake(cfg, procs, say)
            supervisor: Supervisor | None = None
            if labels or cfg.is_fleet:
                supervisor = Supervisor(
                    procs,
                    labels,
                    say,
                    policy,
                    event_log=cfg.log_dir / "supervisor.log",
                    on_restart=lambda _name, _pid: ready.refresh(),
                )
                watch = Watch(supervisor).start()
            start_engines(cfg, procs, say)
            if cfg.is_fleet:
                assert supervisor is not None
                warm_fleet(cfg, say)  # no user request meets a first-transfer stall
                start_router(cfg, procs, say)
                supervisor.supervise(ROUTER_PROCESS, ROUTER_LABEL)
                members = fleet_members(cfg, supervisor, ready.refresh)
                scaler = FleetScaler(cfg, procs, supervisor, members, ready.refresh, supervisor.report)

            def current_info() -> ReadyFile:
                restarts = supervisor.restarts() if supervisor is not None else {}
                out = members.out if members is not None else frozenset()
                now, scaling = (scaler.cfg, scaler.state) if scaler is not None else (cfg, None)
                return ready_info(now, procs.pids(), admin_url_for(cfg), restarts, out_of_rotation=out, scaling=scaling)

            info = ready.publish(current_info)
            if scaler is not None:
                scaler.start()  # after the first ready file: a request's outcome is written into it
            yield info, procs
    except Interrupted as exc:
        say(f"{exc.signal_name} received; stopping")
        raise
    except ServerError as exc:
        # A failed request (the bench's) whose cause is a dead engine: name the engine and its log.
        dead = None if isinstance(exc, ProcessDied) else procs.first_dead()
        if dead is not None:
            raise dead.died_error("while the pair was in use; stopping the others") from None
        raise
    finally:
        if watch is not None:
            watch.stop()  # no restart may race the shutdown
        if scaler is not None:
            scaler.stop()  # nor an engine added
        ready.remove()
        if procs.processes:
            say("stopping " + ", ".join(p.name for p in reversed(procs.processes)))
        procs.stop_all()
        if watch is not None:
            watch.release()
        if scaler is not None:
            scaler.release()


def _engine_left_fleet(cfg: ServePairConfig, procs: ProcessSet, dead: ManagedProcess, say: Reporter) -> bool:
    """A fleet's engine that ended while others serve: let go (the router takes it out of its rotation,
    and what its segment held becomes misses); True. False for anything else, or the last engine."""
    if not dead.name.startswith(FLEET_PREFIX):
        return False
    engines = [proc.name for proc in list(procs.processes) if proc.name.startswith(FLEET_PREFIX)]  # scaled too
    serving = [name for name in engines if name != dead.name and name not in procs.departed]
    if not serving:
        return False
    procs.depart(dead.name)
    say(
        f"{dead.name} (pid {dead.pid}) {dead.how_it_ended()}; the router takes it out of the rotation, "
        f"{len(serving)} engine(s) serve on (its log: {dead.log_path})"
    )
    return True


def run_pair(
    cfg: ServePairConfig,
    say: Reporter,
    on_ready: Callable[[ReadyFile], None],
    smoke: Callable[[ReadyFile], None] | None = None,
    policy: Policy = DEFAULT_POLICY,
) -> int:
    """Run until interrupted, until an engine dies, or (with smoke) until the smoke check ends.

    The master and the standalone store are not in that list: they are restarted instead.
    """
    try:
        with launched_pair(cfg, say, signals_raise_interrupted, policy) as (info, procs):
            on_ready(info)
            if smoke is not None:
                try:
                    smoke(info)
                except ServerError:
                    dead = procs.first_dead()
                    if dead is not None:
                        raise dead.died_error("during the smoke check") from None
                    raise
                return 0
            while True:
                dead = procs.first_dead()
                if dead is not None and not _engine_left_fleet(cfg, procs, dead, say):
                    raise dead.died_error("while serving; stopping the others")
                time.sleep(0.5)
    except Interrupted:
        return EXIT_INTERRUPTED
    finally:
        _restore_default_signals()
