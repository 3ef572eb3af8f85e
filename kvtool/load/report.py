"""A load test's report: one row per connector, every figure side by side (``kvtool.report.Report``),
and the JSON document with the configuration that produced it."""

from __future__ import annotations

from typing import Any

from kvtool.report import Report, ReportTable

from .churn import Churn
from .join import join_note
from .options import LoadOptions, LoadResult

COLUMNS = [
    "connector",
    "sessions/s",
    "sent req/s",
    "requests",
    "failed",
    "TTFT p50",
    "TTFT p90",
    "TTFT p99",
    "TPOT p50",
    "TPOT p99",
    "ITL p50",
    "ITL p99",
    "req/s",
    "out tok/s",
    "goodput",
    "reuse / ideal",
    "answers checked",
    "store keys",
]


def _row(result: LoadResult) -> dict[str, Any]:
    summary = result.summary
    checked = result.run.checked
    reuse = summary.reuse_vs_ideal
    sent = result.sent_rate
    return {
        "connector": result.connector,
        "sessions/s": "closed loop" if result.session_rate is None else result.session_rate,
        "sent req/s": None if sent is None else round(sent, 3),
        "requests": summary.requests,
        "failed": summary.failed,
        "TTFT p50": summary.ttft_ms["p50"],
        "TTFT p90": summary.ttft_ms["p90"],
        "TTFT p99": summary.ttft_ms["p99"],
        "TPOT p50": summary.tpot_ms["p50"],
        "TPOT p99": summary.tpot_ms["p99"],
        "ITL p50": summary.itl_ms["p50"],
        "ITL p99": summary.itl_ms["p99"],
        "req/s": summary.request_throughput,
        "out tok/s": summary.output_throughput,
        "goodput": summary.goodput,
        "reuse / ideal": None if reuse is None else round(reuse, 4),
        "answers checked": f"{checked.get('matched', 0)} of {sum(checked.values())} matched",
        "store keys": result.store_keys,
    }


def load_report(results: list[LoadResult], options: LoadOptions, config: dict[str, Any]) -> Report:
    """The table (latencies in ms), and a payload with each connector's summary and the configuration."""
    table = ReportTable(f"kvtool bench --load {options.load}", COLUMNS, [_row(result) for result in results])
    tables = [table]
    if any(result.phases for result in results):
        phases = [_phase_row(result, phase) for result in results for phase in result.phases or []]
        title = (
            "TTFT while an engine joins the fleet and after"
            if any(r.join for r in results)
            else ("TTFT while an engine is down and after it rejoins")
        )
        tables.append(ReportTable(title, PHASE_COLUMNS, phases))
    notes = [
        "TTFT, TPOT, ITL in ms by vLLM's definitions (kvtool/load/metrics.py); goodput: requests a second within "
        f"the TTFT objective of {options.slo_ttft_ms:g} ms; reuse / ideal: tokens reused against what any "
        "engine computed before each request was sent"
    ]
    for result in results:
        notes += [f"{result.connector}: {difference}" for difference in result.run.differences[:3]]
        if result.churn is not None:
            notes.append(f"{result.connector}: {_churn_note(result.churn)}")
        if result.join is not None:
            notes.append(f"{result.connector}: {join_note(result.join)}")
    payload = {
        "what": "kvtool bench --load",
        "configuration": config,
        "results": [
            {
                "connector": result.connector,
                "session_rate": result.session_rate,
                "sent_request_rate": result.sent_rate,
                "fleet": result.fleet,
                "summary": {**result.summary.__dict__, "reuse_vs_ideal": result.summary.reuse_vs_ideal},
                "checked": result.run.checked,
                "differences": result.run.differences,
                "store_keys": result.store_keys,
                "churn": None if result.churn is None else result.churn.to_json(),
                "join": None if result.join is None else result.join.to_json(),
                "phases": result.phases,
                "requests": [record.__dict__ for record in result.run.records],
            }
            for result in results
        ],
    }
    return Report(tables, notes=notes, payload=payload)


PHASE_COLUMNS = [
    "connector",
    "phase",
    "from s",
    "to s",
    "requests",
    "failed",
    "TTFT p50",
    "TTFT p90",
    "TTFT p99",
    "reuse / ideal",
]


def _phase_row(result: LoadResult, phase: dict[str, Any]) -> dict[str, Any]:
    ideal = phase["ideal_tokens"]
    return {
        "connector": result.connector,
        "phase": phase["phase"],
        "from s": phase["from_s"],
        "to s": phase["to_s"],
        "requests": phase["requests"],
        "failed": phase["failed"],
        "TTFT p50": phase["ttft_ms"]["p50"],
        "TTFT p90": phase["ttft_ms"]["p90"],
        "TTFT p99": phase["ttft_ms"]["p99"],
        "reuse / ideal": round(phase["hit_tokens"] / ideal, 4) if ideal else None,
    }


def _churn_note(churn: Churn) -> str:
    """When the killed engine left the router's list and came back, in seconds into the load."""
    if churn.killed_s is None:
        return f"{churn.engine} was not killed: the load ended first (give a smaller --kill-engine-after)"
    out = (
        "never seen out of the router's list"
        if churn.out_s is None
        else f"out of the router's list at {churn.out_s:g} s"
    )
    back = "not back before the load ended" if churn.back_s is None else f"back in it at {churn.back_s:g} s"
    return f"{churn.engine} killed at {churn.killed_s:g} s, {out}, {back}"
