"""What sets a fleet run's TTFT percentiles: the requests nothing could serve against the ones a cache can.

Reads committed `kvtool bench --load` results and splits each connector's requests in two: those with
nothing to reuse anywhere (`ideal_tokens` 0: a session's first prompt, before any engine saw its
prefix; every connector computes them whole) and those a shared cache can serve. For each part: the
count and TTFT p50 / p90 / p99 (the load test's own percentile). Where the load is open loop (a
trace at its arrival times), every connector met the same requests at the same moments, so the
requests are also paired across connectors: the median and worst of each request's TTFT ratio against
each peer, which says whether a miss costs more with the connector than without, request by request.
In a closed loop a faster connector sends the next turn sooner and so runs busier engines: there
only the split is read, not the pairs.

    .venv/bin/python benchmarks/fleet/phases.py benchmarks/fleet/trace-block256.json ... \
        --out benchmarks/fleet/phases.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from kvtool.load.metrics import PERCENTILES, percentile
from kvtool.portable import portable

PARTS = {"nothing to reuse": lambda q: not q["ideal_tokens"], "reusable": lambda q: bool(q["ideal_tokens"])}


def ttft_row(requests: list[dict[str, Any]]) -> dict[str, Any]:
    ttfts = [q["ttft_s"] * 1e3 for q in requests if q["ttft_s"] is not None and not q["error"]]
    row: dict[str, Any] = {"requests": len(ttfts)}
    for q in PERCENTILES:
        value = percentile(ttfts, q)
        row[f"ttft_p{q}_ms"] = None if value is None else round(value)
    return row


def paired(mine: list[dict[str, Any]], theirs: list[dict[str, Any]]) -> dict[str, Any]:
    """Each request's TTFT over the peer's for the same request (session, turn), by part."""
    other = {(q["session"], q["turn"]): q for q in theirs}
    out = {}
    for part, belongs in PARTS.items():
        ratios = [
            q["ttft_s"] / other[key]["ttft_s"]
            for q in mine
            if belongs(q)
            and (key := (q["session"], q["turn"])) in other
            and q["ttft_s"]
            and other[key]["ttft_s"]
            and not q["error"]
            and not other[key]["error"]
        ]
        out[part] = {
            "pairs": len(ratios),
            "ttft_ratio_median": round(statistics.median(ratios), 2) if ratios else None,
            "ttft_ratio_max": round(max(ratios), 2) if ratios else None,
        }
    return out


def phases(path: Path) -> dict[str, Any]:
    document = json.loads(path.read_text())
    load = document["configuration"]["load"]
    open_loop = str(load.get("load", "")).startswith("trace") or load.get("session_rate") is not None
    results = {result["connector"]: result["requests"] for result in document["results"]}
    out: dict[str, Any] = {"file": path.name, "open_loop": open_loop, "connectors": {}}
    for connector, requests in results.items():
        entry: dict[str, Any] = {part: ttft_row([q for q in requests if belongs(q)]) for part, belongs in PARTS.items()}
        entry["all"] = ttft_row(requests)
        if open_loop:
            entry["paired"] = {peer: paired(requests, theirs) for peer, theirs in results.items() if peer != connector}
        out["connectors"][connector] = entry
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path, nargs="+")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    text = json.dumps(portable({"what": __doc__.splitlines()[0], "runs": [phases(p) for p in args.results]}), indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
