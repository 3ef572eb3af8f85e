"""Scaling a serving fleet (kvtool.pair.scale): the pure rules (ports, targets, requests), and the
scaler on real cheap processes (``sleep`` stands in for an engine), with the router scripted."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest

from kvtool.errors import UserError
from kvtool.pair.members import FleetMembers
from kvtool.pair.ready import ready_info
from kvtool.pair.scale import (
    FleetScaler,
    ScaleRequest,
    check_target,
    read_scale_request,
    scale_request_path,
    scaled_config,
    write_scale_request,
)
from kvtool.pair.supervise import Supervisor
from kvtool.procs import find_free_port

from .test_fleet import fleet
from .test_fleet_members import ScriptedRouter
from .test_serve_pair import make_config
from .test_supervise import ScriptedCheck


def test_engines_added_keep_the_port_rule_and_the_first_engines_keep_theirs(tmp_path):
    cfg = fleet(tmp_path)  # engine i on --producer-port 8100 + i
    grown = scaled_config(cfg, 5)
    assert grown.engine_names[-2:] == ("engine-3", "engine-4") and grown.port("engine-4") == 8104
    assert scaled_config(grown, 2).engine_names == ("engine-0", "engine-1")
    given = fleet(tmp_path, engine_ports=(9001, 9005, 9003))  # --engine-port each: an added one gets a free port
    free = iter([9100, 9101])
    grown = scaled_config(given, 5, free_port=lambda: next(free))
    assert grown.engine_ports == (9001, 9005, 9003, 9100, 9101)
    assert scaled_config(grown, 2).engine_ports == (9001, 9005)


@pytest.mark.parametrize("engines", [0, -1, 65, True, "3", 2.5, None])
def test_a_target_that_is_no_engine_count_is_named(tmp_path, engines):
    with pytest.raises(UserError, match="is not an engine count; give 1 to 64"):
        check_target(fleet(tmp_path), engines)


def test_only_a_fleet_scales_and_a_kv_aware_one_keeps_its_engines(tmp_path):
    with pytest.raises(UserError, match="only a fleet scales"):
        check_target(make_config(tmp_path), 3)
    routed = fleet(tmp_path, router_policy="kv_aware")
    assert check_target(routed, 3) == 3  # what it has: nothing to do
    with pytest.raises(UserError, match="kv_aware cannot scale"):
        check_target(routed, 4)
    assert check_target(fleet(tmp_path), 1) == 1  # one engine behind the router still serves


def test_a_request_is_read_back_and_anything_else_is_none(tmp_path):
    request = write_scale_request(tmp_path, 4)
    assert read_scale_request(scale_request_path(tmp_path)) == request
    assert read_scale_request(tmp_path / "absent.json") is None
    scale_request_path(tmp_path).write_text("{not json")
    assert read_scale_request(scale_request_path(tmp_path)) is None


class Fleet:
    """Two "engines" (``sleep``) supervised, members with a scripted router and warm-up, and a scaler
    whose engines are ``sleep`` too (``command`` decides: ``false`` is an engine that dies at start)."""

    def __init__(self, processes, tmp_path: Path, **overrides) -> None:
        self.cfg = fleet(tmp_path, engines=2, **overrides)
        self.procs = processes
        self.command = ["sleep", "60"]
        for name in self.cfg.engine_names:
            processes.start(name, ["sleep", "60"], readiness=ScriptedCheck())  # type: ignore[arg-type]
        self.said: list[str] = []
        self.changes: list[int] = []
        self.supervisor = Supervisor(processes, {}, self.said.append)
        self.router = ScriptedRouter({self.cfg.base_url(name) for name in self.cfg.engine_names})
        self.warmed: list[str] = []
        self.members = FleetMembers(
            self.cfg, self.router, self.said.append, lambda: self.changes.append(1), warm=self._warm
        )  # type: ignore[arg-type]
        for name in self.cfg.engine_names:
            self.supervisor.supervise(name, name)
        self.scaler = FleetScaler(
            self.cfg,
            processes,
            self.supervisor,
            self.members,
            lambda: self.changes.append(1),
            self.said.append,
            drain_timeout_s=1.0,
            launch=self._launch,
        )

    def _warm(self, cfg, engine, serving, say):
        self.warmed.append(engine)
        return set()

    def _launch(self, procs, cfg, name):
        check = ScriptedCheck()
        check.healthy = self.command[0] != "false"  # a dead engine answers no health check
        return procs.start(name, self.command, readiness=check)  # type: ignore[arg-type]

    def ready(self):
        return ready_info(self.scaler.cfg, self.procs.pids(), None, out_of_rotation=self.members.out)


def test_an_engine_added_joins_warm_and_one_taken_away_leaves_the_rotation_and_stops(processes, tmp_path):
    fleet_ = Fleet(processes, tmp_path)
    state = fleet_.scaler.scale(ScaleRequest("a", 3))
    assert (state.state, state.request, state.target) == ("done", "a", 3), state
    url = fleet_.scaler.cfg.base_url("engine-2")
    assert fleet_.warmed == ["engine-2"] and fleet_.router.calls[-1] == ("add", url)
    assert set(fleet_.ready().engines) == {"engine-0", "engine-1", "engine-2"}
    assert "engine-2" in fleet_.supervisor.labels  # restarted like the others if it ends
    assert fleet_.scaler.state == state and fleet_.changes

    added = processes.get("engine-2")
    state = fleet_.scaler.scale(ScaleRequest("b", 1))
    assert state.state == "done" and state.message == "1 engines, 1 in the router's rotation"
    assert fleet_.router.calls[-2:] == [("remove", url), ("remove", fleet_.cfg.base_url("engine-1"))]
    assert [proc.name for proc in processes.processes] == ["engine-0"]
    assert added.exit_code() is not None  # stopped by its pid
    assert set(fleet_.supervisor.labels) == {"engine-0"}  # none of them is started again
    assert set(fleet_.ready().engines) == {"engine-0"} and fleet_.members.out == frozenset()


def test_an_engine_that_dies_at_start_fails_the_request_and_leaves_the_fleet_as_it_was(processes, tmp_path):
    fleet_ = Fleet(processes, tmp_path)
    fleet_.command = ["false"]
    state = fleet_.scaler.scale(ScaleRequest("a", 3))
    assert state.state == "failed" and state.message.startswith("engine-2 exited with code 1 before it was healthy")
    assert fleet_.scaler.cfg.engines == 2 and [p.name for p in processes.processes] == ["engine-0", "engine-1"]
    assert (
        fleet_.members.out == frozenset() and ("add", fleet_.scaler.cfg.base_url("engine-1")) not in fleet_.router.calls
    )
    assert set(fleet_.ready().engines) == {"engine-0", "engine-1"}


def test_an_engine_the_router_does_not_take_is_stopped_and_the_fleet_stays_as_it_was(processes, tmp_path):
    fleet_ = Fleet(processes, tmp_path)
    fleet_.router.answers = False  # /add_worker unanswered
    state = fleet_.scaler.scale(ScaleRequest("a", 3))
    assert state.state == "failed" and "could not join the router's rotation, and was stopped" in state.message
    assert [p.name for p in processes.processes] == ["engine-0", "engine-1"] and fleet_.scaler.cfg.engines == 2
    assert "engine-2" not in fleet_.supervisor.labels and fleet_.members.out == frozenset()


def test_a_rejoin_under_way_when_its_engine_is_scaled_in_does_not_put_it_back(tmp_path):
    cfg = fleet(tmp_path)
    router = ScriptedRouter({cfg.base_url(name) for name in cfg.engine_names})
    members = FleetMembers(cfg, router, lambda _: None, lambda: None, warm=lambda *args: set())  # type: ignore[arg-type]
    members.on_supervisor("engine-2", "down")
    members.cfg = scaled_config(cfg, 2)  # scaled in while it was down
    assert members.admit("engine-2") is False and router.calls == [("remove", cfg.base_url("engine-2"))]


def test_an_added_engines_port_in_use_is_named_and_nothing_starts(processes, tmp_path):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        fleet_ = Fleet(processes, tmp_path, producer_port=port - 2)  # engine-2 would listen on it
        state = fleet_.scaler.scale(ScaleRequest("a", 3))
    assert state.state == "failed" and f"port {port} is already in use" in state.message, state
    assert "the port of engine-2" in state.message
    assert fleet_.scaler.cfg.engines == 2 and len(processes.processes) == 2


def test_the_scaler_acts_on_a_request_written_into_the_fleets_log_directory(processes, tmp_path):
    fleet_ = Fleet(processes, tmp_path, engine_ports=(find_free_port(), find_free_port()))
    fleet_.scaler.start()
    try:
        request = write_scale_request(fleet_.cfg.log_dir, 3)
        deadline = time.monotonic() + 20
        while (fleet_.scaler.state is None or fleet_.scaler.state.state == "working") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert fleet_.scaler.state is not None and fleet_.scaler.state.request == request.id
        assert fleet_.scaler.state.state == "done" and fleet_.scaler.cfg.engines == 3
        assert len(fleet_.scaler.cfg.engine_ports) == 3  # a free port for the one added
    finally:
        fleet_.scaler.stop()
        processes.stop_all(grace_s=1)
        fleet_.scaler.release()


def test_a_forgotten_process_is_not_started_again(processes, tmp_path):
    proc = processes.start("engine-0", ["sleep", "60"], readiness=ScriptedCheck())  # type: ignore[arg-type]
    supervisor = Supervisor(processes, {"engine-0": "engine-0"}, lambda _: None)
    supervisor.forget("engine-0")
    proc.popen.kill()
    proc.popen.wait(timeout=10)
    supervisor.tick()
    assert processes.get("engine-0") is proc and supervisor.restarts() == {}
    assert processes.first_dead() is proc  # no longer someone else's to restart


def _fleet_ready_file(tmp_path: Path, router: str | None = "http://127.0.0.1:8000") -> Path:
    from kvtool.files import write_json_atomically

    from .test_load_churn import _ready

    engines = {"engine-0": "http://127.0.0.1:8100", "engine-1": "http://127.0.0.1:8101"}
    info = _ready(engines if router else {}, router=router).model_copy(update={"log_dir": str(tmp_path)})
    path = tmp_path / "ready.json"
    write_json_atomically(path, info.to_json())
    return path


def _scale_cli(*args: str):
    from typer.testing import CliRunner

    from kvtool.cli import app

    return CliRunner().invoke(app, ["scale", *args])


def test_kvtool_scale_waits_for_the_fleets_outcome_and_prints_the_engines_serving(tmp_path):
    import json
    import threading

    from kvtool.files import write_json_atomically
    from kvtool.pair.ready import ScaleState, read_ready_file

    ready = _fleet_ready_file(tmp_path)

    def fleet_answers() -> None:  # what the fleet's scaler does: read the request, write the outcome
        deadline = time.monotonic() + 20
        while (request := read_scale_request(scale_request_path(tmp_path))) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert request is not None and request.engines == 3
        info = read_ready_file(ready)
        engines = {**info.engines, "engine-2": "http://127.0.0.1:8102"}
        state = ScaleState(request=request.id, target=3, state="done", message="3 engines, 3 in the router's rotation")
        write_json_atomically(ready, info.model_copy(update={"engines": engines, "scaling": state}).to_json())

    thread = threading.Thread(target=fleet_answers)
    thread.start()
    result = _scale_cli("--pair", str(ready), "--engines", "3", "--format", "json")
    thread.join()
    assert result.exit_code == 0, result.output
    document = json.loads(result.stdout)
    assert document["state"] == "done" and [row["engine"] for row in document["serving"]] == [
        "engine-0",
        "engine-1",
        "engine-2",
    ]


def test_kvtool_scale_says_in_one_sentence_what_it_cannot_do(tmp_path, monkeypatch):
    pair = _fleet_ready_file(tmp_path, router=None)
    result = _scale_cli("--pair", str(pair), "--engines", "3")
    assert result.exit_code == 2 and "only a fleet scales" in result.output and "Traceback" not in result.output
    monkeypatch.setattr("kvtool.commands.scale.PICKUP_S", 0.3)
    ready = _fleet_ready_file(tmp_path)  # no fleet reads its requests
    result = _scale_cli("--pair", str(ready), "--engines", "3")
    assert result.exit_code == 1 and "did not take the request within 0.3 s" in result.output
    assert not scale_request_path(tmp_path).exists()  # withdrawn: nothing acts on it later
    result = _scale_cli("--pair", str(tmp_path / "absent.json"), "--engines", "3")
    assert result.exit_code == 2 and "cannot read the ready file" in result.output
