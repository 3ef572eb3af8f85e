"""vLLM's router in front of a fleet's engines: its binary, its command line, its health check.

The router (PyPI ``vllm-router``, a Rust load balancer from the vLLM project; ``scripts/setup`` installs
it) sends each request to one engine by its policy. kvtool starts it once every engine is healthy, so it
never routes a request to an engine still starting, and supervises it like the master: restarted on
its own ports when it dies or stops answering. It takes an engine that stops answering its health
check out of the rotation (``HEALTH_INTERVAL_S`` times ``HEALTH_FAILURES``), and retries a request
that could not reach an engine on another one.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import httpx

from kvtool import web
from kvtool.errors import UserError
from kvtool.pair.config import ServePairConfig
from kvtool.procs import LOOPBACK, ReadinessCheck

ROUTER_LABEL = "vLLM's router (vllm-router)"
ROUTER_PROCESS = "router"  # its name among the fleet's processes (and in the ready file's pids)
HEALTH_INTERVAL_S = 1  # the router's health checks of each engine
HEALTH_FAILURES = 2  # failed in a row: the engine is out of the rotation until it passes again
HEALTH_TIMEOUT_S = 5  # one check; a busy CPU engine answers /health within it


def router_binary() -> str:
    """The ``vllm-router`` launcher beside this Python (the venv's), else on PATH; a UserError otherwise."""
    beside = Path(sys.executable).parent / "vllm-router"
    if beside.is_file():
        return str(beside)
    found = shutil.which("vllm-router")
    if found is None:
        raise UserError(
            "vllm-router is not installed, and a fleet (--engines) needs it; run scripts/setup, or "
            "pip install vllm-router==0.1.17"
        )
    return found


def router_argv(cfg: ServePairConfig, binary: str) -> list[str]:
    """The router's command line: bound to 127.0.0.1, every engine a worker, the fleet's policy."""
    workers = [f"http://{LOOPBACK}:{cfg.port(name)}" for name in cfg.engine_names]
    return [
        binary,
        "--host",
        LOOPBACK,
        "--port",
        str(cfg.router_port),
        "--worker-urls",
        *workers,
        "--policy",
        cfg.router_policy,
        "--prometheus-host",
        LOOPBACK,
        "--prometheus-port",
        str(cfg.router_metrics_port),
        "--health-check-interval-secs",
        str(HEALTH_INTERVAL_S),
        "--health-failure-threshold",
        str(HEALTH_FAILURES),
        "--health-check-timeout-secs",
        str(HEALTH_TIMEOUT_S),
        "--log-level",
        "warning",
        *_kv_event_sources(cfg),
    ]


def _kv_event_sources(cfg: ServePairConfig) -> list[str]:
    """kv_aware: each engine's KV event publisher, the block size its events count in, one model."""
    if not cfg.publishes_kv_events:
        return []
    argv = []
    for name in cfg.engine_names:
        argv += ["--kv-event-source", f"{cfg.base_url(name)}={cfg.kv_events_endpoint(name)}"]
    return [*argv, "--kv-event-block-size", str(cfg.effective_block_size), "--kv-event-model", str(cfg.model)]


def router_readiness(cfg: ServePairConfig) -> ReadinessCheck:
    """The router answers ``/health`` once it serves (it checked its workers at start)."""
    return ReadinessCheck(http_url=f"{cfg.router_url}/health")


class RouterWorkers:
    """The router's worker list, changed while it serves (its ``/add_worker``, ``/remove_worker`` and
    ``/list_workers``): a fleet's engine is taken out of the rotation the moment it ends, not after
    the health checks notice, and put back only once kvtool says it may serve (``kvtool.pair.members``).
    Every call answers True or False (a router that does not answer is said by the caller): the
    router's own health checks stay the fallback."""

    def __init__(self, router_url: str, timeout_s: float = 10.0) -> None:
        self.url = router_url
        self.timeout_s = timeout_s

    def add(self, engine_url: str) -> bool:
        return self._post("add_worker", engine_url)

    def remove(self, engine_url: str) -> bool:
        return self._post("remove_worker", engine_url)

    def urls(self) -> set[str] | None:
        """The workers the router routes to now; None when it does not answer."""
        try:
            response = web.get(f"{self.url}/list_workers", timeout=self.timeout_s)
            return set(response.json()["urls"]) if response.status_code == 200 else None
        except (httpx.HTTPError, ValueError, KeyError, TypeError):
            return None

    def _post(self, path: str, engine_url: str) -> bool:
        try:
            response = web.post(f"{self.url}/{path}", params={"url": engine_url}, timeout=self.timeout_s)
        except httpx.HTTPError:
            return False
        return response.status_code == 200
