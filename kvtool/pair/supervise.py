"""Keeping the pair's Mooncake processes up: restart a master (or standalone store) that died or hung.

The store is a cache, so losing its keys is fine; losing the process is not: the engines would
serve without reuse until someone noticed. Three parts:

- Backoff and RestartTracker: the policy, pure (the caller passes the time in), unit tested.
- Supervisor: applies the tracker's decisions to real processes of a ProcessSet: probes their
  health (their ReadinessCheck), SIGKILLs a hung one, starts it again with the same command line
  (so on the same ports), and reports each step.
- Watch: runs Supervisor.tick() on a thread until stopped.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Literal

from kvtool.errors import UserError
from kvtool.procs import ManagedProcess, ProcessSet, kill_now

Reporter = Callable[[str], None]
Clock = Callable[[], float]


@dataclass(frozen=True)
class Backoff:
    """Delay before the n-th restart in a row: initial_s, times factor each time, at most max_s."""

    initial_s: float = 0.5
    factor: float = 2.0
    max_s: float = 10.0

    def __post_init__(self) -> None:
        if not (0 < self.initial_s <= self.max_s and self.factor >= 1):
            raise ValueError(f"bad back-off {self}: need 0 < initial_s <= max_s and factor >= 1")

    def delay(self, attempt: int) -> float:
        """attempt 1 is the first restart after a healthy stretch."""
        delay = self.initial_s
        for _ in range(max(attempt, 1) - 1):
            delay *= self.factor
            if delay >= self.max_s:
                return self.max_s
        return min(delay, self.max_s)


@dataclass(frozen=True)
class Policy:
    """When a supervised process counts as failed, and how soon it is started again."""

    backoff: Backoff = field(default_factory=Backoff)
    unhealthy_after_s: float = 5.0  # a running process failing its health check this long is hung...
    min_failed_checks: int = 3  # ...and failed at least this many checks in a row
    startup_grace_s: float = 30.0  # a (re)started process may take this long to pass its first check
    healthy_reset_s: float = 30.0  # healthy this long: the next failure starts the back-off over
    interval_s: float = 0.5  # between two rounds of checks


DEFAULT_POLICY = Policy()

Action = Literal["ok", "recovered", "down", "wait", "start"]


@dataclass(frozen=True)
class Decision:
    """ok: nothing to do; recovered: first passed check after a restart; down: it failed (kill it
    first when ``kill``), start it again in ``delay_s``; wait: back-off running; start: start it now."""

    action: Action
    kill: bool = False
    reason: str = ""
    delay_s: float = 0.0


class RestartTracker:
    """The restart policy for one process, as a state machine fed with observations and the time."""

    def __init__(self, policy: Policy, now: float) -> None:
        self.policy = policy
        self.failures = 0  # in a row, without a healthy stretch of healthy_reset_s between them
        self.restarts = 0
        self._restart_at: float | None = None  # set while it is down, waiting out the back-off
        self._begin(now)

    def _begin(self, now: float) -> None:
        self._started_at = now
        self._ever_healthy = False
        self._healthy_since: float | None = None
        self._failing_since: float | None = None
        self._failed_checks = 0
        self._restart_at = None

    @property
    def down(self) -> bool:
        return self._restart_at is not None

    def observe(self, now: float, alive: bool, healthy: bool) -> Decision:
        """One round: is the process alive, and did it pass its health check (ignored while down)?"""
        if self._restart_at is not None:
            return Decision("start") if now >= self._restart_at else Decision("wait")
        if not alive:
            return self._failed(now, kill=False, reason="")
        if healthy:
            self._failing_since, self._failed_checks = None, 0
            if self._healthy_since is None:
                self._healthy_since = now
            if self.failures and now - self._healthy_since >= self.policy.healthy_reset_s:
                self.failures = 0
            first = not self._ever_healthy
            self._ever_healthy = True
            return Decision("recovered" if first and self.restarts else "ok")
        self._healthy_since = None
        self._failed_checks += 1
        if self._failing_since is None:
            self._failing_since = now
        if not self._ever_healthy:
            grace = self.policy.startup_grace_s
            if now - self._started_at >= grace:
                return self._failed(now, kill=True, reason=f"did not pass its health check within {grace:g} s")
            return Decision("ok")
        failing_for = now - self._failing_since
        if self._failed_checks >= self.policy.min_failed_checks and failing_for >= self.policy.unhealthy_after_s:
            return self._failed(now, kill=True, reason=f"has failed its health check for {failing_for:.0f} s")
        return Decision("ok")

    def started(self, now: float) -> None:
        """It was started again: count it, give it its start-up grace."""
        self.restarts += 1
        self._begin(now)

    def start_failed(self, now: float, reason: str) -> Decision:
        return self._failed(now, kill=False, reason=reason)

    def _failed(self, now: float, kill: bool, reason: str) -> Decision:
        self.failures += 1
        delay = self.policy.backoff.delay(self.failures)
        self._restart_at = now + delay
        return Decision("down", kill=kill, reason=reason, delay_s=delay)


class Supervisor:
    """Restarts the named processes of a ProcessSet when they die or fail their health checks.

    Each process's ReadinessCheck is its health check. A restarted process gets the same command
    line, so the same ports. ``on_restart(name, pid)`` is called after each restart.
    """

    def __init__(
        self,
        procs: ProcessSet,
        labels: dict[str, str],
        say: Reporter,
        policy: Policy = DEFAULT_POLICY,
        clock: Clock = time.monotonic,
        event_log: Path | None = None,
        on_restart: Callable[[str, int], None] | None = None,
        on_event: Callable[[str, Action], None] | None = None,
    ) -> None:
        self.procs = procs
        self.labels = labels  # name in the ProcessSet -> how to call it in messages
        self.say = say
        self.policy = policy
        self.clock = clock
        self.event_log = event_log
        self.on_restart = on_restart
        self.on_event = on_event  # told of each "down" (before the restart) and "recovered" (after it)
        self._recovered_notes: dict[str, str] = {}
        now = clock()
        self.trackers = {name: RestartTracker(policy, now) for name in labels}
        procs.supervised.update(labels)
        self._round = threading.RLock()  # one round of checks at a time; ``forget`` waits for it

    def supervise(self, name: str, label: str, policy: Policy | None = None, recovered_note: str = "") -> None:
        """Watch one more process from now on (a fleet's router and engines, started after the store),
        by its own ``policy`` where given; ``recovered_note`` ends the line said when it is back."""
        self.trackers[name] = RestartTracker(policy or self.policy, self.clock())
        if recovered_note:
            self._recovered_notes[name] = recovered_note
        self.procs.supervised.add(name)
        self.labels[name] = label  # last: the watch thread's next round picks it up

    def forget(self, name: str) -> None:
        """Stop watching ``name`` (a fleet's engine scaled in): once this returns, no round of checks
        touches it, so stopping it starts nothing again."""
        with self._round:
            self.labels.pop(name, None)
            self.trackers.pop(name, None)
            self._recovered_notes.pop(name, None)
            self.procs.supervised.discard(name)

    def restarts(self) -> dict[str, int]:
        return {name: tracker.restarts for name, tracker in list(self.trackers.items())}

    def tick(self) -> None:
        """One round of checks over every supervised process."""
        with self._round:
            for name in list(self.labels):  # supervise() may add one meanwhile
                self._tick_one(name)

    def _tick_one(self, name: str) -> None:
        tracker = self.trackers[name]
        proc = self.procs.get(name)
        alive = proc.exit_code() is None
        healthy = alive and not tracker.down and proc.readiness.passes()
        now = self.clock()
        decision = tracker.observe(now, alive, healthy)
        label = f"{self.labels[name]} (pid {proc.pid})"
        if decision.action == "recovered":
            note = self._recovered_notes.get(name, "the engines reconnect on their own (what it stored is lost)")
            self.report(f"{label} passes its health check again after restart {tracker.restarts}; {note}")
        elif decision.action == "down":
            kill_now(proc)  # a hung one, or what an exited one left in its process group
            what = f"{decision.reason}; killed it (SIGKILL)" if decision.kill else proc.how_it_ended()
            self.report(f"{label} {what}; starting it again in {decision.delay_s:g} s ({self._where(proc)})")
        elif decision.action == "start":
            self._start_again(name, proc, tracker)
        if decision.action in ("down", "recovered") and self.on_event is not None:
            self.on_event(name, decision.action)

    def _start_again(self, name: str, old: ManagedProcess, tracker: RestartTracker) -> None:
        if old.exit_code() is None:
            kill_now(old)  # never two on the same ports
        try:
            _append_line(old.log_path, f"---- kvtool: starting {self.labels[name]} again ----")
            new = self.procs.restart(old)
        except (UserError, OSError) as exc:
            decision = tracker.start_failed(self.clock(), str(getattr(exc, "message", exc)))
            self.report(
                f"could not start {self.labels[name]} again ({decision.reason}); next try in {decision.delay_s:g} s"
            )
            return
        tracker.started(self.clock())
        self.report(f"started {self.labels[name]} again as pid {new.pid} (restart {tracker.restarts})")
        if self.on_restart is not None:
            self.on_restart(name, new.pid)

    def _where(self, proc: ManagedProcess) -> str:
        return f"same ports; health check {proc.readiness.describe()}; log {proc.log_path}"

    def report(self, message: str) -> None:
        self.say(message)
        if self.event_log is not None:
            _append_line(self.event_log, f"{datetime.now():%Y-%m-%d %H:%M:%S} {message}")


def _append_line(path: Path, line: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as log:
        log.write(line + "\n")


class Watch:
    """Runs supervisor.tick() every policy.interval_s on a thread.

    The thread is the parent of the processes it restarts, and PR_SET_PDEATHSIG kills a child when
    the thread that forked it ends: so stop() only ends the checks, and the thread stays until
    release(), to be called once those processes were stopped.
    """

    def __init__(self, supervisor: Supervisor) -> None:
        self.supervisor = supervisor
        self._stop = threading.Event()
        self._stopped = threading.Event()
        self._release = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvtool-supervisor", daemon=True)

    def start(self) -> Watch:
        self._thread.start()
        return self

    def _run(self) -> None:
        try:
            while not self._stop.wait(self.supervisor.policy.interval_s):
                try:
                    self.supervisor.tick()
                except Exception as exc:  # noqa: BLE001 (a bug here must not end supervision silently)
                    self.supervisor.say(f"supervisor error (still watching): {exc!r}")
        finally:
            self._stopped.set()
        self._release.wait()

    def stop(self, timeout_s: float = 30.0) -> None:
        """End the checks (a round in progress finishes first); no restart happens after this."""
        self._stop.set()
        if self._thread.is_alive():
            self._stopped.wait(timeout_s)

    def release(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self._release.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
