"""The supervisor around a real mooncake_master: SIGKILLed, it comes back healthy on the same ports
with a new pid; frozen (SIGSTOP), it is killed and replaced. And serve-pair's own loop (run_pair)
with stand-in engines: it rewrites the ready file with the new master's pid, and an engine's death
still stops everything."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

from kvtool.pair.launch import run_pair
from kvtool.procs import ProcessDied, ProcessSet, ReadinessCheck, find_free_port, http_ok, tcp_port_open
from kvtool.pair.config import ServePairConfig
from kvtool.pair.ready import ReadyFile
from kvtool.store.mooncake import find_binary, master_argv, mooncake_env
from kvtool.pair.supervise import Backoff, Policy, Supervisor, Watch

pytestmark = pytest.mark.integration

# Quicker than serve-pair's defaults, so the test takes seconds; the decisions are the same.
POLICY = Policy(
    backoff=Backoff(0.2, 2.0, 2.0),
    unhealthy_after_s=1.5,
    min_failed_checks=2,
    startup_grace_s=20.0,
    healthy_reset_s=30.0,
    interval_s=0.2,
)
WAIT_S = 60.0


def is_running_master(pid: int) -> bool:
    try:
        return b"mooncake_master" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def test_a_killed_or_frozen_master_comes_back_on_the_same_ports(tmp_path):
    rpc_port, admin_port = find_free_port(), find_free_port()
    cfg = ServePairConfig(model=tmp_path, log_dir=tmp_path / "logs", master_port=rpc_port, admin_port=admin_port)
    health = f"http://127.0.0.1:{admin_port}/health"
    procs = ProcessSet(cfg.log_dir)
    messages: list[str] = []
    restarted: list[int] = []
    changed = threading.Condition()

    def on_restart(_name: str, pid: int) -> None:
        with changed:
            restarted.append(pid)
            changed.notify_all()

    def wait_for_restart(count: int) -> int:
        """The pid of the count-th restart, once it answers its health check and the supervisor saw it."""
        with changed:
            assert changed.wait_for(lambda: len(restarted) >= count, WAIT_S), messages
        recovered = f"passes its health check again after restart {count}"
        deadline = time.monotonic() + WAIT_S
        while not (http_ok(health, timeout=1.0) and any(recovered in m for m in messages)):
            assert time.monotonic() < deadline, f"the restarted master never became healthy: {messages}"
            time.sleep(0.1)
        return restarted[count - 1]

    seen: list[int] = []
    watch = None
    try:
        master = procs.start(
            "master",
            master_argv(cfg.master_port, cfg.admin_port, find_binary("mooncake_master")),
            env=mooncake_env(),
            readiness=ReadinessCheck(http_url=health),
        )
        seen.append(master.pid)
        procs.wait_ready([master], timeout_s=30)
        supervisor = Supervisor(
            procs, {"master": "mooncake_master"}, messages.append, POLICY, event_log=cfg.log_dir / "supervisor.log"
        )
        supervisor.on_restart = on_restart
        watch = Watch(supervisor).start()

        os.kill(master.pid, signal.SIGKILL)
        second = wait_for_restart(1)
        seen.append(second)
        assert second != master.pid and not is_running_master(master.pid)
        assert tcp_port_open(rpc_port) and procs.get("master").pid == second
        assert any("was killed by SIGKILL" in m for m in messages), messages

        os.kill(second, signal.SIGSTOP)  # frozen: its ports stay open, nothing answers
        third = wait_for_restart(2)
        seen.append(third)
        assert third != second and not is_running_master(second)
        assert tcp_port_open(rpc_port) and procs.get("master").pid == third
        assert any("failed its health check" in m and "killed it (SIGKILL)" in m for m in messages), messages
        assert supervisor.restarts() == {"master": 2}
        assert "started mooncake_master again" in (cfg.log_dir / "supervisor.log").read_text()
    finally:
        if watch is not None:
            watch.stop()
        procs.stop_all(grace_s=5)
        if watch is not None:
            watch.release()
        for pid in seen:  # whatever the supervisor did not get to
            if is_running_master(pid):
                os.kill(pid, signal.SIGKILL)


def test_serve_pair_restarts_its_master_and_still_stops_when_an_engine_dies(tmp_path, monkeypatch):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    web = tmp_path / "web"
    web.mkdir()
    (web / "health").write_text("ok")  # a stand-in engine: GET /health answers 200

    def stand_in_engine(cfg, role, python=sys.executable):
        return [python, "-m", "http.server", str(cfg.port(role)), "--bind", "127.0.0.1", "--directory", str(web)]

    monkeypatch.setattr("kvtool.pair.launch.engine_argv", stand_in_engine)
    ready_file = tmp_path / "ready.json"
    ports = [find_free_port() for _ in range(4)]
    cfg = ServePairConfig(
        model=model,
        log_dir=tmp_path / "logs",
        ready_file=ready_file,
        producer_port=ports[0],
        consumer_port=ports[1],
        master_port=ports[2],
        admin_port=ports[3],
    )
    messages: list[str] = []
    seen: dict[str, object] = {}

    def kill_master_then_producer(info: dict) -> None:
        try:
            seen["first"] = first = json.loads(ready_file.read_text())
            os.kill(first["master_pid"], signal.SIGKILL)
            deadline = time.monotonic() + WAIT_S
            while True:
                now = json.loads(ready_file.read_text())
                if now["master_pid"] != first["master_pid"] and http_ok(now["admin"] + "/health", timeout=1.0):
                    seen["after"] = now
                    break
                if time.monotonic() > deadline:
                    break
                time.sleep(0.1)
        except Exception as exc:  # noqa: BLE001 (reported by the test below)
            seen["error"] = exc
        finally:
            os.kill(info.pids["producer"], signal.SIGKILL)  # an engine dies: serve-pair must stop

    def on_ready(info: ReadyFile) -> None:
        seen["info"] = info
        threading.Thread(target=kill_master_then_producer, args=(info,), daemon=True).start()

    try:
        with pytest.raises(ProcessDied) as caught:
            run_pair(cfg, messages.append, on_ready, policy=POLICY)
    finally:
        for name in ("first", "after"):  # whatever run_pair did not stop
            pid = seen.get(name, {}).get("master_pid")  # type: ignore[union-attr]
            if pid is not None and is_running_master(pid):
                os.kill(pid, signal.SIGKILL)
    assert "error" not in seen, seen.get("error")
    first, after = seen["first"], seen.get("after")
    assert after is not None, f"the ready file never named a new, healthy master: {messages}"
    assert first["admin"] == f"http://127.0.0.1:{ports[3]}" and first["max_model_len"] == 2048
    assert after["master_pid"] == after["pids"]["master"] and after["restarts"] == {"master": 1}
    assert {k: v for k, v in after.items() if k not in ("master_pid", "pids", "restarts")} == {
        k: v for k, v in first.items() if k not in ("master_pid", "pids", "restarts")
    }
    assert caught.value.message.startswith("producer (pid ")
    assert "was killed by SIGKILL while serving; stopping the others" in caught.value.message
    assert any("starting it again" in m for m in messages), messages
    assert not ready_file.exists()
    assert not is_running_master(after["master_pid"])
