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
    if pair["connector"] != "kvtool":
        pytest.skip("the efficiency bounds are the kvtool connector's")
    ready = tmp_path / "ready.json"
    ready.write_text(json.dumps(pair))
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


def test_bench_launch_starts_its_own_pair_and_stops_it(tmp_path):
    """The project's main job, small: `kvtool bench --launch` on the embedded default."""
    from kvtool.pair.procs import find_free_port

    results = tmp_path / "launch.json"
    argv = [
        sys.executable,
        "-m",
        "kvtool.cli",
        "bench",
        "--launch",
        "--json",
        str(results),
        "--requests",
        "3",
        "--max-tokens",
        "3",
        "--enforce-eager",
        "--log-dir",
        str(tmp_path / "logs"),
    ]
    for flag in ("producer", "consumer", "master", "admin"):
        argv += [f"--{flag}-port", str(find_free_port())]
    finished = subprocess.run(argv, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert finished.returncode == 0, finished.stdout[-3000:] + finished.stderr[-3000:]
    summary = json.loads(results.read_text())["summary"]
    assert summary["mismatches"] == 0 and summary["tail_hit_tokens"] > 0
    assert summary["efficiency"] >= 0.99
