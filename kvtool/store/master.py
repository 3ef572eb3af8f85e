"""A loopback ``mooncake_master`` on free ports, started and stopped by its pid.

What the tests and the benchmarks run (serve-pair starts its master through ``kvtool.pair.launch``,
supervised, on the ports it is configured with). Started, waited for and stopped as every process
kvtool starts is (``kvtool.procs``). Everything binds 127.0.0.1.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from kvtool.errors import ServerError
from kvtool.store.admin import open_admin
from kvtool.procs import LOOPBACK, ManagedProcess, ProcessSet, ReadinessCheck, find_free_port
from kvtool.store.mooncake import find_binary, master_argv, mooncake_env


class LocalMaster:
    """One master process: ``start`` it (or use it as a context manager), then ``stop`` it.

    Its log goes to ``log_path`` (a ``.log`` file), or to a temporary directory removed on ``stop``."""

    def __init__(self, log_path: Path | None = None, flags: Sequence[str] = ()):
        self.rpc_port, self.admin_port = find_free_port(), find_free_port()
        self.address = f"{LOOPBACK}:{self.rpc_port}"  # what store clients connect to
        self.admin = f"http://{LOOPBACK}:{self.admin_port}"  # its HTTP admin and metrics
        self._log_path = log_path
        self._flags = tuple(flags)
        self._temp_dir: Path | None = None
        self._procs: ProcessSet | None = None
        self._master: ManagedProcess | None = None

    def start(self, timeout_s: float = 30.0) -> LocalMaster:
        if self._log_path is None:
            self._temp_dir = Path(tempfile.mkdtemp(prefix="kvtool-master-"))
            log_dir, name = self._temp_dir, "master"
        else:
            log_dir, name = self._log_path.parent, self._log_path.name.removesuffix(".log")
        self._procs = ProcessSet(log_dir)
        argv = [*master_argv(self.rpc_port, self.admin_port, find_binary("mooncake_master")), *self._flags]
        self._master = self._procs.start(
            name, argv, env=mooncake_env(), readiness=ReadinessCheck(f"{self.admin}/health")
        )
        try:
            self._procs.wait_ready([self._master], timeout_s, poll_s=0.1)  # a ServerError naming its log
        except BaseException:
            self.stop()
            raise
        return self

    @property
    def log_path(self) -> Path | None:
        return self._master.log_path if self._master is not None else self._log_path

    @property
    def process(self) -> subprocess.Popen | None:
        return self._master.popen if self._master is not None else None

    @property
    def pid(self) -> int | None:
        return self._master.pid if self._master is not None else None

    def role(self) -> str | None:
        """In a high-availability group: ``leader`` or ``standby``; None if it does not say."""
        return open_admin(self.admin).role()

    def wait_for_role(self, role: str, timeout_s: float = 90.0) -> None:
        """Wait until this master of an HA group has ``role``; a ServerError past ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while self.role() != role:
            if time.monotonic() > deadline:
                raise ServerError(f"the master at {self.admin} did not become {role} in {timeout_s:.0f} s")
            time.sleep(0.5)

    def stop(self) -> None:
        procs, self._procs, self._master = self._procs, None, None
        if procs is not None:
            procs.stop_all(grace_s=10.0)
        if self._temp_dir is not None:
            shutil.rmtree(self._temp_dir, ignore_errors=True)
            self._temp_dir = None

    def __enter__(self) -> LocalMaster:
        return self if self._master is not None else self.start()

    def __exit__(self, *_exc: object) -> None:
        self.stop()


class LocalEtcd:
    """A one-member etcd on loopback free ports, its data in a temporary directory: what a master group in
    high-availability mode (``mooncake_master --enable_ha``) elects its leader through. Needs ``etcd``
    on PATH (Debian's etcd-server; scripts/setup installs it)."""

    def __init__(self) -> None:
        self.client_port, self.peer_port = find_free_port(), find_free_port()
        self.endpoint = f"{LOOPBACK}:{self.client_port}"
        self._dir: Path | None = None
        self._procs: ProcessSet | None = None

    def start(self, timeout_s: float = 30.0) -> LocalEtcd:
        binary = shutil.which("etcd")
        if binary is None:
            raise ServerError("etcd is not installed; install Debian's etcd-server (scripts/setup does)")
        self._dir = Path(tempfile.mkdtemp(prefix="kvtool-etcd-"))
        client, peer = f"http://{self.endpoint}", f"http://{LOOPBACK}:{self.peer_port}"
        argv = [
            binary,
            "--name",
            "kvtool",
            "--data-dir",
            str(self._dir / "data"),
            "--listen-client-urls",
            client,
            "--advertise-client-urls",
            client,
            "--listen-peer-urls",
            peer,
            "--initial-advertise-peer-urls",
            peer,
            "--initial-cluster",
            f"kvtool={peer}",
        ]
        self._procs = ProcessSet(self._dir)
        etcd = self._procs.start("etcd", argv, readiness=ReadinessCheck(f"{client}/health"))
        try:
            self._procs.wait_ready([etcd], timeout_s, poll_s=0.1)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        procs, self._procs = self._procs, None
        if procs is not None:
            procs.stop_all(grace_s=10.0)
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None


def ha_master_flags(etcd: LocalEtcd) -> tuple[str, ...]:
    """A master's flags to join the high-availability group that ``etcd`` elects."""
    return ("--enable_ha=true", f"--etcd_endpoints={etcd.endpoint}")
