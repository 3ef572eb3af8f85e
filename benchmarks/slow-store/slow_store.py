"""A store that turns slow, then quick again, under a real pair: TTFT of new requests over time beside
a healthy miss, with the moment the store was bypassed and the moment it was used again (issue 38).

One ``kvtool serve-pair`` (``--model-preset bench`` by default, roles ``pd``), its connectors' fault
plan file driving every store call's delay (``connector/faults.py``: ``delay_s``, on both engines).
For each delay (``--delays``, seconds): healthy misses first (the baseline, new prompts), then the
store slowed and ``--slow-requests`` new prompts one after another, then the store quick again and
``--recovery-requests`` rounds of publish (producer, waited until durable or given up) and consume (the
same prompt extended): the first consumer hit marks the store used again. Every consumer request is
checked for its outcome (the hit details' lookup: a miss, bypassed, given up, or a hit). Written: per
request its phase, TTFT (ms), lookup outcome and reused tokens; per delay the healthy miss p50, the
slow phase's TTFT against it, the request index where the store was first bypassed and where hits
came back; and the configuration.

    scripts/run python benchmarks/slow-store/slow_store.py --out benchmarks/slow-store/results.json
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # benchmarks/: soak.pair, fast-path's published
sys.path.insert(0, str(HERE.parent / "fast-path"))

from published import provenance, write_result  # noqa: E402
from soak.pair import Pair  # noqa: E402

from connector.core.hits import HitDetails  # noqa: E402
from kvtool.client import complete  # noqa: E402
from kvtool.errors import ServerError  # noqa: E402
from kvtool.pair.ready import ReadyFile  # noqa: E402
from kvtool.store.admin import open_admin, wait_for_key  # noqa: E402


def ask(info: ReadyFile, engine: str, tokens: list[int]) -> dict[str, Any]:
    """One request, max_tokens 1 (its latency is its TTFT); what it reused and how its lookup went."""
    started = time.monotonic()
    try:
        answer = complete(getattr(info, engine), info.model, tokens, max_tokens=1, timeout_s=120)
    except ServerError as exc:
        return {"ttft_ms": None, "lookup": f"request failed: {exc}", "reused": 0, "at_s": started}
    details = HitDetails.from_response(answer)
    return {
        "ttft_ms": round(answer["kvtool_timing"]["ttft_s"] * 1000.0, 1),
        "lookup": details.lookup if details else "no details",
        "reused": details.reused_tokens if details else 0,
        "watermark_key": details.watermark_key if details else None,
        "at_s": started,
    }


def outcome(lookup: str) -> str:
    for word, name in (("bypassed", "bypassed"), ("took over", "given up"), ("timed out", "timed out")):
        if word in lookup:
            return name
    return "hit" if lookup == "hit" else "miss" if lookup == "miss" else lookup[:60]


def run_delay(pair: Pair, delay_s: float, args: argparse.Namespace, rng: random.Random) -> dict[str, Any]:
    info = pair.info
    fresh = lambda: [rng.randrange(10, 1000) for _ in range(args.tokens)]  # noqa: E731
    records: list[dict[str, Any]] = []
    for _ in range(args.healthy_requests):
        records.append({"phase": "healthy", **ask(info, "consumer", fresh())})
    pair.set_faults({"delay_s": delay_s})
    slowed_at = time.monotonic()
    for _ in range(args.slow_requests):
        records.append({"phase": "slow", **ask(info, "consumer", fresh())})
    pair.set_faults(None)
    recovered_at = time.monotonic()
    store = open_admin(info.admin)
    for _ in range(args.recovery_requests):
        stored = fresh()
        published = ask(info, "producer", stored)
        if published["watermark_key"]:
            wait_for_key(store, published["watermark_key"], timeout_s=30)
        records.append({"phase": "recovered", **ask(info, "consumer", stored + fresh()[:8])})
    for record in records:
        record["outcome"] = outcome(record["lookup"])
        record["at_s"] = round(record["at_s"] - (slowed_at if record["phase"] == "slow" else recovered_at), 2)
        record.pop("watermark_key", None)
    return summarize(delay_s, records)


def summarize(delay_s: float, records: list[dict[str, Any]]) -> dict[str, Any]:
    healthy = [r["ttft_ms"] for r in records if r["phase"] == "healthy" and r["ttft_ms"] is not None]
    baseline = statistics.median(healthy)
    slow = [r for r in records if r["phase"] == "slow"]
    recovered = [r for r in records if r["phase"] == "recovered"]
    bypassed = next((i for i, r in enumerate(slow) if r["outcome"] == "bypassed"), None)
    within = [r["ttft_ms"] / baseline for r in slow[5:] if r["ttft_ms"] is not None]
    hits_again = next((i for i, r in enumerate(recovered) if r["reused"] > 0), None)
    return {
        "delay_s": delay_s,
        "healthy_miss_ttft_ms_p50": round(baseline, 1),
        "slow_ttft_vs_healthy_miss": [round(r["ttft_ms"] / baseline, 2) if r["ttft_ms"] else None for r in slow],
        "slow_ttft_vs_healthy_miss_max_after_5": round(max(within), 2) if within else None,
        "first_bypassed_request": bypassed,
        "first_hit_after_recovery_request": hits_again,
        "goal_met": bool(within) and max(within) <= 1.2 and hits_again is not None and hits_again < 5,
        "requests": records,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--delays", default="0.2,1,3", help="store call delays to try, seconds, comma-separated")
    parser.add_argument("--model-preset", default="bench")
    parser.add_argument("--tokens", type=int, default=300, help="tokens of each new prompt")
    parser.add_argument("--healthy-requests", type=int, default=6)
    parser.add_argument("--slow-requests", type=int, default=12)
    parser.add_argument("--recovery-requests", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory(prefix="kvtool-slow-store-") as tmp:
        pair = Pair(Path(tmp), "pd")
        pair.argv += ["--model-preset", args.model_preset]
        pair.start()
        try:
            results = [run_delay(pair, float(d), args, rng) for d in args.delays.split(",")]
        finally:
            pair.stop()
    write_result(
        {
            "what": "TTFT of new requests while every store call is slowed, then after it is quick again (issue 38)",
            "command": "python " + " ".join(sys.argv),
            "configuration": {
                **{k: v for k, v in vars(args).items() if k != "out"},
                "roles": "pd",
                "connector_defaults": "slow_call_ms 50, breaker 3 / 1 s / 10 s, lookup_timeout_s 2",
            },
            **provenance(),
            "results": [{k: v for k, v in r.items() if k != "requests"} for r in results],
            "requests": {str(r["delay_s"]): r["requests"] for r in results},
        },
        args.out,
    )


if __name__ == "__main__":
    main()
