"""Starting, watching and stopping the server processes kvtool runs, without leaving orphans.

Each child runs in its own session (process group), so a terminal's Ctrl-C reaches only kvtool,
which then stops the children in reverse start order and waits for their whole groups (a vLLM
server's engine core is a grandchild). Children also get SIGTERM from the kernel if kvtool
itself dies (PR_SET_PDEATHSIG), so even a SIGKILLed kvtool leaves nothing running.
"""

from __future__ import annotations

import ctypes
import errno
import os
import signal
import socket
import subprocess
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from kvtool import web
from kvtool.errors import ServerError, UserError

LOOPBACK = "127.0.0.1"
_PR_SET_PDEATHSIG = 1


def ensure_port_free(port: int, flag: str, host: str = LOOPBACK) -> None:
    """Raise a UserError naming the flag that chooses `port` when something already holds it."""
    if not 0 < port < 65536:
        raise UserError(f"{flag} {port} is not a TCP port; pick one between 1 and 65535")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        # Servers set SO_REUSEADDR too, so a port left in TIME_WAIT by an earlier run counts as free.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            if exc.errno in (errno.EADDRINUSE, errno.EACCES):
                raise UserError(f"port {port} is already in use on {host}; pick another with {flag}") from None
            raise


def find_free_port(host: str = LOOPBACK) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def tcp_port_open(port: int, host: str = LOOPBACK, timeout: float = 0.5) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def http_ok(url: str, timeout: float = 2.0) -> bool:
    try:
        return web.get(url, timeout=timeout).status_code == 200
    except httpx.HTTPError:
        return False


def log_tail(path: Path, lines: int = 15) -> str:
    try:
        with open(path, errors="replace") as log:
            return "".join(deque(log, maxlen=lines)).rstrip()
    except OSError:
        return ""


def _load_prctl() -> Callable[..., int] | None:
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None  # not Linux: stop_all() is the only guard


# Looked up once here: the forked child (which may fork from a thread) only calls it, no dlopen.
_prctl = _load_prctl()


def _die_with_parent() -> None:
    if _prctl is not None:
        _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


@dataclass
class ReadinessCheck:
    """How to tell a process is ready: an HTTP URL answering 200, or a TCP port accepting connections."""

    http_url: str | None = None
    tcp_port: int | None = None
    tcp_host: str = LOOPBACK
    # How to ask, where the check cannot run on this thread as it is (a test's host in a network
    # namespace: tests/netns.py): the check's own ask goes through it.
    through: Callable[[Callable[[], bool]], bool] | None = None

    def passes(self) -> bool:
        return self.through(self._ask) if self.through is not None else self._ask()

    def _ask(self) -> bool:
        if self.http_url is not None:
            return http_ok(self.http_url)
        if self.tcp_port is not None:
            return tcp_port_open(self.tcp_port, self.tcp_host)
        return True

    def describe(self) -> str:
        return self.http_url or (f"{self.tcp_host}:{self.tcp_port}" if self.tcp_port else "start")


class ProcessDied(ServerError):
    """A process kvtool started died; the message names it and its log."""


@dataclass
class ManagedProcess:
    name: str
    argv: list[str]
    log_path: Path
    popen: subprocess.Popen
    readiness: ReadinessCheck = field(default_factory=ReadinessCheck)
    env: dict[str, str] | None = None  # kept to start it again the same way
    cwd: Path | None = None

    @property
    def pid(self) -> int:
        return self.popen.pid

    def exit_code(self) -> int | None:
        return self.popen.poll()

    def how_it_ended(self) -> str:
        code = self.exit_code()
        if code is None:
            return "is still running"
        if code < 0:
            try:
                return f"was killed by {signal.Signals(-code).name}"
            except ValueError:
                return f"was killed by signal {-code}"
        return f"exited with code {code}"

    def died_error(self, while_doing: str = "") -> ProcessDied:
        when = f" {while_doing}" if while_doing else ""
        return ProcessDied(
            f"{self.name} (pid {self.pid}) {self.how_it_ended()}{when}; see {self.log_path}",
            details=log_tail(self.log_path),
        )


def _group_alive(pgid: int) -> bool:
    """Whether any non-zombie process is still in the group (zombies wait on a reaper, not on us)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                stat = Path(entry.path, "stat").read_text()
            except OSError:
                continue
            fields = stat.rsplit(")", 1)[1].split()  # the command name may contain spaces
            if int(fields[2]) == pgid and fields[0] != "Z":
                return True
        return False
    except OSError:
        return True


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def _wait_until(condition: Callable[[], bool], deadline: float) -> bool:
    while not condition():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)
    return True


def stop_process(proc: ManagedProcess, grace_s: float = 15.0) -> None:
    """SIGTERM the leader, then its whole group; SIGKILL the group if anything outlives grace_s.

    The leader goes first and alone: a vLLM API server shuts its engine core down in order, while
    a SIGTERM to the whole group at once kills the engine under it (EngineDeadError in the log).
    """
    pgid = proc.pid  # start_new_session makes the child its group's leader

    def leader_gone() -> bool:
        return proc.popen.poll() is not None

    def all_gone() -> bool:
        return leader_gone() and not _group_alive(pgid)

    deadline = time.monotonic() + grace_s
    if not leader_gone():
        proc.popen.send_signal(signal.SIGTERM)
        _wait_until(leader_gone, deadline)
    if all_gone():
        return
    _signal_group(pgid, signal.SIGTERM)
    if _wait_until(all_gone, max(deadline, time.monotonic() + 3.0)):
        return
    _signal_group(pgid, signal.SIGKILL)
    _wait_until(all_gone, time.monotonic() + 5.0)


def kill_now(proc: ManagedProcess, wait_s: float = 5.0) -> None:
    """SIGKILL the process's whole group at once (a frozen, SIGSTOPped one too) and reap it."""
    _signal_group(proc.pid, signal.SIGKILL)
    try:
        proc.popen.wait(timeout=wait_s)
    except subprocess.TimeoutExpired:
        pass
    _wait_until(lambda: not _group_alive(proc.pid), time.monotonic() + wait_s)


class ProcessSet:
    """The processes of one kvtool run; stop_all() stops them in reverse start order.

    Start processes from the main thread, or from a thread that outlives them: PR_SET_PDEATHSIG
    fires when the *thread* that forked exits. Names in ``supervised`` are restarted by someone
    else (kvtool.pair.supervise), and names in ``departed`` have ended and were let go (a fleet's
    engine: the rest serve on), so first_dead() reports neither; pids() leaves out the departed.
    """

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.processes: list[ManagedProcess] = []
        self.supervised: set[str] = set()
        self.departed: set[str] = set()
        self.on_departed: Callable[[str], None] | None = None  # told of each (the ready file is rewritten)

    def pids(self) -> dict[str, int]:
        return {p.name: p.pid for p in self.processes if p.name not in self.departed}

    def depart(self, name: str) -> None:
        """Let an ended process go: no longer reported dead, nor listed by pids()."""
        self.departed.add(name)
        if self.on_departed is not None:
            self.on_departed(name)

    def get(self, name: str) -> ManagedProcess:
        return next(p for p in self.processes if p.name == name)

    def start(
        self,
        name: str,
        argv: list[str],
        env: dict[str, str] | None = None,
        readiness: ReadinessCheck | None = None,
        cwd: Path | None = None,
    ) -> ManagedProcess:
        proc = self._spawn(name, argv, env, readiness or ReadinessCheck(), cwd)
        self.processes.append(proc)
        return proc

    def restart(self, old: ManagedProcess) -> ManagedProcess:
        """Start ``old`` (already ended) again the same way, in its place in the stop order."""
        index = self.processes.index(old)
        proc = self._spawn(old.name, old.argv, old.env, old.readiness, old.cwd)
        self.processes[index] = proc
        return proc

    def _spawn(
        self, name: str, argv: list[str], env: dict[str, str] | None, readiness: ReadinessCheck, cwd: Path | None
    ) -> ManagedProcess:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_dir / f"{name}.log"
        with open(log_path, "ab") as log:
            try:
                popen = subprocess.Popen(
                    argv,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=env,
                    cwd=cwd,
                    start_new_session=True,
                    preexec_fn=_die_with_parent,  # noqa: PLW1509 (it only calls prctl, looked up before the fork)
                )
            except FileNotFoundError:
                raise UserError(
                    f"{argv[0]} was not found; install it (scripts/setup) or put it on PATH", exit_code=1
                ) from None
        return ManagedProcess(name, argv, log_path, popen, readiness, env, cwd)

    def first_dead(self) -> ManagedProcess | None:
        return next(
            (
                p
                for p in list(self.processes)
                if p.name not in self.supervised and p.name not in self.departed and p.exit_code() is not None
            ),
            None,
        )

    def wait_ready(self, procs: list[ManagedProcess], timeout_s: float, poll_s: float = 0.5) -> None:
        """Wait until every process in procs passes its readiness check, failing fast if one dies."""
        pending = list(procs)
        deadline = time.monotonic() + timeout_s
        while pending:
            dead = self.first_dead()
            if dead is not None:
                raise dead.died_error("before it was ready")
            pending = [p for p in pending if not p.readiness.passes()]
            if not pending:
                return
            if time.monotonic() > deadline:
                slow = pending[0]
                raise ServerError(
                    f"{slow.name} was not ready at {slow.readiness.describe()} after {timeout_s:.0f} s; "
                    f"see {slow.log_path}",
                    details=log_tail(slow.log_path),
                )
            time.sleep(poll_s)

    def stop_one(self, name: str, grace_s: float = 15.0) -> None:
        """Stop the process ``name`` and forget it (a fleet's engine scaled in)."""
        proc = self.get(name)
        stop_process(proc, grace_s)
        self.processes.remove(proc)
        self.departed.discard(name)

    def stop_all(self, grace_s: float = 15.0) -> None:
        while self.processes:
            stop_process(self.processes.pop(), grace_s)
