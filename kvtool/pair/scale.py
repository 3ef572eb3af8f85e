"""Scaling a serving fleet out and in: engines added and taken away while the router serves.

``kvtool scale --pair READY --engines N`` (``kvtool.commands.scale``) writes a request into the fleet's
log directory (``scale_request_path``); the fleet that wrote the ready file (``serve-pair --engines``, or
``bench --launch --engines``) acts on it here, and says how it went in its ready file (``scaling``).

- **Out**: engine ``k`` is started on its own port (``--producer-port`` + k, or a free one where the
  fleet was given ``--engine-port``), and joins the router's rotation only once healthy and warm with
  the engines serving (``FleetMembers.admit``: its first transfers with the store's segments went
  through, so Mooncake's first-transfer stall never meets a user's request); from then on it is
  supervised like the others. It is started only where the host has the memory a serving engine of
  the fleet takes now, and a margin (``kvtool.pair.hostmemory``); otherwise the request fails in one
  sentence and nothing is started.
- **In**: the fleet's last engine leaves the rotation at once (``/remove_worker``), finishes the
  requests it holds (its ``/metrics``, at most ``DRAIN_TIMEOUT_S``), and is stopped by its pid. What
  its segment lent the store becomes misses (with the fleet's standalone store, nothing is lost).

Thread rules: one thread (``FleetScaler``'s) reads the requests and starts every engine it adds (a
child dies with the thread that forked it: the thread stays until ``release``); ``cfg`` is swapped
whole (a reader sees the old fleet or the new one); ``_lock`` orders ``stop`` with each start, so
nothing is started once the fleet stops.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

from kvtool import prometheus, web
from kvtool.errors import UserError
from kvtool.files import write_json_atomically
from kvtool.pair.config import FLEET_PREFIX, REPO_ROOT, Reporter, ServePairConfig
from kvtool.pair.engines import engine_argv, engine_env
from kvtool.pair.hostmemory import GIB, HostMemory, check_room, largest_engine
from kvtool.pair.members import RESTART_GRACE_FACTOR, FleetMembers, engine_policy
from kvtool.pair.ready import ScalePhase, ScaleState
from kvtool.pair.supervise import Supervisor
from kvtool.procs import ManagedProcess, ProcessSet, ReadinessCheck, ensure_port_free, find_free_port, log_tail

SCALE_REQUEST = "scale-request.json"
POLL_S = 0.5
DRAIN_TIMEOUT_S = 60.0  # an engine scaled in finishes what it holds for at most this long
MAX_ENGINES = 64


@dataclass(frozen=True)
class ScaleRequest:
    id: str
    engines: int


def scale_request_path(log_dir: Path) -> Path:
    return Path(log_dir) / SCALE_REQUEST


def write_scale_request(log_dir: Path, engines: int) -> ScaleRequest:
    """Ask the fleet whose logs are in ``log_dir`` for ``engines`` engines; the request (its id is what
    the ready file's ``scaling.request`` answers)."""
    request = ScaleRequest(uuid.uuid4().hex, engines)
    write_json_atomically(scale_request_path(log_dir), {"id": request.id, "engines": request.engines})
    return request


def withdraw_scale_request(log_dir: Path, request: ScaleRequest) -> None:
    """Remove ``request`` where it is still the one waiting (not one written since)."""
    path = scale_request_path(log_dir)
    if read_scale_request(path) == request:
        path.unlink(missing_ok=True)


def read_scale_request(path: Path) -> ScaleRequest | None:
    """The request in ``path``; None when there is none, or it is not one (said by ``check_target``)."""
    try:
        content = json.loads(path.read_text())
        request = ScaleRequest(str(content["id"]), content["engines"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return request


def check_target(cfg: ServePairConfig, engines: object) -> int:
    """``engines`` as a fleet of ``cfg`` can be scaled to; a UserError saying why not otherwise."""
    if not cfg.is_fleet:
        raise UserError("only a fleet scales (serve-pair --engines N); a producer / consumer pair has two engines")
    if isinstance(engines, bool) or not isinstance(engines, int) or not 1 <= engines <= MAX_ENGINES:
        raise UserError(f"--engines {engines!r} is not an engine count; give 1 to {MAX_ENGINES}")
    if cfg.publishes_kv_events and engines != cfg.engines:
        raise UserError(
            "a fleet routed by kv_aware cannot scale: its router reads KV events from the engines it was started "
            "with; restart it with --engines N, or use another --router-policy"
        )
    return engines


def scaled_config(cfg: ServePairConfig, engines: int, free_port: Callable[[], int] = find_free_port) -> ServePairConfig:
    """The fleet of ``cfg`` with ``engines`` engines: the first ones keep their ports; with
    ``--engine-port`` the fleet was given a port each, so an engine added gets a free one."""
    ports = cfg.engine_ports[:engines]
    if cfg.engine_ports:
        ports += tuple(free_port() for _ in range(engines - len(ports)))
    return cfg.model_copy(update={"engines": engines, "engine_ports": ports})


def engine_name(index: int) -> str:
    return f"{FLEET_PREFIX}{index}"


Launch = Callable[[ProcessSet, ServePairConfig, str], ManagedProcess]


def start_engine(procs: ProcessSet, cfg: ServePairConfig, name: str) -> ManagedProcess:
    """Engine ``name`` of the fleet ``cfg`` started as serve-pair starts its engines (not waited for)."""
    return procs.start(
        name,
        engine_argv(cfg, name),
        env=engine_env(cfg, name),
        readiness=ReadinessCheck(http_url=cfg.base_url(name) + "/health"),
        cwd=REPO_ROOT,
    )


class FleetScaler:
    """Acts on a fleet's scale requests (``scale_request_path``) on a thread of its own."""

    def __init__(
        self,
        cfg: ServePairConfig,
        procs: ProcessSet,
        supervisor: Supervisor,
        members: FleetMembers,
        on_change: Callable[[], None],
        say: Reporter,
        drain_timeout_s: float = DRAIN_TIMEOUT_S,
        launch: Launch | None = None,
        memory: HostMemory | None = None,
    ) -> None:
        self.cfg = cfg  # the fleet now: swapped whole as engines are added and removed
        self.procs = procs
        self.supervisor = supervisor
        self.members = members
        self.on_change = on_change  # the ready file is rewritten
        self.say = say
        self.drain_timeout_s = drain_timeout_s
        self.launch = launch or start_engine
        self.memory = memory or HostMemory()
        self.request_path = scale_request_path(cfg.log_dir)
        self.state: ScaleState | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._release = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvtool-scaler", daemon=True)
        self.request_path.unlink(missing_ok=True)  # a request left by an earlier fleet in this directory

    def start(self) -> FleetScaler:
        self._thread.start()
        return self

    def stop(self) -> None:
        """No engine is started after this returns (one being added is stopped with the rest)."""
        with self._lock:
            self._stop.set()

    def release(self, timeout_s: float = 5.0) -> None:
        """Let the thread end (the processes it started were stopped)."""
        self._stop.set()
        self._release.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def _run(self) -> None:
        seen: str | None = None
        while not self._stop.wait(POLL_S):
            request = read_scale_request(self.request_path)
            if request is None or request.id == seen:
                continue
            seen = request.id
            self.scale(request)
        self._release.wait()

    def scale(self, request: ScaleRequest) -> ScaleState:
        """Add or remove engines until the fleet has ``request.engines``; the outcome, also in the ready file."""
        try:
            target = check_target(self.cfg, request.engines)
            self._report(request, "working", f"scaling from {self.cfg.engines} to {target} engines")
            while self.cfg.engines < target and not self._stop.is_set():
                self._add(engine_name(self.cfg.engines))
            while self.cfg.engines > target and not self._stop.is_set():
                self._remove(engine_name(self.cfg.engines - 1))
            if self._stop.is_set():
                return self._report(request, "failed", "the fleet stopped while scaling")
            serving = len(self.members.serving())
            return self._report(request, "done", f"{self.cfg.engines} engines, {serving} in the router's rotation")
        except UserError as exc:
            return self._report(request, "failed", exc.message)

    def _report(self, request: ScaleRequest, state: ScalePhase, message: str) -> ScaleState:
        self.state = ScaleState(request=request.id, target=request.engines, state=state, message=message)
        self.say(f"scale: {message}" if state != "failed" else f"scale failed: {message}")
        self.on_change()
        return self.state

    def _add(self, name: str) -> None:
        """Start engine ``name``, wait until healthy, warm it, put it in the rotation, supervise it."""
        grown = scaled_config(self.cfg, self.cfg.engines + 1)
        port = grown.port(name)
        ensure_port_free(port, f"the port of {name} (--producer-port + {name.removeprefix(FLEET_PREFIX)})")
        engines = [(proc.name, proc.pid) for proc in self.procs.processes if proc.name.startswith(FLEET_PREFIX)]
        kv_cache = int(grown.kv_cache_gib * GIB)
        check_room(name, largest_engine(self.memory, engines), self.memory.available(), kv_cache)
        self.members.expect(name)  # out of the rotation, and of the ready file, until admitted
        self.cfg = self.members.cfg = grown
        with self._lock:
            if self._stop.is_set():
                return
            proc = self.launch(self.procs, grown, name)
        self.say(f"scale: starting {name} on {grown.base_url(name)} (pid {proc.pid}; log {proc.log_path})")
        try:
            self._wait_healthy(proc, RESTART_GRACE_FACTOR * grown.startup_timeout_s)
        except UserError:
            self._let_go(name)
            raise
        if grown.restart_engines:
            note = "warming it up before it rejoins the router's rotation"
            self.supervisor.supervise(name, name, engine_policy(grown), note)
        if not self.members.admit(name, wanted=lambda: not self._stop.is_set()):
            self.supervisor.forget(name)
            self._let_go(name)  # an engine no request reaches is no engine of the fleet
            raise UserError(f"{name} started but could not join the router's rotation, and was stopped")

    def _wait_healthy(self, proc: ManagedProcess, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not proc.readiness.passes():
            if proc.exit_code() is not None:
                raise UserError(f"{proc.name} {proc.how_it_ended()} before it was healthy; see {proc.log_path}")
            if self._stop.is_set():
                raise UserError("the fleet stopped while an engine was starting")
            if time.monotonic() > deadline:
                raise UserError(
                    f"{proc.name} was not healthy after {timeout_s:.0f} s; see {proc.log_path}",
                    details=log_tail(proc.log_path),
                )
            time.sleep(POLL_S)

    def _remove(self, name: str) -> None:
        """Take engine ``name`` out of the rotation, let it finish what it holds, stop it."""
        self.supervisor.forget(name)  # no restart of an engine stopped on purpose
        self.members.leave(name)
        url = self.cfg.base_url(name)
        left = drain(url, self.drain_timeout_s, self._stop)
        if left:
            self.say(f"scale: {name} still held {left:g} request(s) after {self.drain_timeout_s:g} s; stopping it")
        self._let_go(name)
        self.say(f"scale: {name} stopped")

    def _let_go(self, name: str) -> None:
        """Stop ``name`` (where it runs) and shrink the fleet to the engines before it."""
        if any(proc.name == name for proc in self.procs.processes):
            self.procs.stop_one(name)
        self.cfg = self.members.cfg = scaled_config(self.cfg, int(name.removeprefix(FLEET_PREFIX)))
        self.members.forget(name)
        self.on_change()


def drain(url: str, timeout_s: float, stop: threading.Event) -> float:
    """Wait until the engine at ``url`` runs and queues no request (vLLM's gauges), at most ``timeout_s``;
    the requests it still held (0 when drained, or when it no longer answers)."""
    deadline = time.monotonic() + timeout_s
    while True:
        held = requests_held(url)
        if not held or time.monotonic() > deadline or stop.is_set():
            return held
        time.sleep(POLL_S)


def requests_held(url: str) -> float:
    """Requests running and waiting on the engine at ``url``; 0 when it does not answer."""
    try:
        text = web.get(f"{url}/metrics", timeout=5.0).text
    except httpx.HTTPError:
        return 0.0
    names = ("vllm:num_requests_running", "vllm:num_requests_waiting")
    return sum(prometheus.total(text, name) or 0.0 for name in names)
