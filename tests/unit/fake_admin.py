"""A fake Mooncake master admin port for CLI tests: keys, object sizes and a metrics page, and a log
of every request it got (so a test can tell that a command did no I/O)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

METRICS = """# HELP master_key_count Total number of keys
master_key_count 3
master_allocated_bytes 950
master_total_capacity_bytes 1000
master_evicted_key_count 1
master_put_start_failures_total 2
master_put_start_alloc_failures_total 2
"""


class FakeAdmin:
    def __init__(self, url: str) -> None:
        self.url = url
        self.keys: list[str] = []
        self.requests: list[str] = []


@contextmanager
def fake_admin() -> Iterator[FakeAdmin]:
    state: FakeAdmin

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            state.requests.append(self.path)
            if self.path == "/get_all_keys":
                self._answer(200, "".join(f"{key}\n" for key in state.keys))
            elif self.path.startswith("/batch_query_keys?keys="):
                asked = self.path.split("=", 1)[1].split(",")
                data = {key: {"ok": True, "values": [{"size_": 4175}]} for key in asked if key in state.keys}
                self._answer(200, json.dumps({"success": True, "data": data}))
            elif self.path == "/metrics":
                self._answer(200, METRICS)
            else:
                self._answer(404, json.dumps({"success": False}))

        def _answer(self, status: int, body: str) -> None:
            self.send_response(status)
            self.send_header("Content-Length", str(len(body.encode())))
            self.end_headers()
            self.wfile.write(body.encode())

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    state = FakeAdmin(f"http://127.0.0.1:{server.server_address[1]}")
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield state
    finally:
        server.shutdown()
        server.server_close()
