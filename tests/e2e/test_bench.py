"""`kvtool bench` end to end, on the session's pair (through --pair and its ready file): the
partial-tail connector reaches the ideal reuse on sub-block and cross-block workloads, with tail
hits, and every consumer answer matches a recomputation."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_bench_on_the_pair_reaches_the_ideal_with_tail_hits(pair, tmp_path):
    if pair.connector != "kvtool":
        pytest.skip("the efficiency bounds are the kvtool connector's")
    ready = tmp_path / "ready.json"
    ready.write_text(json.dumps(pair.to_json()))
    results = tmp_path / "bench.json"
    argv = [sys.executable, "-m", "kvtool.cli", "bench", "--pair", str(ready), "--json", str(results)]
    argv += ["--workload", "sub-block", "--workload", "cross-block", "--requests", "3", "--max-tokens", "4"]
    finished = subprocess.run(argv, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert finished.returncode == 0, finished.stdout + finished.stderr

    document = json.loads(results.read_text())
    summary = document["summary"]
    assert summary["requests"] == 6 and summary["verified"] == 6
    assert summary["mismatches"] == 0, document["mismatches"]
    assert summary["tail_hit_tokens"] > 0
    for name in ("sub-block", "cross-block"):
        workload = document["workloads"][name]
        assert workload["efficiency"] >= 0.99, (name, workload)
    assert document["config"]["seed"] == 0 and document["config"]["workloads"] == ["sub-block", "cross-block"]


def launch_argv(tmp_path: Path, results: Path, *extra: str) -> list[str]:
    """`kvtool bench --launch` on the embedded default, small, on free ports."""
    from kvtool.procs import find_free_port

    argv = [sys.executable, "-m", "kvtool.cli", "bench", "--launch", "--json", str(results), *extra]
    argv += ["--requests", "3", "--max-tokens", "3", "--enforce-eager", "--log-dir", str(tmp_path / "logs")]
    for flag in ("producer", "consumer", "master", "admin", "store"):
        argv += [f"--{flag}-port", str(find_free_port())]
    return argv


def test_bench_launch_starts_its_own_pair_and_stops_it(tmp_path):
    """The project's main job, small: `kvtool bench --launch` on the embedded default."""
    results = tmp_path / "launch.json"
    argv = launch_argv(tmp_path, results)
    finished = subprocess.run(argv, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert finished.returncode == 0, finished.stdout[-3000:] + finished.stderr[-3000:]
    summary = json.loads(results.read_text())["summary"]
    assert summary["mismatches"] == 0 and summary["tail_hit_tokens"] > 0
    assert summary["efficiency"] >= 0.99


def test_an_interleaved_compare_runs_every_pair_at_once_and_stops_them_all(tmp_path):
    """`--compare kvtool,none --interleave`: both pairs up together on ports of their own, every step
    sent to each in turn; the kvtool pair reaches the ideal with exact answers, and nothing is left
    listening once the bench ends."""
    from kvtool.procs import tcp_port_open

    results = tmp_path / "interleaved.json"
    argv = launch_argv(tmp_path, results, "--compare", "kvtool,none", "--interleave", "--quiet-s", "0")
    finished = subprocess.run(argv, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert finished.returncode == 0, finished.stdout[-3000:] + finished.stderr[-3000:]
    document = json.loads(results.read_text())
    assert document["config"]["interleave"] is True
    kvtool, none = (document["connectors"][name] for name in ("kvtool", "none"))
    assert kvtool["summary"]["efficiency"] >= 0.99 and kvtool["summary"]["tail_hit_tokens"] > 0
    assert kvtool["summary"]["mismatches"] == 0 and none["summary"]["mismatches"] == 0
    # Both ran every request of the workload, in the same run.
    assert [r["step"] for r in kvtool["requests"]] == [r["step"] for r in none["requests"]]
    ports = document["pair"]["interleaved_ports"]
    assert set(ports) == {"kvtool", "none"}
    assert ports["kvtool"]["producer_port"] != ports["none"]["producer_port"]
    for pair_ports in ports.values():
        for name in ("producer_port", "consumer_port"):
            assert not tcp_port_open(pair_ports[name]), (name, pair_ports)
