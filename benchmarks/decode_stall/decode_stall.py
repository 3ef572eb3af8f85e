"""Decode stall: inter-token latency of running streams while new requests arrive, with a healthy
master and with a frozen one (SIGSTOP), side by side in one run.

Each round starts `--streams` streamed requests on the consumer (long answers, `ignore_eos`). Once
they decode, `--arrivals` new prompts arrive at the consumer, one every `--arrival-gap-s`; in a
"frozen" round the master is SIGSTOPped just before the first arrival and SIGCONTed after the streams
end. Rounds alternate healthy / frozen so that drift on a shared machine hits both alike. Reported per
condition: inter-token gaps of the streams (p50, p99, max) and the new requests' latency and lookup
outcome. Goal (issue 8): p99 with a frozen master within 1.2x of healthy.

    scripts/run python benchmarks/decode_stall/decode_stall.py --out benchmarks/decode_stall/results.json

It launches its own pair (kvtool serve-pair, the tiny model) unless given `--pair READY_FILE` of a pair
whose master it may freeze. Not part of CI.
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
import threading
import time
from pathlib import Path


REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from kvtool import web  # noqa: E402
from kvtool.pair.ready import ReadyFile, read_ready_file  # noqa: E402
from kvtool.procs import find_free_port  # noqa: E402


def start_pair(workdir: Path) -> tuple[subprocess.Popen, dict]:
    ready = workdir / "ready.json"
    argv = [sys.executable, "-m", "kvtool.cli", "serve-pair", "--ready-file", str(ready)]
    argv += ["--log-dir", str(workdir / "logs")]
    for flag in ("producer", "consumer", "master", "admin"):
        argv += [f"--{flag}-port", str(find_free_port())]
    log = open(workdir / "serve-pair.log", "wb")
    process = subprocess.Popen(argv, cwd=REPO, start_new_session=True, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while not ready.exists():
        if process.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"serve-pair did not start; see {workdir / 'serve-pair.log'}")
        time.sleep(1)
    return process, read_ready_file(ready)


def master_pid(info: ReadyFile, ready_file: Path | None) -> int:
    if ready_file is not None:  # serve-pair rewrites it when it restarts the master
        info = read_ready_file(ready_file)
    pid = info.master_pid or info.pids.get("master")
    if not pid:
        raise SystemExit("the pair's ready file names no master pid (a master given with --master?)")
    return int(pid)


def stream(base: str, model: str, tokens: list[int], max_tokens: int, gaps: list[float]) -> None:
    body = {
        "model": model,
        "prompt": tokens,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    last = None
    with web.stream("POST", f"{base}/v1/completions", json=body, timeout=600) as response:
        for line in response.iter_lines():
            if not line.startswith("data:") or "[DONE]" in line:
                continue
            now = time.perf_counter()
            if last is not None:
                gaps.append(now - last)
            last = now


def arrival(base: str, model: str, tokens: list[int]) -> dict:
    started = time.perf_counter()
    body = {"model": model, "prompt": tokens, "max_tokens": 2, "temperature": 0}
    response = web.post(f"{base}/v1/completions", json=body, timeout=600).json()
    details = (response.get("kv_transfer_params") or {}).get("kvtool") or {}
    return {"latency_s": time.perf_counter() - started, "lookup": details.get("lookup")}


ITL_BUCKET = "vllm:inter_token_latency_seconds_bucket"


def itl_buckets(base: str) -> dict[float, float]:
    """The consumer engine's own inter-token latency histogram (cumulative counts by upper bound)."""
    buckets: dict[float, float] = {}
    for line in web.get(f"{base}/metrics", timeout=30).text.splitlines():
        if line.startswith(ITL_BUCKET):
            bound = line.split('le="', 1)[1].split('"', 1)[0]
            buckets[float("inf") if bound == "+Inf" else float(bound)] = float(line.rsplit(" ", 1)[1])
    return buckets


HOOK_PREFIX = "vllm:kvtool_engine_thread_"


def hook_counters(base: str) -> dict[str, float]:
    """The connector's own time on the engine's thread (connector/hooktime.py), summed over both sides."""
    totals: dict[str, float] = {}
    for line in web.get(f"{base}/metrics", timeout=30).text.splitlines():
        if line.startswith(HOOK_PREFIX) and "_total" in line.split(" ", 1)[0]:
            name = line.split("{", 1)[0].split(" ", 1)[0].removeprefix(HOOK_PREFIX).removesuffix("_total")
            totals[name] = totals.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return totals


def run_round(info: ReadyFile, args, rng: random.Random, frozen: bool, pid_of_master) -> dict:
    base, model = info.consumer, info.model
    before = itl_buckets(base)
    hooks_before = hook_counters(base)
    gaps: list[float] = []
    threads = [
        threading.Thread(
            target=stream,
            args=(base, model, [rng.randrange(10, 900) for _ in range(40)], args.stream_tokens, gaps),
        )
        for _ in range(args.streams)
    ]
    for thread in threads:
        thread.start()
    time.sleep(args.warmup_s)  # the streams are decoding
    pid = pid_of_master()
    arrivals = []
    if frozen:
        os.kill(pid, signal.SIGSTOP)
    try:
        for _ in range(args.arrivals):
            arrivals.append(arrival(base, model, [rng.randrange(10, 900) for _ in range(args.arrival_tokens)]))
            time.sleep(args.arrival_gap_s)
        for thread in threads:
            thread.join()
    finally:
        if frozen:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass  # serve-pair found it frozen and replaced it
    after = itl_buckets(base)
    engine = {bound: after[bound] - before.get(bound, 0.0) for bound in after}
    hooks_after = hook_counters(base)
    hooks = {name: value - hooks_before.get(name, 0.0) for name, value in hooks_after.items()}
    return {"frozen": frozen, "gaps": gaps, "arrivals": arrivals, "engine_itl": engine, "hooks": hooks}


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def bucket_quantile(cumulative: dict[float, float], q: float) -> float:
    """The upper bound of the histogram bucket holding quantile ``q`` (seconds)."""
    total = cumulative.get(float("inf"), 0.0)
    for bound in sorted(cumulative):
        if total and cumulative[bound] >= q * total:
            return bound
    return float("nan")


def summarize(rounds: list[dict], frozen: bool) -> dict:
    gaps = [g for r in rounds if r["frozen"] == frozen for g in r["gaps"]]
    arrivals = [a for r in rounds if r["frozen"] == frozen for a in r["arrivals"]]
    lookups: dict[str, int] = {}
    for a in arrivals:
        label = (a["lookup"] or "none").split(":")[0]
        lookups[label] = lookups.get(label, 0) + 1
    engine: dict[float, float] = {}
    for r in rounds:
        if r["frozen"] == frozen:
            for bound, count in r["engine_itl"].items():
                engine[bound] = engine.get(bound, 0.0) + count
    return {
        "master": "frozen" if frozen else "healthy",
        "tokens": len(gaps),
        # The engine's own histogram (vLLM's vllm:inter_token_latency_seconds): bucket upper bounds.
        "engine_itl_ms_p50_at_most": round(bucket_quantile(engine, 0.5) * 1e3, 2),
        "engine_itl_ms_p99_at_most": round(bucket_quantile(engine, 0.99) * 1e3, 2),
        # The bucket holding the engine's worst inter-token latency (its upper bound).
        "engine_itl_ms_max_at_most": round(bucket_quantile(engine, 1.0) * 1e3, 2),
        "engine_itl_samples": int(engine.get(float("inf"), 0)),
        # As the client sees it: gaps between stream chunks (vLLM coalesces chunks of a slow reader).
        "itl_ms_p50": round(quantile(gaps, 0.5) * 1e3, 2),
        "itl_ms_p99": round(quantile(gaps, 0.99) * 1e3, 2),
        "itl_ms_max": round(max(gaps) * 1e3, 2) if gaps else None,
        # The connector's hooks on the consumer engine's threads (scheduler and worker side).
        "connector_engine_thread_ms": round(
            sum(r["hooks"].get("us", 0.0) for r in rounds if r["frozen"] == frozen) / 1e3, 1
        ),
        "connector_hook_calls": int(sum(r["hooks"].get("calls", 0.0) for r in rounds if r["frozen"] == frozen)),
        "connector_slow_hook_calls": int(
            sum(r["hooks"].get("slow_calls", 0.0) for r in rounds if r["frozen"] == frozen)
        ),
        "arrivals": len(arrivals),
        "arrival_latency_s_max": round(max(a["latency_s"] for a in arrivals), 3) if arrivals else None,
        "arrival_lookups": lookups,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pair", type=Path, help="ready file of a running pair (default: launch one)")
    parser.add_argument("--rounds", type=int, default=6, help="rounds in all, alternating healthy and frozen")
    parser.add_argument("--streams", type=int, default=2)
    parser.add_argument("--stream-tokens", type=int, default=600)
    parser.add_argument("--arrivals", type=int, default=6)
    parser.add_argument("--arrival-tokens", type=int, default=50)
    parser.add_argument("--arrival-gap-s", type=float, default=0.3)
    parser.add_argument("--warmup-s", type=float, default=0.5)
    parser.add_argument("--settle-s", type=float, default=3.0, help="pause after a frozen round (breaker back-off)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    process = None
    workdir = Path(tempfile.mkdtemp(prefix="kvtool-stall-"))
    if args.pair is None:
        process, info = start_pair(workdir)
        ready_file = workdir / "ready.json"
    else:
        info, ready_file = read_ready_file(args.pair), args.pair
    try:
        rng = random.Random(args.seed)
        # Warm up: the first mixed batches compile kernels; neither condition should pay for that.
        run_round(
            info, argparse.Namespace(**{**vars(args), "arrivals": 2}), rng, False, lambda: master_pid(info, ready_file)
        )
        rounds = []
        for index in range(args.rounds):
            frozen = index % 2 == 1
            rounds.append(run_round(info, args, rng, frozen, lambda: master_pid(info, ready_file)))
            print(json.dumps(summarize(rounds[-1:], frozen)), flush=True)
            if frozen:
                time.sleep(args.settle_s)
        healthy, frozen = summarize(rounds, False), summarize(rounds, True)
        ratio = frozen["itl_ms_p99"] / healthy["itl_ms_p99"] if healthy["itl_ms_p99"] else float("nan")
        engine_ratio = (
            frozen["engine_itl_ms_p99_at_most"] / healthy["engine_itl_ms_p99_at_most"]
            if healthy["engine_itl_ms_p99_at_most"]
            else float("nan")
        )
        report = {
            "command": " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
            "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "pair": {k: getattr(info, k) for k in ("model", "block_size", "connector", "store")},
            "healthy": healthy,
            "frozen": frozen,
            "p99_ratio_frozen_over_healthy": round(ratio, 3),
            "max_gap_ratio_frozen_over_healthy": round(frozen["itl_ms_max"] / healthy["itl_ms_max"], 3)
            if healthy["itl_ms_max"]
            else None,
            "engine_p99_ratio_frozen_over_healthy": round(engine_ratio, 3),
            "goal": "p99 and worst-gap ratios <= 1.2; no slow connector hook call",
        }
        keys = (
            "healthy",
            "frozen",
            "p99_ratio_frozen_over_healthy",
            "max_gap_ratio_frozen_over_healthy",
            "engine_p99_ratio_frozen_over_healthy",
        )
        print(json.dumps({k: report[k] for k in keys}, indent=2))
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(report, indent=2) + "\n")
    finally:
        if process is not None:
            os.killpg(process.pid, signal.SIGTERM)
            process.wait(timeout=120)


if __name__ == "__main__":
    main()
