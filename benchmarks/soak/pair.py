"""The serve-pair process a soak runs against: its ready file, its fault plan file and its logs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from kvtool import web
from kvtool.errors import UserError
from kvtool.pair.ready import ReadyFile, read_ready_file
from kvtool.procs import find_free_port, log_tail

REPO = Path(__file__).resolve().parents[2]
STARTUP_TIMEOUT_S = 400.0


class Pair:
    """A serve-pair process this script started, its ready file and its fault plan file."""

    def __init__(self, workdir: Path, roles: str) -> None:
        self.workdir = workdir
        self.roles = roles
        self.ready_file = workdir / "ready.json"
        self.fault_file = workdir / "faults.json"
        self.log = workdir / "serve-pair.log"
        self.argv = [
            sys.executable,
            "-m",
            "kvtool.cli",
            "serve-pair",
            "--roles",
            roles,
            "--ready-file",
            str(self.ready_file),
            "--log-dir",
            str(workdir / "logs"),
            "--startup-timeout",
            str(STARTUP_TIMEOUT_S - 20),
            "--fault-control-file",
            str(self.fault_file),
        ]
        for flag in ("producer", "consumer", "master", "admin"):
            self.argv += [f"--{flag}-port", str(find_free_port())]
        self.process: subprocess.Popen | None = None
        self._info: ReadyFile | None = None

    @property
    def info(self) -> ReadyFile:
        """The ready file as serve-pair first wrote it."""
        if self._info is None:
            raise RuntimeError("the pair has not started")
        return self._info

    def start(self) -> ReadyFile:
        self.process = subprocess.Popen(
            self.argv,
            cwd=REPO,
            start_new_session=True,
            stdout=open(self.log, "wb"),
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not self.ready_file.exists():
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(
                    f"serve-pair --roles {self.roles} did not start; see {self.log}:\n{log_tail(self.log)}"
                )
            time.sleep(0.5)
        self._info = self.ready()
        return self._info

    def ready(self) -> ReadyFile:
        for _ in range(50):
            try:
                return read_ready_file(self.ready_file)
            except UserError:
                time.sleep(0.1)  # written atomically, but removed on exit
        raise RuntimeError(f"cannot read {self.ready_file}")

    def master_healthy(self) -> bool:
        try:
            return web.get(f"{self.info.admin}/health", timeout=1.0).status_code == 200
        except httpx.HTTPError:
            return False

    def key_exists(self, key: str) -> bool | None:
        """None when the admin port does not answer (the master is down or frozen)."""
        try:
            answer = web.get(f"{self.info.admin}/query_key?key={key}", timeout=1.0)
        except httpx.HTTPError:
            return None
        try:
            return answer.status_code == 200 and bool(answer.json().get("success"))
        except ValueError:
            return None

    def set_faults(self, plan: dict | None) -> None:
        if plan is None:
            self.fault_file.unlink(missing_ok=True)
            return
        staging = self.fault_file.with_suffix(".tmp")
        staging.write_text(json.dumps(plan))
        os.replace(staging, self.fault_file)

    def engine_log(self, engine: str) -> Path:
        return Path(self.info.log_dir or ".") / f"{engine}.log"

    def log_excerpt(self, engine: str) -> dict[str, str]:
        excerpt = {engine: log_tail(self.engine_log(engine), 40)}
        supervisor = Path(self.info.log_dir or ".") / "supervisor.log"
        if supervisor.exists():
            excerpt["supervisor"] = log_tail(supervisor, 10)
        return excerpt

    def stop(self) -> int | None:
        self.set_faults(None)
        if self.process is None or self.process.poll() is not None:
            return None if self.process is None else self.process.returncode
        self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)  # its own session: only what this script started
            return self.process.wait(timeout=30)


class RequestFailed(Exception):
    """A request to one of the pair's engines failed or timed out; ``record`` is kept in the results."""

    def __init__(self, record: dict[str, Any]) -> None:
        super().__init__(record["what"])
        self.record = record
