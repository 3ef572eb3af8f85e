"""How long a restarted Mooncake master refuses puts for "no space" before an engine's segment is
mounted on it again (issue 41), as the connector's store client sees it.

A loopback master, one client lending a segment (as an engine does, ``global_segment_size``), a put
every ``--poll-ms``; the master is killed (SIGKILL) and started again on the same ports, ``--runs``
times. Per run: seconds from the kill until the new master answers its health check, until the
client's calls answer again (no RPC failure), and until a put is taken; the puts refused for space
meanwhile (what the connector now counts as ``not_ready``) and those that failed outright.

    scripts/run python benchmarks/master-restart/not_ready_window.py --runs 5 \
        --output benchmarks/master-restart/window.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from connector.calls import StoreError  # noqa: E402
from connector.config import load_config  # noqa: E402
from connector.store.store import PutOutcome, open_store  # noqa: E402
from kvtool.procs import http_ok  # noqa: E402
from kvtool.store.master import LocalMaster  # noqa: E402


def one_run(master: LocalMaster, store, poll_s: float, number: int, limit_s: float) -> dict:
    assert store.put(f"warm/{number}", b"x" * 4096) is PutOutcome.STORED, "the put before the kill failed"
    os.kill(master.pid, signal.SIGKILL)
    killed = time.monotonic()
    master.process.wait(timeout=10)
    master.start()  # the same ports (LocalMaster keeps them)
    marks: dict[str, float] = {}
    refused = failed = 0
    while time.monotonic() - killed < limit_s:
        now = time.monotonic() - killed
        if "healthy" not in marks and http_ok(master.admin + "/health", timeout=0.5):
            marks["healthy"] = now
        try:
            outcome = store.put(f"after/{number}/{now:.3f}", b"y" * 4096)
        except StoreError:
            outcome = PutOutcome.FAILED
        if outcome is PutOutcome.STORED:
            marks["stored"] = now
            break
        if outcome is PutOutcome.NO_SPACE:
            marks.setdefault("answers", now)
            refused += 1
        else:
            failed += 1
        time.sleep(poll_s)
    return {"seconds": {k: round(v, 3) for k, v in marks.items()}, "refused_no_space": refused, "failed": failed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--poll-ms", type=float, default=20.0)
    parser.add_argument("--segment-mib", type=int, default=64)
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    master = LocalMaster().start()
    config = {"master_server_address": master.address, "global_segment_size": args.segment_mib << 20}
    store = open_store(load_config(config))
    runs = []
    try:
        for number in range(args.runs):
            runs.append(one_run(master, store, args.poll_ms / 1000, number, limit_s=60.0))
            print(json.dumps(runs[-1]), flush=True)
    finally:
        store.close()
        master.stop()
    stored = [run["seconds"]["stored"] for run in runs if "stored" in run["seconds"]]
    window = [
        run["seconds"]["stored"] - run["seconds"].get("answers", run["seconds"]["stored"])
        for run in runs
        if "stored" in run["seconds"]
    ]
    result = {
        "benchmark": "master-restart/not_ready_window",
        "config": {**vars(args), "output": str(args.output) if args.output else None},
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "commit": subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip(),
        "runs": runs,
        "summary": {
            "kill_to_put_taken_s_median": round(statistics.median(stored), 3) if stored else None,
            "kill_to_put_taken_s_max": round(max(stored), 3) if stored else None,
            "no_space_window_s_median": round(statistics.median(window), 3) if window else None,
            "no_space_window_s_max": round(max(window), 3) if window else None,
        },
    }
    print(json.dumps(result["summary"]))
    if args.output:
        args.output.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
