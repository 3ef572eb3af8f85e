"""Misses under load: batches of concurrent new requests at block 256 and 32, kvtool against no
connector, with the share of kvtool's misses answered in the scheduler step they arrived in (issue 38).

For each block size a kvtool pair and a none pair (``kvtool serve-pair --model-preset bench``, roles
``pd``) run one after another; the consumer gets ``--batches`` batches at each concurrency (1, 16, 64
by default) of new prompts (nothing stored; lengths cycling through ``--lengths``), all of a batch at
once, ``max_tokens`` 1 (a request's latency is its TTFT). Reported per block and concurrency: TTFT p50
and p90 of each connector, kvtool's p50 over none's, and from kvtool's hit details the share of misses
whose lookup was answered in the scheduler step that first saw them (timeline ``answered`` at step 0)
and the most steps one waited.

    .venv/bin/python benchmarks/fast-path/concurrent_miss.py --out benchmarks/fast-path/concurrent_miss.json
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from consumer_miss import launch, stop  # noqa: E402 - the sibling module
from published import provenance, write_result  # noqa: E402

from connector.core.hits import HitDetails  # noqa: E402
from kvtool.client import complete  # noqa: E402
from kvtool.pair.ready import ReadyFile  # noqa: E402

CONNECTORS = ("kvtool", "none")


def ask(info: ReadyFile, tokens: list[int]) -> dict[str, Any]:
    answer = complete(info.consumer, info.model, tokens, max_tokens=1, timeout_s=600)
    details = HitDetails.from_response(answer)
    answered = (details.timeline or {}).get("answered") if details else None
    return {
        "ttft_ms": answer["kvtool_timing"]["ttft_s"] * 1000.0,
        "answered_step": answered[1] if answered else None,
        "lookup": details.lookup if details else None,
    }


def measure(info: ReadyFile, args: argparse.Namespace, rng: random.Random) -> dict[int, list[dict[str, Any]]]:
    lengths = [int(x) for x in args.lengths.split(",")]
    ask(info, [rng.randrange(10, 1000) for _ in range(lengths[0])])  # warm the engine up
    by_concurrency: dict[int, list[dict[str, Any]]] = {}
    for concurrency in (int(x) for x in args.concurrency.split(",")):
        found: list[dict[str, Any]] = []
        for _ in range(args.batches):
            prompts = [[rng.randrange(10, 1000) for _ in range(lengths[i % len(lengths)])] for i in range(concurrency)]
            with ThreadPoolExecutor(concurrency) as pool:
                found += list(pool.map(lambda tokens: ask(info, tokens), prompts))
            time.sleep(args.pause_s)
        by_concurrency[concurrency] = found
    return by_concurrency


def p(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 1)


def summarize(runs: dict[str, dict[int, list[dict[str, Any]]]]) -> dict[str, Any]:
    table = {}
    for concurrency, kvtool in runs["kvtool"].items():
        none = runs["none"][concurrency]
        ttft = {c: [r["ttft_ms"] for r in rows] for c, rows in (("kvtool", kvtool), ("none", none))}
        steps = [r["answered_step"] for r in kvtool if r["answered_step"] is not None]
        table[str(concurrency)] = {
            "requests": len(kvtool),
            "ttft_ms_p50": {c: p(v, 0.5) for c, v in ttft.items()},
            "ttft_ms_p90": {c: p(v, 0.9) for c, v in ttft.items()},
            "kvtool_p50_vs_none": round(statistics.median(ttft["kvtool"]) / statistics.median(ttft["none"]), 3),
            "misses_answered_in_first_step": round(sum(1 for s in steps if s == 0) / len(steps), 3) if steps else None,
            "answered_step_max": max(steps) if steps else None,
            "lookups_other_than_miss": sorted({r["lookup"] for r in kvtool if r["lookup"] != "miss"}),
        }
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", default="256,32")
    parser.add_argument("--concurrency", default="1,16,64")
    parser.add_argument("--lengths", default="300,600", help="prompt lengths, cycled through a batch")
    parser.add_argument("--batches", type=int, default=3, help="batches per concurrency")
    parser.add_argument("--pause-s", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--connectors",
        default=",".join(CONNECTORS),
        help="the pairs, in the order they run; one named twice runs twice, its requests pooled",
    )
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    results = {}
    with tempfile.TemporaryDirectory(prefix="kvtool-concurrent-miss-") as tmp:
        for block in args.blocks.split(","):
            runs: dict[str, dict[int, list[dict[str, Any]]]] = {}
            for turn, connector in enumerate(args.connectors.split(",")):
                workdir = Path(tmp) / f"{connector}-{block}-{turn}"
                workdir.mkdir()
                pair, info = launch(connector, workdir, ("--block-size", block))
                try:
                    measured = measure(info, args, rng)
                finally:
                    stop(pair)
                for concurrency, rows in measured.items():  # a connector named twice: its runs pooled
                    runs.setdefault(connector, {}).setdefault(concurrency, []).extend(rows)
            results[block] = summarize(runs)
    write_result(
        {
            "what": "consumer misses in concurrent batches, kvtool vs no connector (issue 38)",
            "command": "python " + " ".join(sys.argv),
            "configuration": {
                **{k: v for k, v in vars(args).items() if k != "out"},
                "model_preset": "bench",
                "roles": "pd",
                "hash_unit": 1,
                "divergence_grid": "auto",
            },
            **provenance(),
            "by_block_and_concurrency": results,
        },
        args.out,
    )


if __name__ == "__main__":
    main()
