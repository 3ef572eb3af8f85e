"""A loopback ``mooncake_master`` on free ports, started and stopped by its pid.

What the tests and the benchmarks run (serve-pair starts its master through ``kvtool.pair.launch``,
supervised, on the ports it is configured with). Everything binds 127.0.0.1.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

import httpx

from kvtool.errors import ServerError
from kvtool.pair.procs import LOOPBACK, find_free_port
from kvtool.store.mooncake import find_binary, master_argv, mooncake_env


class LocalMaster:
    """One master process: ``start`` it (or use it as a context manager), then ``stop`` it."""

    def __init__(self, log_path: Path | None = None, flags: Sequence[str] = ()):
        self.rpc_port, self.admin_port = find_free_port(), find_free_port()
        self.address = f"{LOOPBACK}:{self.rpc_port}"  # what store clients connect to
        self.admin = f"http://{LOOPBACK}:{self.admin_port}"  # its HTTP admin and metrics
        self.log_path = log_path
        self._flags = tuple(flags)
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 30.0) -> LocalMaster:
        argv = [*master_argv(self.rpc_port, self.admin_port, find_binary("mooncake_master")), *self._flags]
        log = open(self.log_path, "ab") if self.log_path is not None else subprocess.DEVNULL  # noqa: SIM115
        try:
            self.process = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=mooncake_env()
            )
        finally:
            if log is not subprocess.DEVNULL:
                log.close()
        self._wait_healthy(timeout_s)
        return self

    def _wait_healthy(self, timeout_s: float) -> None:
        assert self.process is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise ServerError(f"mooncake_master exited with code {self.process.returncode}{self._log_tail()}")
            try:
                if httpx.get(f"{self.admin}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.stop()
        raise ServerError(f"mooncake_master was not healthy within {timeout_s:.0f} s{self._log_tail()}")

    def _log_tail(self) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return f": {self.log_path.read_text(errors='replace')[-2000:]}"

    def stop(self) -> None:
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    def __enter__(self) -> LocalMaster:
        return self if self.process is not None else self.start()

    def __exit__(self, *_exc: object) -> None:
        self.stop()
