"""The bench's durability wait against a fake master admin: the kvtool signal, and the key-count fallback."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from kvtool.bench.durability import Durability
from kvtool.pair.ready import ReadyFile


class FakeAdmin(BaseHTTPRequestHandler):
    keys: set[str] = set()
    key_counts: list[int] = []

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        if self.path.startswith("/query_key?key="):
            found = self.path.split("=", 1)[1] in self.keys
            self._answer(200 if found else 404, json.dumps({"success": found}))
        elif self.path == "/metrics":
            count = self.key_counts.pop(0) if len(self.key_counts) > 1 else self.key_counts[0]
            self._answer(200, f"master_key_count {count}\n")
        else:
            self._answer(404, "")

    def _answer(self, status: int, body: str) -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body.encode())

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def admin_url():
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeAdmin)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def pair(admin: str, connector: str) -> ReadyFile:
    return ReadyFile(
        producer="p",
        consumer="c",
        admin=admin,
        model="m",
        block_size=32,
        hash_unit=1,
        max_model_len=64,
        connector=connector,
    )


def test_kvtool_waits_for_the_last_saved_key(admin_url):
    FakeAdmin.keys = {"kvtool/2/ns/0/t/20/abc"}
    durability = Durability(pair(admin_url, "kvtool"), timeout_s=2.0)
    assert durability.wait() is None  # nothing published yet
    saved = durability.published({"kv_transfer_params": {"kvtool": {"prompt_tokens": 20, "lookup": "miss", **SAVED}}})
    assert saved == 1
    _, timed_out = durability.wait()
    assert not timed_out  # the key was there: it ended on the signal, not on the time-out
    assert durability.wait() is None


SAVED = {"save_last_key": "kvtool/2/ns/0/t/20/abc", "save_objects": 1}


def test_a_key_that_never_appears_is_a_counted_timeout(admin_url):
    FakeAdmin.keys = set()
    durability = Durability(pair(admin_url, "kvtool"), timeout_s=0.3)
    details = {"prompt_tokens": 40, "lookup": "miss", "save_last_key": "kvtool/2/ns/0/b/32/x", "save_objects": 1}
    durability.published({"kv_transfer_params": {"kvtool": details}})
    assert durability.wait()[1] is True


def test_without_a_signal_it_waits_for_the_key_count_to_go_quiet(admin_url):
    FakeAdmin.key_counts = [3, 4, 5, 5]
    durability = Durability(pair(admin_url, "vllm-mooncake-store"), timeout_s=30.0)
    assert durability.published({"choices": []}) is None
    _, timed_out = durability.wait()
    assert not timed_out
    assert FakeAdmin.key_counts == [5]  # it read the count until it stopped changing


def test_no_connector_has_nothing_to_wait_for(admin_url):
    durability = Durability(pair(None, "none"), timeout_s=1.0)
    durability.published({"choices": []})
    assert durability.wait() is None
