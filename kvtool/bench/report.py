"""Summary statistics (pure), Rich tables and the JSON document of a bench run."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict
from typing import Any

from rich.console import Console
from rich.table import Table

from .runner import ConsumerResult, WorkloadRun

# Prompt-length buckets in blocks: [0, 1), [1, 2), [2, 4), [4, 8), [8, 16), [16, inf).
BUCKET_EDGES_BLOCKS = (1, 2, 4, 8, 16)


def percentile(values: Sequence[float], fraction: float) -> float | None:
    """Linear-interpolated percentile (``fraction`` in [0, 1]); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    position = (len(ordered) - 1) * fraction
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def ratio(numerator: int, denominator: int) -> float | None:
    return numerator / denominator if denominator else None


def bucket_label(prompt_tokens: int, block_size: int) -> str:
    low = 0
    for edge in BUCKET_EDGES_BLOCKS:
        if prompt_tokens < edge * block_size:
            return f"{low * block_size}-{edge * block_size - 1}"
        low = edge
    return f">={low * block_size}"


def summarize(consumers: Sequence[ConsumerResult], runs: Iterable[WorkloadRun] = ()) -> dict[str, Any]:
    """The summary of a set of consumer requests (and of the producer side of ``runs``)."""
    prompt = sum(c.prompt_tokens for c in consumers)
    ideal = sum(c.ideal_tokens for c in consumers)
    hit = sum(c.hit_tokens for c in consumers)
    ttfts = [c.ttft_ms for c in consumers]
    mismatches = [c for c in consumers if c.matched is False]
    runs = list(runs)
    producer_ms = [p.latency_ms for r in runs for p in r.producers]
    waits_ms = [w for r in runs for w in r.durability_waits_ms]
    return {
        "requests": len(consumers),
        "prompt_tokens": prompt,
        "ideal_tokens": ideal,
        "hit_tokens": hit,
        "block_hit_tokens": sum(c.block_hit_tokens for c in consumers),
        "tail_hit_tokens": sum(c.tail_hit_tokens for c in consumers),
        "hit_rate": ratio(hit, prompt),
        "ideal_hit_rate": ratio(ideal, prompt),
        "efficiency": ratio(hit, ideal),
        "ttft_ms_p50": percentile(ttfts, 0.5),
        "ttft_ms_p90": percentile(ttfts, 0.9),
        "verified": sum(1 for c in consumers if c.verified),
        "mismatches": len(mismatches),
        "max_logprob_diff": max(
            (c.max_logprob_diff for c in consumers if c.max_logprob_diff is not None), default=None
        ),
        "producer_requests": len(producer_ms),
        "producer_ms_p50": percentile(producer_ms, 0.5),
        "durability_wait_ms_p50": percentile(waits_ms, 0.5),
        "durability_timeouts": sum(r.durability_timeouts for r in runs),
    }


def connector_report(runs: Sequence[WorkloadRun], block_size: int) -> dict[str, Any]:
    """Everything reported for one connector: overall, per workload, per prompt-length bucket, per request."""
    consumers = [c for r in runs for c in r.consumers]
    buckets: dict[str, list[ConsumerResult]] = {}
    for consumer in sorted(consumers, key=lambda c: c.prompt_tokens):
        buckets.setdefault(bucket_label(consumer.prompt_tokens, block_size), []).append(consumer)
    return {
        "summary": summarize(consumers, runs),
        "workloads": {r.workload: summarize(r.consumers, [r]) for r in runs},
        "buckets": {label: summarize(members) for label, members in buckets.items()},
        "mismatches": [
            {"workload": c.workload, "step": c.step, "prompt_tokens": c.prompt_tokens, "reason": c.mismatch}
            for c in consumers
            if c.matched is False
        ],
        "requests": [asdict(c) for c in consumers],
        "producer_requests": [asdict(p) for r in runs for p in r.producers],
    }


def producer_overhead_ms(reports: dict[str, dict[str, Any]], connector: str) -> float | None:
    """A connector's producer p50 latency above the no-connector pair's (None without a `none` run)."""
    base = reports.get("none", {}).get("summary", {}).get("producer_ms_p50")
    mine = reports.get(connector, {}).get("summary", {}).get("producer_ms_p50")
    return None if base is None or mine is None else mine - base


# ---- terminal -------------------------------------------------------------------------------


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _summary_columns(table: Table, first: str) -> None:
    table.add_column(first)
    for name in ("requests", "prompt tok", "ideal tok", "hit tok", "block", "tail", "hit rate", "efficiency"):
        table.add_column(name, justify="right")
    for name in ("TTFT p50 ms", "TTFT p90 ms", "mismatches"):
        table.add_column(name, justify="right")


def _summary_row(table: Table, name: str, summary: dict[str, Any], style: str | None = None) -> None:
    mismatches = summary["mismatches"]
    table.add_row(
        name,
        str(summary["requests"]),
        str(summary["prompt_tokens"]),
        str(summary["ideal_tokens"]),
        str(summary["hit_tokens"]),
        str(summary["block_hit_tokens"]),
        str(summary["tail_hit_tokens"]),
        _pct(summary["hit_rate"]),
        _pct(summary["efficiency"]),
        _ms(summary["ttft_ms_p50"]),
        _ms(summary["ttft_ms_p90"]),
        f"[red]{mismatches}[/red]" if mismatches else "0" if summary["verified"] else "not verified",
        style=style,
    )


def print_connector_report(console: Console, connector: str, report: dict[str, Any]) -> None:
    table = Table(title=f"kvtool bench: {connector} connector")
    _summary_columns(table, "workload")
    for name, summary in report["workloads"].items():
        _summary_row(table, name, summary)
    _summary_row(table, "all", report["summary"], style="bold")
    console.print(table)
    buckets = Table(title="by prompt length (tokens)")
    _summary_columns(buckets, "prompt tokens")
    for label, summary in report["buckets"].items():
        _summary_row(buckets, label, summary)
    console.print(buckets)
    print_mismatches(console, report)


def print_mismatches(console: Console, report: dict[str, Any]) -> None:
    for mismatch in report["mismatches"]:
        console.print(
            f"[red]mismatch[/red] {mismatch['workload']} step {mismatch['step']} "
            f"({mismatch['prompt_tokens']} tokens): {mismatch['reason']}",
            soft_wrap=True,
            highlight=False,
        )


def print_comparison(console: Console, reports: dict[str, dict[str, Any]]) -> None:
    table = Table(title="kvtool bench --compare (same seeded workload on each connector)")
    table.add_column("connector")
    for name in ("hit rate", "efficiency", "block", "tail", "TTFT p50 ms", "TTFT p90 ms", "mismatches"):
        table.add_column(name, justify="right")
    table.add_column("producer p50 ms", justify="right")
    table.add_column("producer overhead ms", justify="right")
    for connector, report in reports.items():
        summary = report["summary"]
        table.add_row(
            connector,
            _pct(summary["hit_rate"]),
            _pct(summary["efficiency"]),
            str(summary["block_hit_tokens"]),
            str(summary["tail_hit_tokens"]),
            _ms(summary["ttft_ms_p50"]),
            _ms(summary["ttft_ms_p90"]),
            str(summary["mismatches"]),
            _ms(summary["producer_ms_p50"]),
            _ms(producer_overhead_ms(reports, connector)),
        )
    console.print(table)
    per_workload = Table(title="per workload: efficiency / TTFT p50 ms")
    per_workload.add_column("workload")
    for connector in reports:
        per_workload.add_column(connector, justify="right")
    workloads = list(next(iter(reports.values()))["workloads"]) if reports else []
    for workload in workloads:
        cells = []
        for report in reports.values():
            summary = report["workloads"].get(workload)
            cells.append("-" if summary is None else f"{_pct(summary['efficiency'])} / {_ms(summary['ttft_ms_p50'])}")
        per_workload.add_row(workload, *cells)
    console.print(per_workload)
    for report in reports.values():
        print_mismatches(console, report)


def bench_document(
    config: dict[str, Any], pair: dict[str, Any], reports: dict[str, dict[str, Any]], compare: bool
) -> dict[str, Any]:
    """The --json document: the configuration and seed, and one report per connector."""
    document: dict[str, Any] = {"config": config, "seed": config["seed"], "pair": pair}
    if compare:
        document["connectors"] = reports
        document["comparison"] = {
            connector: {**report["summary"], "producer_overhead_ms": producer_overhead_ms(reports, connector)}
            for connector, report in reports.items()
        }
    else:
        ((connector, report),) = reports.items()
        document["connector"] = connector
        document.update(report)
    return document
