"""A real mooncake_master on loopback for tests, started and stopped by pid."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

LOOPBACK = "127.0.0.1"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((LOOPBACK, 0))
        return sock.getsockname()[1]


def mooncake_master_binary() -> str:
    found = shutil.which("mooncake_master") or str(Path(sys.executable).parent / "mooncake_master")
    if not Path(found).exists():
        pytest.fail("mooncake_master is not installed: run scripts/setup")
    return found


class Master:
    def __init__(self, log_path: Path):
        self.rpc_port, self.admin_port = free_port(), free_port()
        self.address = f"{LOOPBACK}:{self.rpc_port}"
        self.admin = f"http://{LOOPBACK}:{self.admin_port}"
        self.log_path = log_path
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        argv = [
            mooncake_master_binary(),
            f"--rpc_address={LOOPBACK}",
            f"--rpc_port={self.rpc_port}",
            f"--metrics_host={LOOPBACK}",
            f"--metrics_port={self.admin_port}",
            "--enable_http_metadata_server=false",
        ]
        log = open(self.log_path, "ab")
        self.process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                pytest.fail(f"mooncake_master exited: {self.log_path.read_text()[-2000:]}")
            try:
                if httpx.get(f"{self.admin}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        pytest.fail("mooncake_master did not become healthy in 30 s")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None
