"""Soak run: thousands of mixed requests on a real pair with store faults injected at random.

Every iteration publishes a prompt through the producer (max_tokens=1), then sends a continuation
to the consumer and compares its answer with a full recomputation (tokens and top-5 logprobs). A
fault plan, drawn at random, is active for part of the iterations (see connector/faults.py). It
reports requests served, faults by kind, mismatches and hangs (a request or a save that does not end
within its time-out). Expected: 0 mismatches, 0 hangs.

    scripts/run python benchmarks/soak/soak.py --iterations 1000 --seed 1 --out benchmarks/soak/results.json

Not part of CI: it runs for several minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from kvtool.admin import wait_for_key  # noqa: E402
from kvtool.client import complete  # noqa: E402
from kvtool.errors import ServerError  # noqa: E402
from kvtool.procs import find_free_port  # noqa: E402
from kvtool.verify import DEFAULT_LOGPROB_TOLERANCE, compare_answers  # noqa: E402

# Fault kinds and their plans (connector/faults.py). Put faults spare watermark records ("w"), so a
# save always ends visibly; a full store for the tail alone is the partial-tail case.
FAULTS: dict[str, dict] = {
    "corrupt_flip": {"corrupt_get": "flip"},
    "corrupt_truncate": {"corrupt_get": "truncate"},
    "corrupt_namespace": {"corrupt_get": "namespace"},
    "load_finds_nothing": {"fail_get": True},
    "lookup_fails": {"fail_exists": True},
    "store_full_tail": {"put_outcome": "no_space", "put_kinds": ["t"]},
    "puts_fail": {"put_outcome": "failed", "put_kinds": ["b", "t"]},
    "save_in_flight": {"put_delay_s": 0.05},
    "slow_store": {"delay_s": 2.5},  # past the 2 s lookup time-out
}
FAULT_WEIGHTS = {"slow_store": 0.2}  # slow faults cost seconds each; draw them less often
REQUEST_TIMEOUT_S = 60.0
SAVE_TIMEOUT_S = 30.0


def start_pair(workdir: Path, fault_file: Path) -> tuple[subprocess.Popen, dict]:
    ready = workdir / "ready.json"
    argv = [
        sys.executable,
        "-m",
        "kvtool.cli",
        "serve-pair",
        "--ready-file",
        str(ready),
        "--log-dir",
        str(workdir / "logs"),
    ]
    for flag in ("producer", "consumer", "master", "admin"):
        argv += [f"--{flag}-port", str(find_free_port())]
    env = {**os.environ, "KVTOOL_FAULT_CONTROL_FILE": str(fault_file)}
    process = subprocess.Popen(
        argv,
        cwd=REPO,
        env=env,
        start_new_session=True,
        stdout=open(workdir / "serve-pair.log", "wb"),
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 300
    while not ready.exists():
        if process.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"serve-pair did not start; see {workdir / 'serve-pair.log'}")
        time.sleep(0.5)
    return process, json.loads(ready.read_text())


def set_faults(fault_file: Path, plan: dict | None) -> None:
    if plan is None:
        fault_file.unlink(missing_ok=True)
        return
    staging = fault_file.with_suffix(".tmp")
    staging.write_text(json.dumps(plan))
    os.replace(staging, fault_file)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=1000)
    parser.add_argument("--fault-rate", type=float, default=0.4, help="share of iterations run under a fault")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "soak" / "results.json")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    workdir = Path(tempfile.mkdtemp(prefix="kvtool-soak-"))
    fault_file = workdir / "faults.json"
    process, pair = start_pair(workdir, fault_file)
    model = pair["model"]
    requests = Counter()
    faults = Counter()
    outcomes = Counter()
    mismatches: list[dict] = []
    hangs: list[dict] = []
    published: list[list[int]] = []
    started = time.monotonic()
    extra = {"return_tokens_as_token_ids": True}
    try:
        for iteration in range(args.iterations):
            kind = None
            if rng.random() < args.fault_rate:
                kinds = list(FAULTS)
                kind = rng.choices(kinds, weights=[FAULT_WEIGHTS.get(k, 1.0) for k in kinds])[0]
                faults[kind] += 1
            # Half the prompts extend one published before (hits across blocks and tails).
            if published and rng.random() < 0.5:
                base = list(rng.choice(published))
                base += [rng.randrange(10, 900) for _ in range(rng.randrange(0, 40))]
            else:
                base = [rng.randrange(10, 900) for _ in range(rng.randrange(2, 140))]
            continuation = base + [rng.randrange(10, 900) for _ in range(rng.randrange(1, 20))]
            set_faults(fault_file, FAULTS[kind] if kind else None)
            try:
                answer = complete(pair["producer"], model, base, max_tokens=1, timeout_s=REQUEST_TIMEOUT_S)
                requests["producer"] += 1
                details = answer["kv_transfer_params"]["kvtool"]
                if details["watermark_key"] and not wait_for_key(
                    pair["admin"], details["watermark_key"], SAVE_TIMEOUT_S
                ):
                    hangs.append({"iteration": iteration, "fault": kind, "what": "save did not end"})
                published.append(base)
                reused = complete(
                    pair["consumer"],
                    model,
                    continuation,
                    max_tokens=4,
                    logprobs=5,
                    extra=extra,
                    timeout_s=REQUEST_TIMEOUT_S,
                )
                requests["consumer"] += 1
                set_faults(fault_file, None)
                reference = complete(
                    pair["consumer"],
                    model,
                    continuation,
                    max_tokens=4,
                    logprobs=5,
                    prompt_logprobs=1,
                    extra=extra,
                    timeout_s=REQUEST_TIMEOUT_S,
                )
                requests["reference"] += 1
            except ServerError as exc:
                set_faults(fault_file, None)
                kind_of_failure = "timed out" if "timed out" in str(exc).lower() else "error"
                hangs.append({"iteration": iteration, "fault": kind, "what": f"request {kind_of_failure}: {exc}"})
                continue
            comparison = compare_answers(reused, reference, DEFAULT_LOGPROB_TOLERANCE)
            hit = reused["kv_transfer_params"]["kvtool"]
            outcomes["hit" if hit["external_hit_tokens"] else "miss"] += 1
            if hit["load_failure"]:
                outcomes[f"load_failed_{hit['load_failure']}"] += 1
            if not comparison.matches:
                mismatches.append({"iteration": iteration, "fault": kind, "reason": comparison.reason})
            if iteration % 100 == 0:
                print(f"{iteration}/{args.iterations} mismatches={len(mismatches)} hangs={len(hangs)}", flush=True)
    finally:
        set_faults(fault_file, None)
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=120)
    result = {
        "command": " ".join(["python", "benchmarks/soak/soak.py", *sys.argv[1:]]),
        "config": {
            "iterations": args.iterations,
            "fault_rate": args.fault_rate,
            "seed": args.seed,
            "model": model,
            "block_size": pair["block_size"],
            "hash_unit": pair["hash_unit"],
            "logprob_tolerance": DEFAULT_LOGPROB_TOLERANCE,
            "fault_plans": FAULTS,
        },
        "requests_served": dict(requests),
        "requests_total": sum(requests.values()),
        "faults_injected": dict(faults),
        "consumer_outcomes": dict(outcomes),
        "mismatches": len(mismatches),
        "hangs": len(hangs),
        "mismatch_list": mismatches,
        "hang_list": hangs,
        "wall_s": round(time.monotonic() - started, 1),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("requests_total", "faults_injected", "mismatches", "hangs", "wall_s")}))


if __name__ == "__main__":
    main()
