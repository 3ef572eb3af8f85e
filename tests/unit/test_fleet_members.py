"""A fleet's engines leaving and rejoining the router's rotation (kvtool.pair.members): the router and
the warm-up scripted, the supervisor's news given as it gives it; and the supervisor telling of an
engine's death and recovery on a real (cheap) process."""

from __future__ import annotations

import threading
from pathlib import Path


from kvtool.pair.members import FleetMembers, engine_policy, fleet_members
from kvtool.pair.ready import ready_info
from kvtool.pair.supervise import Supervisor

from .test_fleet import fleet
from .test_supervise import ScriptedCheck


class ScriptedRouter:
    """The router's worker list, each call recorded; ``answers`` False: it does not answer."""

    def __init__(self, urls: set[str]) -> None:
        self.workers = set(urls)
        self.calls: list[tuple[str, str]] = []
        self.answers = True

    def add(self, url: str) -> bool:
        self.calls.append(("add", url))
        if self.answers:
            self.workers.add(url)
        return self.answers

    def remove(self, url: str) -> bool:
        self.calls.append(("remove", url))
        if self.answers:
            self.workers.discard(url)
        return self.answers

    def urls(self) -> set[str] | None:
        return set(self.workers) if self.answers else None


class GatedWarm:
    """A warm-up that waits until the test lets it end; what it was asked is kept."""

    def __init__(self) -> None:
        self.asked: list[tuple[str, list[str]]] = []
        self.go = threading.Event()

    def __call__(self, cfg, engine, serving, say):
        self.asked.append((engine, list(serving)))
        assert self.go.wait(10)
        return set()


def members_of(tmp_path: Path):
    cfg = fleet(tmp_path)
    router = ScriptedRouter({cfg.base_url(name) for name in cfg.engine_names})
    warm, said, changes = GatedWarm(), [], []
    members = FleetMembers(cfg, router, said.append, lambda: changes.append(1), warm=warm)  # type: ignore[arg-type]
    return cfg, members, router, warm, said, changes


def test_an_engine_down_leaves_the_rotation_at_once_and_rejoins_only_once_warm(tmp_path):
    cfg, members, router, warm, said, changes = members_of(tmp_path)
    url = cfg.base_url("engine-1")
    members.on_supervisor("engine-1", "down")
    assert router.calls == [("remove", url)] and url not in router.workers
    assert members.out == {"engine-1"} and members.serving() == ["engine-0", "engine-2"]
    assert "engine-1 is out of the rotation (the router took it out); 2 engine(s) serve on" in said
    assert changes  # the ready file is rewritten
    info = ready_info(cfg, {name: 1 for name in cfg.engine_names}, None, out_of_rotation=members.out)
    assert set(info.engines) == {"engine-0", "engine-2"}

    members.on_supervisor("engine-1", "recovered")  # healthy again: warmed up first, in the router after
    assert _eventually(lambda: warm.asked == [("engine-1", ["engine-0", "engine-2"])])
    assert url not in router.workers and members.out == {"engine-1"}
    warm.go.set()
    members.join_threads()
    assert router.calls[-1] == ("add", url) and url in router.workers
    assert members.out == frozenset() and said[-1] == "engine-1 is in the rotation: 3 engine(s) serve"
    assert [(event.engine, event.change) for event in members.events] == [("engine-1", "out"), ("engine-1", "in")]
    assert members.events[0].at <= members.events[1].at


def test_an_engine_that_goes_down_again_while_warming_is_not_put_back(tmp_path):
    cfg, members, router, warm, said, _changes = members_of(tmp_path)
    members.on_supervisor("engine-0", "down")
    members.on_supervisor("engine-0", "recovered")
    assert _eventually(lambda: warm.asked)
    members.on_supervisor("engine-0", "down")  # it died again during its warm-up
    warm.go.set()
    members.join_threads()
    assert ("add", cfg.base_url("engine-0")) not in router.calls
    assert members.out == {"engine-0"}


def test_a_router_that_does_not_answer_is_said_and_the_engine_stays_out(tmp_path):
    cfg, members, router, warm, said, _changes = members_of(tmp_path)
    router.answers = False
    members.on_supervisor("engine-2", "down")
    assert "the router did not answer; its health checks take it out" in said[-1]
    warm.go.set()
    members.on_supervisor("engine-2", "recovered")
    members.join_threads()
    assert members.out == {"engine-2"} and "could not be put in the router" in said[-1]


def test_news_of_the_master_or_the_router_changes_no_membership(tmp_path):
    _cfg, members, router, _warm, _said, changes = members_of(tmp_path)
    members.on_supervisor("master", "down")
    members.on_supervisor("router", "recovered")
    assert router.calls == [] and members.out == frozenset() and changes == []


def test_an_engine_is_given_its_start_up_time_and_a_minute_of_failed_checks(tmp_path):
    policy = engine_policy(fleet(tmp_path))
    assert policy.startup_grace_s == 4 * 300.0  # a restart under load: four --startup-timeouts
    assert policy.unhealthy_after_s >= 60 and policy.min_failed_checks >= 20  # a busy engine is not hung
    assert policy.backoff.delay(1) == 2.0 and policy.backoff.delay(10) == 60.0


def test_the_supervisor_tells_the_members_of_an_engines_death_and_recovery(processes, tmp_path, monkeypatch):
    cfg = fleet(tmp_path)
    checks = {name: ScriptedCheck() for name in cfg.engine_names}
    for name in cfg.engine_names:
        processes.start(name, ["sleep", "60"], readiness=checks[name])  # type: ignore[arg-type]
    clock = [100.0]
    said: list[str] = []
    supervisor = Supervisor(processes, {}, said.append, clock=lambda: clock[0])
    router = ScriptedRouter({cfg.base_url(name) for name in cfg.engine_names})
    monkeypatch.setattr("kvtool.pair.members.RouterWorkers", lambda url: router)
    monkeypatch.setattr("kvtool.pair.members.warm_engine", lambda cfg, engine, serving, say: set())
    members = fleet_members(cfg, supervisor, lambda: None)
    supervisor.tick()
    assert processes.first_dead() is None and members.out == frozenset()

    old = processes.get("engine-1")
    old.popen.kill()
    old.popen.wait(timeout=10)
    supervisor.tick()
    assert members.out == {"engine-1"} and ("remove", cfg.base_url("engine-1")) in router.calls
    assert processes.first_dead() is None  # supervised: the fleet does not stop
    clock[0] += 2.0  # the engine's back-off
    supervisor.tick()
    new = processes.get("engine-1")
    assert new.pid != old.pid and supervisor.restarts()["engine-1"] == 1
    supervisor.tick()  # its first passed health check after the restart
    members.join_threads()
    assert members.out == frozenset() and router.calls[-1] == ("add", cfg.base_url("engine-1"))
    assert any("engine-1 (pid" in line and "warming it up before it rejoins" in line for line in said)


def _eventually(condition, timeout_s: float = 10.0) -> bool:
    done = threading.Event()
    for _ in range(int(timeout_s / 0.01)):
        if condition():
            return True
        done.wait(0.01)
    return False


def test_a_router_started_again_is_given_the_engines_serving(tmp_path):
    cfg, members, router, warm, said, changes = members_of(tmp_path)
    members.on_supervisor("engine-1", "down")  # out of the rotation
    added = "http://127.0.0.1:9999"  # what the restarted router lists that serves no more
    router.workers = {cfg.base_url(name) for name in cfg.engine_names} | {added}  # its start-up list, and more
    router.calls.clear()
    members.on_supervisor("router", "recovered")
    members.join_threads()
    assert router.workers == {cfg.base_url("engine-0"), cfg.base_url("engine-2")}
    assert sorted(router.calls) == [("remove", cfg.base_url("engine-1")), ("remove", added)]
    assert "the router's rotation set to the 2 engine(s) serving (+0, -2)" in said
    router.answers = False
    assert members.resync() is False and "did not list its workers" in said[-1]
