"""An engine whose Mooncake master cannot be reached at start-up serves without the connector's help,
with one warning, instead of failing to start or stalling its start; once the master is up, the engine
connects to it on its own and saves there.

Its master's port is held by a listener that accepts connections and never answers (a frozen master,
or another service on the port): a Mooncake client's setup in the engine's process would hold the GIL
there for up to ten minutes; the connector makes that setup in a child process first."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from kvtool.client import complete, wait_healthy
from kvtool.model import ensure_default_model
from kvtool.procs import find_free_port
from kvtool.store.admin import open_admin
from kvtool.store.master import LocalMaster

from .pairtools import hit_details

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]


class SilentListener:
    """Accepts connections on a port and never answers; closing resets them (no TIME_WAIT left on the
    port, which the master binds next)."""

    def __init__(self, port: int):
        self._server = socket.create_server(("127.0.0.1", port))
        self._server.settimeout(0.2)  # the accept loop looks at the stop flag this often
        self._held: list[socket.socket] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._server.accept()
            except TimeoutError:
                continue
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self._held.append(conn)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._server.close()
        for conn in self._held:
            conn.close()


def _engine(model: str, port: int, master_port: int) -> tuple[list[str], dict[str, str]]:
    """A kv_both engine's command line and environment, its connector pointed at ``master_port``."""
    transfer = {
        "kv_connector": "KVToolConnector",
        "kv_connector_module_path": "connector.connector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"master_server_address": f"127.0.0.1:{master_port}", "connect_timeout_s": 2},
    }
    argv = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--block-size",
        "32",
        "--max-model-len",
        "1024",
        "--dtype",
        "float32",
        "--gpu-memory-utilization",
        "0.2",
        "--enforce-eager",
        "--kv-transfer-config",
        json.dumps(transfer),
    ]
    env = {
        **os.environ,
        "VLLM_HOST_IP": "127.0.0.1",
        "MC_TCP_BIND_ADDRESS": "127.0.0.1",
        "HF_HUB_OFFLINE": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "PYTHONPATH": str(REPO),
    }
    return argv, env


def test_an_unreachable_master_at_start_leaves_the_engine_serving_until_it_comes(tmp_path):
    model = str(ensure_default_model())
    port = find_free_port()
    master = LocalMaster()  # its ports picked, not started: a listener that never answers holds its RPC port
    dead_master = master.rpc_port
    silent = SilentListener(dead_master)
    argv, env = _engine(model, port, dead_master)
    log_path = tmp_path / "engine.log"
    try:
        with open(log_path, "wb") as log:
            engine = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    except BaseException:
        silent.close()
        raise
    try:
        wait_healthy(f"http://127.0.0.1:{port}", timeout_s=300)
        answer = complete(f"http://127.0.0.1:{port}", model, list(range(10, 60)), max_tokens=3)
        assert answer["choices"][0]["finish_reason"]
        assert hit_details(answer).external_hit_tokens == 0
        silent.close()
        master.start()
        # Both engine sides (scheduler and worker) connect, each on its own tries' schedule: a request
        # sent once only one has would be saved by neither.
        deadline = time.monotonic() + 300  # tries back off from 5 s to 60 s
        while log_path.read_text().count("answers now") < 2 and time.monotonic() < deadline:
            time.sleep(1)
        assert log_path.read_text().count("answers now") == 2, "the engine never connected to the master that came up"
        complete(f"http://127.0.0.1:{port}", model, list(range(100, 180)), max_tokens=1)
        deadline = time.monotonic() + 60
        while not [k for k in open_admin(master.admin).keys() if k.startswith("kvtool/")]:
            assert time.monotonic() < deadline, "nothing was saved to the master once connected"
            time.sleep(0.5)
    finally:
        engine.terminate()
        try:
            engine.wait(timeout=60)
        except subprocess.TimeoutExpired:
            engine.kill()
            engine.wait()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(engine.pid, signal.SIGKILL)  # anything of the engine's that outlived it
        silent.close()
        master.stop()
    warnings = [line for line in log_path.read_text().splitlines() if "is unavailable" in line and "kvtool" in line]
    # One from the scheduler side and one from the worker side (both connected later); nothing per request.
    assert len(warnings) == 2, warnings
