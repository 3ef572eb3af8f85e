"""vLLM's router's worker list changed while it serves (kvtool.pair.router.RouterWorkers), against the
real ``vllm-router`` with two small HTTP servers as its engines: one taken out, put back, and an
engine that does not answer never added."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator

import pytest

from kvtool.procs import LOOPBACK, ProcessSet, ReadinessCheck, find_free_port
from kvtool.pair.router import RouterWorkers, router_binary


class _Engine(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # /health, /v1/models: 200 with an empty object
        body = b"{}"
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_args: object) -> None:
        pass


@pytest.fixture
def engines() -> Iterator[list[str]]:
    servers = [http.server.ThreadingHTTPServer((LOOPBACK, 0), _Engine) for _ in range(2)]
    for server in servers:
        threading.Thread(target=server.serve_forever, daemon=True).start()
    yield [f"http://{LOOPBACK}:{server.server_address[1]}" for server in servers]
    for server in servers:
        server.shutdown()
        server.server_close()


@pytest.fixture
def router(engines, tmp_path) -> Iterator[RouterWorkers]:
    port = find_free_port()
    argv = [router_binary(), "--host", LOOPBACK, "--port", str(port), "--worker-urls", *engines]
    argv += ["--policy", "round_robin", "--prometheus-host", LOOPBACK, "--prometheus-port", str(find_free_port())]
    procs = ProcessSet(tmp_path)
    url = f"http://{LOOPBACK}:{port}"
    procs.wait_ready([procs.start("router", argv, readiness=ReadinessCheck(http_url=f"{url}/health"))], 60)
    yield RouterWorkers(url)
    procs.stop_all(grace_s=5)


def test_an_engine_taken_out_is_not_listed_until_put_back(router, engines):
    assert router.urls() == set(engines)
    assert router.remove(engines[1])
    assert router.urls() == {engines[0]}
    assert router.add(engines[1])
    assert router.urls() == set(engines)


def test_an_engine_that_does_not_answer_is_not_added(router, engines):
    dead = f"http://{LOOPBACK}:{find_free_port()}"
    assert RouterWorkers(router.url, timeout_s=2.0).add(dead) is False  # the router waits on its health
    assert router.urls() == set(engines)


def test_a_router_that_is_not_there_answers_false_and_none():
    gone = RouterWorkers(f"http://{LOOPBACK}:{find_free_port()}", timeout_s=2.0)
    assert gone.add("http://127.0.0.1:1") is False and gone.remove("http://127.0.0.1:1") is False
    assert gone.urls() is None
