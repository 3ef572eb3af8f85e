"""The master's supervision: the back-off, the restart decisions (a fake clock), and the supervisor
acting on real, cheap processes (`sleep`), with the health check and the clock scripted."""

from __future__ import annotations

import json
import math
import signal
import threading
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtool.pair.launch import ReadyFileWriter
from kvtool.pair.ready import ReadyFile
from kvtool.procs import ProcessSet
from kvtool.pair.supervise import Backoff, Decision, Policy, RestartTracker, Supervisor, Watch

POLICY = Policy(
    backoff=Backoff(0.5, 2.0, 10.0),
    unhealthy_after_s=5.0,
    min_failed_checks=3,
    startup_grace_s=30.0,
    healthy_reset_s=30.0,
)


# ---- back-off -------------------------------------------------------------------------------


def test_backoff_doubles_from_half_a_second_to_ten():
    backoff = Backoff(0.5, 2.0, 10.0)
    assert [backoff.delay(n) for n in range(1, 9)] == [0.5, 1.0, 2.0, 4.0, 8.0, 10.0, 10.0, 10.0]
    assert backoff.delay(10**6) == 10.0  # no overflow however long it keeps failing


@pytest.mark.parametrize("args", [(0, 2, 10), (5, 2, 1), (0.5, 0.5, 10)])
def test_backoff_rejects_nonsense(args):
    with pytest.raises(ValueError):
        Backoff(*args)


backoffs = st.builds(
    lambda initial, factor, extra: Backoff(initial, factor, initial + extra),
    st.floats(0.01, 5.0),
    st.floats(1.0, 4.0),
    st.floats(0.0, 60.0),
)


@given(backoffs, st.integers(1, 200))
def test_backoff_grows_by_at_most_its_factor_and_stays_in_bounds(backoff, attempt):
    now, after = backoff.delay(attempt), backoff.delay(attempt + 1)
    assert backoff.initial_s <= now <= after <= backoff.max_s
    assert after <= now * backoff.factor * (1 + 1e-9)
    assert backoff.delay(1) == backoff.initial_s


@given(backoffs.filter(lambda b: b.factor > 1.01))
def test_backoff_reaches_its_ceiling(backoff):
    needed = 1 + math.ceil(math.log(backoff.max_s / backoff.initial_s) / math.log(backoff.factor))
    assert backoff.delay(needed + 1) == backoff.max_s


# ---- restart decisions ----------------------------------------------------------------------


def test_an_exited_process_is_started_again_after_the_backoff():
    tracker = RestartTracker(POLICY, now=0.0)
    assert tracker.observe(1.0, alive=True, healthy=True) == Decision("ok")
    down = tracker.observe(2.0, alive=False, healthy=False)
    assert (down.action, down.kill, down.delay_s) == ("down", False, 0.5)
    assert tracker.observe(2.4, alive=False, healthy=False).action == "wait"
    assert tracker.observe(2.5, alive=False, healthy=False).action == "start"
    tracker.started(2.5)
    assert tracker.restarts == 1
    assert tracker.observe(3.0, alive=True, healthy=False).action == "ok"  # starting: within its grace
    assert tracker.observe(3.5, alive=True, healthy=True).action == "recovered"
    assert tracker.observe(4.0, alive=True, healthy=True).action == "ok"


def test_a_hung_process_is_killed_after_enough_failed_checks_over_enough_time():
    tracker = RestartTracker(POLICY, now=0.0)
    tracker.observe(0.0, alive=True, healthy=True)
    assert tracker.observe(10.0, alive=True, healthy=False).action == "ok"  # one failure is not a hang
    assert tracker.observe(12.0, alive=True, healthy=False).action == "ok"
    assert tracker.observe(14.9, alive=True, healthy=False).action == "ok"  # 3 checks, but only 4.9 s
    down = tracker.observe(15.0, alive=True, healthy=False)
    assert (down.action, down.kill, down.delay_s) == ("down", True, 0.5)
    assert "failed its health check for 5 s" in down.reason


def test_a_slow_round_is_not_a_hang_without_enough_checks():
    tracker = RestartTracker(POLICY, now=0.0)
    tracker.observe(0.0, alive=True, healthy=True)
    assert tracker.observe(1.0, alive=True, healthy=False).action == "ok"
    assert tracker.observe(60.0, alive=True, healthy=False).action == "ok"  # 59 s, 2 checks
    assert tracker.observe(61.0, alive=True, healthy=True).action == "ok"  # and it answered again
    assert tracker.observe(62.0, alive=True, healthy=False).action == "ok"  # a fresh count


def test_a_process_that_never_becomes_healthy_is_replaced_after_its_grace():
    tracker = RestartTracker(POLICY, now=0.0)
    assert tracker.observe(29.9, alive=True, healthy=False).action == "ok"
    down = tracker.observe(30.0, alive=True, healthy=False)
    assert (down.action, down.kill) == ("down", True)
    assert "within 30 s" in down.reason


def fail_and_restart(tracker: RestartTracker, now: float) -> tuple[float, float]:
    """It exits at `now`; return the back-off it got and when it was started again."""
    down = tracker.observe(now, alive=False, healthy=False)
    assert down.action == "down"
    restart_at = now + down.delay_s
    assert tracker.observe(restart_at, alive=False, healthy=False).action == "start"
    tracker.started(restart_at)
    return down.delay_s, restart_at


def test_backoff_grows_while_it_keeps_failing_and_resets_after_a_healthy_stretch():
    tracker = RestartTracker(POLICY, now=0.0)
    now, delays = 0.0, []
    for _ in range(7):
        delay, now = fail_and_restart(tracker, now)
        tracker.observe(now, alive=True, healthy=True)  # healthy, briefly
        delays.append(delay)
    assert delays == [0.5, 1.0, 2.0, 4.0, 8.0, 10.0, 10.0]
    tracker.observe(now + 29.0, alive=True, healthy=True)
    delay, now = fail_and_restart(tracker, now + 29.5)  # healthy 29.5 s: not long enough
    assert delay == 10.0
    tracker.observe(now + 0.1, alive=True, healthy=True)
    tracker.observe(now + 30.1, alive=True, healthy=True)  # healthy 30 s: the back-off starts over
    delay, _ = fail_and_restart(tracker, now + 31.0)
    assert delay == 0.5
    assert tracker.restarts == 9


def test_a_failed_start_is_one_more_failure():
    tracker = RestartTracker(POLICY, now=0.0)
    tracker.observe(0.0, alive=False, healthy=False)
    assert tracker.observe(0.5, alive=False, healthy=False).action == "start"
    again = tracker.start_failed(0.5, "not found")
    assert (again.action, again.delay_s, again.reason) == ("down", 1.0, "not found")
    assert tracker.observe(1.0, alive=False, healthy=False).action == "wait"
    assert tracker.observe(1.5, alive=False, healthy=False).action == "start"
    assert tracker.restarts == 0


observations = st.lists(st.tuples(st.floats(0.0, 20.0), st.booleans(), st.booleans()), max_size=80)


@given(observations)
def test_every_restart_waits_out_a_growing_backoff(steps):
    """Whatever it observes: a start comes only after the back-off of the failure before it, and
    the back-offs follow the policy's sequence, counted from the last reset."""
    tracker = RestartTracker(POLICY, now=0.0)
    now, restart_due, in_a_row = 0.0, None, 0
    healthy_since = None
    for dt, alive, healthy in steps:
        now += dt
        decision = tracker.observe(now, alive, healthy)
        if restart_due is not None:
            assert decision.action in ("start", "wait")
            assert (decision.action == "start") == (now >= restart_due)
            if decision.action == "start":
                tracker.started(now)
                restart_due, healthy_since = None, None
            continue
        assert decision.action in ("ok", "recovered", "down")
        if alive and healthy:
            healthy_since = now if healthy_since is None else healthy_since
            if now - healthy_since >= POLICY.healthy_reset_s:
                in_a_row = 0
        else:
            healthy_since = None
        if decision.action == "down":
            in_a_row += 1
            assert decision.delay_s == POLICY.backoff.delay(in_a_row)
            assert decision.kill == alive  # a live process is killed first, a dead one is not
            restart_due = now + decision.delay_s


# ---- the supervisor on real processes -------------------------------------------------------


class ScriptedCheck:
    """A health check the test answers."""

    def __init__(self) -> None:
        self.healthy = True

    def passes(self) -> bool:
        return self.healthy

    def describe(self) -> str:
        return "scripted"


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def supervised(processes: ProcessSet, tmp_path: Path, argv: list[str]):
    check, clock, messages, restarted = ScriptedCheck(), FakeClock(), [], []
    processes.start("master", argv, readiness=check)  # type: ignore[arg-type]
    supervisor = Supervisor(
        processes,
        {"master": "the test master"},
        messages.append,
        POLICY,
        clock=clock,
        event_log=tmp_path / "supervisor.log",
        on_restart=lambda name, pid: restarted.append((name, pid)),
    )
    return supervisor, check, clock, messages, restarted


def test_a_hung_process_is_sigkilled_and_started_again_on_the_same_command_line(processes, tmp_path):
    supervisor, check, clock, messages, restarted = supervised(processes, tmp_path, ["sleep", "60"])
    old = processes.get("master")
    supervisor.tick()
    assert messages == []
    check.healthy = False
    for _ in range(3):
        clock.now += 2.5
        supervisor.tick()
    assert old.exit_code() == -signal.SIGKILL
    assert processes.first_dead() is None  # supervised: not a reason to stop the pair
    assert messages[-1].startswith(f"the test master (pid {old.pid}) has failed its health check for 5 s;")
    assert "killed it (SIGKILL); starting it again in 0.5 s" in messages[-1]
    clock.now = 107.9
    supervisor.tick()
    assert restarted == []  # still waiting out the back-off
    clock.now = 108.0
    supervisor.tick()
    new = processes.get("master")
    assert new.pid != old.pid and new.exit_code() is None and new.argv == old.argv
    assert processes.processes == [new]
    assert restarted == [("master", new.pid)]
    assert supervisor.restarts() == {"master": 1}
    assert messages[-1] == f"started the test master again as pid {new.pid} (restart 1)"
    check.healthy = True
    supervisor.tick()
    assert messages[-1].startswith(f"the test master (pid {new.pid}) passes its health check again")
    log = (tmp_path / "supervisor.log").read_text()
    assert "killed it (SIGKILL)" in log and f"again as pid {new.pid}" in log
    assert "starting the test master again" in new.log_path.read_text()


def test_an_exited_process_is_reported_with_its_exit_code(processes, tmp_path):
    supervisor, _check, clock, messages, restarted = supervised(processes, tmp_path, ["sh", "-c", "exit 3"])
    processes.get("master").popen.wait(timeout=10)
    supervisor.tick()
    assert "exited with code 3; starting it again in 0.5 s" in messages[-1]
    clock.now += 0.5
    supervisor.tick()
    assert len(restarted) == 1


def test_a_start_that_fails_is_retried_with_a_longer_backoff(processes, tmp_path):
    script = tmp_path / "server"
    script.write_text("#!/bin/sh\nexec sleep 60\n")
    script.chmod(0o755)
    supervisor, _check, clock, messages, restarted = supervised(processes, tmp_path, [str(script)])
    script.unlink()
    processes.get("master").popen.kill()
    processes.get("master").popen.wait(timeout=10)
    supervisor.tick()
    clock.now += 0.5
    supervisor.tick()
    assert restarted == []
    assert messages[-1].startswith("could not start the test master again (")
    assert messages[-1].endswith("next try in 1 s")


# ---- the ready file and the watch thread ----------------------------------------------------


def test_ready_file_is_written_once_published_and_rewritten_on_refresh(tmp_path):
    path = tmp_path / "ready.json"
    state = {"master_pid": 1}

    def info() -> ReadyFile:
        return ReadyFile(
            producer="P",
            consumer="C",
            model="m",
            block_size=32,
            hash_unit=1,
            max_model_len=64,
            connector="kvtool",
            master_pid=state["master_pid"],
        )

    ready = ReadyFileWriter(path)
    ready.refresh()  # a restart before the pair is ready: nothing written yet
    assert not path.exists()
    assert ready.publish(info).master_pid == 1
    state["master_pid"] = 2
    ready.refresh()
    assert json.loads(path.read_text())["master_pid"] == 2
    ready.remove()
    ready.refresh()
    assert not path.exists()
    assert [p.name for p in tmp_path.iterdir()] == []


def test_a_ready_file_that_cannot_be_written_is_one_sentence_and_leaves_no_staging_file(tmp_path, capsys):
    from kvtool.errors import UserError

    def info() -> ReadyFile:
        return ReadyFile(
            producer="P", consumer="C", model="m", block_size=32, hash_unit=1, max_model_len=64, connector="kvtool"
        )

    (tmp_path / "taken").mkdir()
    ready = ReadyFileWriter(tmp_path / "taken")  # a directory where the file should go: the rename fails
    with pytest.raises(UserError, match="cannot write the ready file") as raised:
        ready.publish(info)
    assert raised.value.exit_code == 1
    ready.refresh()  # a restart's rewrite says so and lets the pair serve on
    assert "cannot write the ready file" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]


def test_serve_pair_checks_its_ready_file_path_before_starting_anything(tmp_path):
    from typer.testing import CliRunner

    from kvtool.cli import app

    (tmp_path / "file").write_text("x")
    for bad in (tmp_path, tmp_path / "file" / "ready.json"):
        result = CliRunner().invoke(app, ["serve-pair", "--ready-file", str(bad)])
        assert result.exit_code == 2 and "--ready-file" in result.output, result.output


class CountingSupervisor:
    policy = Policy(interval_s=0.001)

    def __init__(self) -> None:
        self.ticks = 0
        self.enough = threading.Event()
        self.said: list[str] = []

    def tick(self) -> None:
        self.ticks += 1
        if self.ticks == 3:
            raise RuntimeError("a bug")
        if self.ticks >= 5:
            self.enough.set()

    def say(self, message: str) -> None:
        self.said.append(message)


def test_watch_survives_an_error_and_ticks_no_more_after_stop():
    counting = CountingSupervisor()
    watch = Watch(counting).start()  # type: ignore[arg-type]
    try:
        assert counting.enough.wait(30)
        watch.stop()
        after_stop = counting.ticks
        assert counting.said == ["supervisor error (still watching): RuntimeError('a bug')"]
        assert watch._thread.is_alive()  # parked: it is the parent of what it restarted
    finally:
        watch.release()
    assert not watch._thread.is_alive()
    assert counting.ticks == after_stop
