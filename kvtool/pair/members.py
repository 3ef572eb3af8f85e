"""A fleet's engines leaving and joining the router's rotation while the fleet serves.

An engine that ends (a crash, an OOM kill, an operator's ``kill``) or hangs is taken out of the
router's rotation at once (``/remove_worker``: the router's own health checks would take a few
seconds, each a request it may still send there), and the supervisor (``kvtool.pair.supervise``) starts
it again on its own port after a back-off. The engine that comes back is a new Mooncake client: its
first transfers with the store's segments can stall (README, known issues), so it rejoins only after
its warm-up (``kvtool.pair.warmup.warm_engine``) went through with the engines serving, and then
``/add_worker`` puts it back. The ready file lists the engines in the rotation only, and ``events``
keeps when each left and joined (``kvtool bench --load --kill-engine-after`` reports TTFT by phase).
An engine added or taken away on request (``kvtool.pair.scale``) joins and leaves through ``admit`` and
``leave`` the same way. A router the supervisor started again has the worker list it was first given:
``resync`` sets it to the engines serving.

Thread rules: ``on_supervisor`` runs on the supervisor's thread; each rejoin's warm-up on a thread of
its own (it starts no process, so it may end before the engine does); ``_lock`` guards ``out`` and
``events``, which the ready file's writer and the caller read from theirs.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvtool.pair.config import Reporter, ServePairConfig
from kvtool.pair.router import ROUTER_PROCESS, RouterWorkers
from kvtool.pair.supervise import Action, Backoff, Policy, Supervisor
from kvtool.pair.warmup import warm_engine

Warm = Callable[[ServePairConfig, str, Sequence[str], Reporter], set[tuple[str, str]]]


RESTART_GRACE_FACTOR = 4  # a restart's start-up time, in --startup-timeouts


def engine_policy(cfg: ServePairConfig) -> Policy:
    """How the supervisor treats a fleet's engine: started again 2 s after it ends, up to a minute
    apart when it keeps ending; given four times its start-up time (``--startup-timeout``) to pass its
    first health check again (a restart competes for the cores with the engines serving: on this
    2-core machine one took over 300 s where the quiet start took 90, and killing a start that is
    under way only starts it over); taken for hung only after a minute of failed checks (a CPU engine
    in a long prefill answers ``/health`` late, and killing a busy engine loses every request on it)."""
    return Policy(
        backoff=Backoff(initial_s=2.0, factor=2.0, max_s=60.0),
        unhealthy_after_s=60.0,
        min_failed_checks=20,
        startup_grace_s=RESTART_GRACE_FACTOR * cfg.startup_timeout_s,
        healthy_reset_s=120.0,
    )


@dataclass(frozen=True)
class MemberEvent:
    at: float  # time.monotonic()
    engine: str
    change: str  # "out": taken out of the rotation; "in": back in it, warm


class FleetMembers:
    """Which engines the router sends requests to, kept in step with the supervisor's restarts."""

    def __init__(
        self,
        cfg: ServePairConfig,
        router: RouterWorkers,
        say: Reporter,
        on_change: Callable[[], None],
        warm: Warm | None = None,
    ) -> None:
        self.cfg = cfg
        self.router = router
        self.say = say
        self.on_change = on_change  # the ready file is rewritten
        self.warm = warm if warm is not None else warm_engine
        self._lock = threading.Lock()
        self._out: set[str] = set()
        self._downs: dict[str, int] = {}  # engine -> times it went down: a rejoin outrun by another down stops
        self._events: list[MemberEvent] = []
        self._threads: list[threading.Thread] = []

    @property
    def out(self) -> frozenset[str]:
        with self._lock:
            return frozenset(self._out)

    @property
    def events(self) -> list[MemberEvent]:
        with self._lock:
            return list(self._events)

    def serving(self) -> list[str]:
        out = self.out
        return [name for name in self.cfg.engine_names if name not in out]

    def on_supervisor(self, name: str, action: Action) -> None:
        """The supervisor's news of one of its processes; an engine's changes its membership, and a
        router started again is given the engines serving (it starts with the list it was first given)."""
        if name == ROUTER_PROCESS and action == "recovered":
            self._start_thread(self.resync, name)
            return
        if name not in self.cfg.engine_names:
            return
        if action == "down":
            self._take_out(name)
        elif action == "recovered":
            self._start_thread(lambda: self.admit(name), name)

    def _start_thread(self, target: Callable[[], object], name: str) -> None:
        thread = threading.Thread(target=target, name=f"kvtool-members-{name}", daemon=True)
        self._threads.append(thread)
        thread.start()

    def resync(self) -> bool:
        """The router's worker list set to the engines serving (after the router was started again with
        its start-up list: engines added since were not in it, engines taken away were); whether it answered."""
        listed = self.router.urls()
        if listed is None:
            self.say("the router did not list its workers; its health checks keep its rotation")
            return False
        wanted = {self.cfg.base_url(name) for name in self.serving()}
        added = [url for url in sorted(wanted - listed) if self.router.add(url)]
        removed = [url for url in sorted(listed - wanted) if self.router.remove(url)]
        if added or removed:
            self.say(
                f"the router's rotation set to the {len(wanted)} engine(s) serving (+{len(added)}, -{len(removed)})"
            )
        return True

    def _take_out(self, name: str) -> None:
        with self._lock:
            self._downs[name] = self._downs.get(name, 0) + 1
            if name in self._out:
                return
            self._out.add(name)
            self._events.append(MemberEvent(time.monotonic(), name, "out"))
        removed = self.router.remove(self.cfg.base_url(name))
        how = "the router took it out" if removed else "the router did not answer; its health checks take it out"
        self.say(f"{name} is out of the rotation ({how}); {len(self.serving())} engine(s) serve on")
        self.on_change()

    def expect(self, name: str) -> None:
        """An engine being added to the fleet (``kvtool.pair.scale``): out of the rotation until ``admit``."""
        with self._lock:
            self._out.add(name)

    def leave(self, name: str) -> None:
        """An engine being scaled in: out of the rotation now (it may finish what it holds)."""
        self._take_out(name)

    def forget(self, name: str) -> None:
        """An engine no longer in the fleet: nothing of it is kept but its events."""
        with self._lock:
            self._out.discard(name)
            self._downs.pop(name, None)

    def admit(self, name: str, wanted: Callable[[], bool] = lambda: True) -> bool:
        """Warm ``name`` up with the engines serving, then put it in the router's rotation; whether it
        joined (not when it went down again while warming, ``wanted`` said no, or the router did not
        answer)."""
        with self._lock:
            downs = self._downs.get(name, 0)
        others = [other for other in self.serving() if other != name]
        try:
            cold = self.warm(self.cfg, name, others, self.say)
        except Exception as exc:  # noqa: BLE001 (a warm-up is a courtesy: its loads fail closed anyway)
            self.say(f"{name}'s warm-up failed ({exc}); it rejoins cold: a stalled load is a miss")
            cold = set()
        if cold:
            self.say(f"{name} rejoins with {len(cold)} path(s) still cold: such a load fails closed (a miss)")
        with self._lock:
            if self._downs.get(name, 0) != downs or not wanted() or name not in self.cfg.engine_names:
                return False  # it went down again while warming (the next recovery rejoins it), or was scaled in
        if not self.router.add(self.cfg.base_url(name)):
            self.say(f"{name} could not be put in the router's rotation (it did not answer); it stays out")
            return False
        with self._lock:
            self._out.discard(name)
            self._events.append(MemberEvent(time.monotonic(), name, "in"))
        self.say(f"{name} is in the rotation: {len(self.serving())} engine(s) serve")
        self.on_change()
        return True

    def join_threads(self, timeout_s: float = 5.0) -> None:
        for thread in self._threads:
            thread.join(timeout_s)


def fleet_members(cfg: ServePairConfig, supervisor: Supervisor, on_change: Callable[[], None]) -> FleetMembers:
    """A serving fleet's membership, for the ready file and for scaling (``kvtool.pair.scale``); with
    ``restart_engines`` every engine is supervised too (``supervise_engines``)."""
    assert cfg.router_url is not None
    members = FleetMembers(cfg, RouterWorkers(cfg.router_url), supervisor.report, on_change)  # said and logged
    supervisor.on_event = members.on_supervisor  # the router's restarts too
    if cfg.restart_engines:
        supervise_engines(cfg, supervisor, members)
    return members


def supervise_engines(cfg: ServePairConfig, supervisor: Supervisor, members: FleetMembers) -> None:
    """Every engine of a serving fleet supervised (started again when it ends or hangs), out of the
    router's rotation while down, back in once warm."""
    supervisor.on_event = members.on_supervisor
    for name in cfg.engine_names:
        supervisor.supervise(name, name, engine_policy(cfg), "warming it up before it rejoins the router's rotation")
