"""Fixtures that run a real producer/consumer pair through `kvtool serve-pair`.

The pair starts once per session (about a minute on two cores) on free ports; serve-pair starts and
supervises its Mooncake master too (the ready file names its admin URL and current pid). Set
KVTOOL_E2E_CONNECTOR / KVTOOL_E2E_STORE to run the suite against another configuration, and
KVTOOL_E2E_ATTENTION_BACKEND on a GPU (vLLM's --attention-backend: the connector needs it named there).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtool.procs import find_free_port, log_tail
from kvtool.pair.ready import read_ready_file

from .pairtools import PairMaster, RunningPair

READY_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 60.0
REPO_ROOT = Path(__file__).resolve().parents[2]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.e2e)


class HybridPairsLast:
    """Runs the tests of the hybrid pairs last: pytest keeps a parametrized session fixture's last pair
    up until the session ends, and the mamba pair beside the session's tiny pair and a later module's
    own pair (tensor parallelism's four workers) came within reach of the machine's 24 GiB, where the
    OOM killer took an engine's worker. A plugin of its own, so that only the reordering runs after
    pytest's (which groups the tests by fixture parameter), the e2e marking before ``-m`` selects."""

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        hybrid = [item for item in items if "hybrid" in getattr(item, "fixturenames", ())]
        items[:] = [item for item in items if "hybrid" not in getattr(item, "fixturenames", ())] + hybrid


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(HybridPairsLast(), "kvtool-hybrid-pairs-last")


def _log_tails(log_dir: Path) -> str:
    parts = []
    for log in sorted(log_dir.glob("*.log")):
        parts.append(f"--- {log} ---\n{log_tail(log, 25)}")
    return "\n".join(parts)


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)  # serve-pair stops its children in order, then exits
    try:
        process.wait(timeout=STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=10)


# pytest retries a failed fixture for every test that asks for it; one failed start per preset is enough.
_start_failures: dict[str, str] = {}


@contextlib.contextmanager
def running_pair(
    workdir: Path, preset: str = "tiny", roles: str = "pd", extra_args: tuple[str, ...] = (), label: str | None = None
) -> Iterator[RunningPair]:
    """A serve-pair on free ports for ``preset``'s generated model, until the block ends: its typed ready
    file (kvtool/pair/ready.py), as first written, with ``ready_file`` (serve-pair rewrites it when it
    restarts the master), ``fault_control_file`` and ``preset``."""
    name = label or f"{preset}/{roles}"
    if name in _start_failures:
        pytest.fail(f"serve-pair failed to start earlier in this session:\n{_start_failures[name]}", pytrace=False)
    ready_file = workdir / "ready.json"
    log_dir = workdir / "logs"
    log_dir.mkdir()
    ports = {flag: find_free_port() for flag in ("producer", "consumer", "store", "master", "admin")}
    argv = [
        sys.executable,
        "-m",
        "kvtool.cli",
        "serve-pair",
        "--ready-file",
        str(ready_file),
        "--log-dir",
        str(log_dir),
        # The CPU demo's pair config, as an operator starts it; the flags below (ports, preset, roles) win.
        "--config",
        str(REPO_ROOT / "configs" / "cpu-demo" / "pair.toml"),
        "--model-preset",
        preset,
        "--connector",
        os.environ.get("KVTOOL_E2E_CONNECTOR", "kvtool"),
        "--store",
        os.environ.get("KVTOOL_E2E_STORE", "embedded"),
        "--roles",
        roles,
        *extra_args,
    ]
    if os.environ.get("KVTOOL_E2E_ATTENTION_BACKEND"):  # on a GPU (benchmarks/gpu/run.sh)
        argv += ["--attention-backend", os.environ["KVTOOL_E2E_ATTENTION_BACKEND"]]
    for flag, port in ports.items():
        argv += [f"--{flag}-port", str(port)]
    # The engines' connectors read a fault plan from this file while they run (absent: no faults);
    # the fault suite writes it and removes it again.
    fault_control = workdir / "faults.json"
    argv += ["--fault-control-file", str(fault_control)]
    with open(log_dir / "serve-pair.log", "wb") as own_log:
        process = subprocess.Popen(
            argv, stdout=own_log, stderr=subprocess.STDOUT, cwd=REPO_ROOT, start_new_session=True
        )
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not ready_file.exists():
            problem = None
            if process.poll() is not None:
                problem = f"serve-pair exited with code {process.returncode} before it was ready"
            elif time.monotonic() > deadline:
                problem = f"serve-pair was not ready after {READY_TIMEOUT_S:.0f} s"
            if problem is not None:
                _start_failures[name] = f"{problem}\n{_log_tails(log_dir)}"
                pytest.fail(_start_failures[name], pytrace=False)
            time.sleep(0.5)
        ready = read_ready_file(ready_file)  # the contract serve-pair writes (kvtool/pair/ready.py)
        yield RunningPair(
            **ready.model_dump(), ready_file=str(ready_file), fault_control_file=str(fault_control), preset=preset
        )
    finally:
        _stop(process)


@pytest.fixture(scope="session")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningPair]:
    """The session's pair on the tiny model (see running_pair)."""
    with running_pair(tmp_path_factory.mktemp("pair")) as info:
        yield info


@pytest.fixture(scope="session", params=["swa", "mamba"])
def hybrid(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningPair]:
    """One pair per hybrid preset for the whole session (pytest runs every test of one before the
    other's): both engines kv_both, saving their answers (--roles both), with a pointer at every token
    (--divergence-grid 1). ``swa`` (sliding window 64 + full attention) prefills in chunks of 64 tokens,
    so a long prompt's first blocks leave the window before its last chunk; ``mamba`` (Mamba2 +
    attention) runs the preset's flags (chunks of one Mamba block, L - 1 states on saving engines)."""
    extra: tuple[str, ...] = ("--divergence-grid", "1")
    if request.param == "swa":
        extra += ("--max-num-batched-tokens", "64")
    workdir = tmp_path_factory.mktemp(f"hybrid-{request.param}")
    with running_pair(workdir, request.param, roles="both", extra_args=extra) as info:
        yield info


@pytest.fixture
def pair_master(pair: RunningPair) -> PairMaster:
    """The master serve-pair runs and supervises: its admin URL, and its current pid from the ready file."""
    if pair.master_pid is None:
        pytest.skip("this pair runs no Mooncake master of its own")
    return PairMaster(pair)
