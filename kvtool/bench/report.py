"""Summary statistics (pure), and a bench run as a report: its tables and its JSON document."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

from rich.text import Text

from kvtool.report import Report, ReportTable

from .results import BenchDocument, ConnectorReport, Mismatch, Summary, producer_overhead_ms
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


def summarize(
    consumers: Sequence[ConsumerResult], runs: Iterable[WorkloadRun] = (), by_engine: bool = False
) -> Summary:
    """The summary of a set of measured requests (and of the producer side of ``runs``).

    TTFT is the consumer's where the set has consumer requests (a producer's, max_tokens=1, is its
    latency, which the producer figures already show). ``by_engine``: where the set measured both
    engines (chat), ``engines`` holds each engine's own summary too."""
    prompt = sum(c.prompt_tokens for c in consumers)
    ideal = sum(c.ideal_tokens for c in consumers)
    hit = sum(c.hit_tokens for c in consumers)
    ttfts = [c.ttft_ms for c in consumers if c.engine == "consumer"] or [c.ttft_ms for c in consumers]
    engine_ttfts = [c.engine_ttft_ms for c in consumers if c.engine == "consumer" and c.engine_ttft_ms is not None]
    runs = list(runs)
    producer_ms = [p.latency_ms for r in runs for p in r.producers]
    waits_ms = [w for r in runs for w in r.durability_waits_ms]
    engines = _engines(consumers) if by_engine else {}
    return Summary(
        requests=len(consumers),
        prompt_tokens=prompt,
        ideal_tokens=ideal,
        hit_tokens=hit,
        block_hit_tokens=sum(c.block_hit_tokens for c in consumers),
        tail_hit_tokens=sum(c.tail_hit_tokens for c in consumers),
        hit_rate=ratio(hit, prompt),
        ideal_hit_rate=ratio(ideal, prompt),
        efficiency=ratio(hit, ideal),
        declined_tokens=(declined := sum(c.declined_tokens for c in consumers)),
        found_efficiency=ratio(hit + declined, ideal),
        ttft_ms_p50=percentile(ttfts, 0.5),
        ttft_ms_p90=percentile(ttfts, 0.9),
        engine_ttft_ms_p50=percentile(engine_ttfts, 0.5),
        engine_ttft_ms_p90=percentile(engine_ttfts, 0.9),
        verified=sum(1 for c in consumers if c.verified),
        mismatches=sum(1 for c in consumers if c.matched is False),
        max_logprob_diff=max((c.max_logprob_diff for c in consumers if c.max_logprob_diff is not None), default=None),
        producer_requests=len(producer_ms),
        producer_ms_p50=percentile(producer_ms, 0.5),
        producer_engine_ms_p50=percentile(
            [p.engine_latency_ms for r in runs for p in r.producers if p.engine_latency_ms is not None], 0.5
        ),
        durability_wait_ms_p50=percentile(waits_ms, 0.5),
        durability_timeouts=sum(r.durability_timeouts for r in runs),
        engines=engines if len(engines) > 1 else {},
    )


def _engines(results: Sequence[ConsumerResult]) -> dict[str, Summary]:
    """Each engine's summary, producer first (the order requests run in a turn)."""
    engines = sorted({r.engine for r in results}, key=lambda engine: engine != "producer")
    return {engine: summarize([r for r in results if r.engine == engine]) for engine in engines}


def connector_report(runs: Sequence[WorkloadRun], block_size: int) -> ConnectorReport:
    """Everything reported for one connector: overall, per workload, per prompt-length bucket, per request.

    The requests are the measured ones: every consumer request, and chat's producer requests."""
    consumers = [c for r in runs for c in r.measured]
    buckets: dict[str, list[ConsumerResult]] = {}
    for consumer in sorted(consumers, key=lambda c: c.prompt_tokens):
        buckets.setdefault(bucket_label(consumer.prompt_tokens, block_size), []).append(consumer)
    return ConnectorReport(
        summary=summarize(consumers, runs, by_engine=True),
        workloads={r.workload: summarize(r.measured, [r], by_engine=True) for r in runs},
        buckets={label: summarize(members) for label, members in buckets.items()},
        mismatches=[Mismatch(c.workload, c.step, c.prompt_tokens, c.mismatch) for c in consumers if c.matched is False],
        requests=list(consumers),
        producer_requests=[p for r in runs for p in r.producers],
    )


# ---- terminal -------------------------------------------------------------------------------

SUMMARY_COLUMNS = (
    "requests",
    "prompt tok",
    "ideal tok",
    "hit tok",
    "block hit",
    "tail hit",
    "hit rate",
    "efficiency",
    "TTFT p50 ms",
    "TTFT p90 ms",
    "mismatches",
)
COMPARISON_COLUMNS = (
    "hit rate",
    "efficiency",
    "block hit",
    "tail hit",
    "TTFT p50 ms",
    "TTFT p90 ms",
    "engine TTFT p50 ms",
    "mismatches",
    "producer p50 ms",
    "producer overhead ms",
)


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def _efficiency(summary: Summary) -> str:
    """The efficiency, and what the lookups found where the cost model declined some of it."""
    if not summary.declined_tokens:
        return _pct(summary.efficiency)
    return f"{_pct(summary.efficiency)} ({_pct(summary.found_efficiency)} found)"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _mismatch_cell(summary: Summary) -> str | Text:
    if summary.mismatches:
        return Text(str(summary.mismatches), style="red")
    return "0" if summary.verified else "not verified"


def _summary_row(first: str, name: str, summary: Summary, style: str | None = None) -> dict[str, Any]:
    cells = [
        summary.requests,
        summary.prompt_tokens,
        summary.ideal_tokens,
        summary.hit_tokens,
        summary.block_hit_tokens,
        summary.tail_hit_tokens,
        _pct(summary.hit_rate),
        _efficiency(summary),
        _ms(summary.ttft_ms_p50),
        _ms(summary.ttft_ms_p90),
        _mismatch_cell(summary),
    ]
    row: dict[str, Any] = {first: name, **dict(zip(SUMMARY_COLUMNS, cells, strict=True))}
    if style is not None:
        row = {column: _styled(cell, style) for column, cell in row.items()}
    return row


def _styled(cell: Any, style: str) -> Text:
    text = cell.copy() if isinstance(cell, Text) else Text(str(cell))
    text.stylize(style)
    return text


def _engine_label(name: str, engine: str) -> str:
    """An engine's row, after the row it splits; named in full, as a transposed table shows no indent."""
    return f"{name} ({engine})"


def _rows(first: str, name: str, summary: Summary, style: str | None = None) -> list[dict[str, Any]]:
    """The summary's row, then one per engine where it measured both (chat)."""
    rows = [_summary_row(first, name, summary, style)]
    rows += [_summary_row(first, _engine_label(name, engine), sub) for engine, sub in summary.engines.items()]
    return rows


def _summary_table(title: str, first: str, summaries: dict[str, Summary], total: Summary | None) -> ReportTable:
    rows = [row for name, summary in summaries.items() for row in _rows(first, name, summary)]
    if total is not None:
        rows += _rows(first, "all", total, style="bold")
    return ReportTable(title, [first, *SUMMARY_COLUMNS], rows)


def mismatch_notes(report: ConnectorReport, connector: str | None = None) -> list[str | Text]:
    notes: list[str | Text] = []
    for mismatch in report.mismatches:
        note = Text("mismatch", style="red")
        if connector is not None:
            note.append(f" ({connector})")
        note.append(f" {mismatch.where}: {mismatch.reason}")
        notes.append(note)
    return notes


def connector_tables(connector: str, report: ConnectorReport) -> list[ReportTable]:
    return [
        _summary_table(f"kvtool bench: {connector} connector", "workload", report.workloads, report.summary),
        _summary_table("by prompt length (tokens)", "prompt tokens", report.buckets, None),
    ]


def comparison_tables(reports: dict[str, ConnectorReport]) -> list[ReportTable]:
    rows = []
    for connector, report in reports.items():
        summary = report.summary
        cells = [
            _pct(summary.hit_rate),
            _efficiency(summary),
            summary.block_hit_tokens,
            summary.tail_hit_tokens,
            _ms(summary.ttft_ms_p50),
            _ms(summary.ttft_ms_p90),
            _ms(summary.engine_ttft_ms_p50),
            summary.mismatches,
            _ms(summary.producer_ms_p50),
            _ms(producer_overhead_ms(reports, connector)),
        ]
        rows.append({"connector": connector, **dict(zip(COMPARISON_COLUMNS, cells, strict=True))})
    per_workload = []
    workloads = list(next(iter(reports.values())).workloads) if reports else []
    for workload in workloads:
        summaries = {connector: report.workloads.get(workload) for connector, report in reports.items()}
        per_workload.append(_efficiency_row(workload, summaries))
        engines = dict.fromkeys(engine for summary in summaries.values() if summary for engine in summary.engines)
        for engine in engines:
            by_engine = {
                connector: summary.engines.get(engine) if summary else None for connector, summary in summaries.items()
            }
            per_workload.append(_efficiency_row(_engine_label(workload, engine), by_engine))
    return [
        ReportTable(
            "kvtool bench --compare (same seeded workload on each connector)",
            ["connector", *COMPARISON_COLUMNS],
            rows,
        ),
        ReportTable(
            "per workload: efficiency / TTFT p50 ms / engine TTFT p50 ms", ["workload", *reports], per_workload
        ),
    ]


def _efficiency_row(name: str, summaries: dict[str, Summary | None]) -> dict[str, Any]:
    """One row of the per-workload comparison: efficiency / TTFT p50 / engine TTFT p50 on each connector."""
    row: dict[str, Any] = {"workload": name}
    for connector, summary in summaries.items():
        row[connector] = None if summary is None else _efficiency_cell(summary)
    return row


def _efficiency_cell(summary: Summary) -> str:
    return f"{_efficiency(summary)} / {_ms(summary.ttft_ms_p50)} / {_ms(summary.engine_ttft_ms_p50)}"


def bench_report(document: BenchDocument) -> Report:
    """The run as the terminal shows it (tables, mismatches) and as JSON (the document)."""
    reports = document.reports
    if document.compare:
        tables = comparison_tables(reports) if reports else []
    else:
        ((connector, report),) = reports.items()
        tables = connector_tables(connector, report)
    notes = [
        note
        for connector, report in reports.items()
        for note in mismatch_notes(report, connector if document.compare else None)
    ]
    return Report(tables=tables, notes=notes, payload=document.to_json())
