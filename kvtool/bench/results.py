"""A bench run's results as types: what the tables, the plot and the JSON document are made from.

``Summary`` is one set of measured requests, ``ConnectorReport`` everything measured on one
connector, ``BenchDocument`` the run (--format json, --output). Each has ``to_json``; the JSON's
shape is the one earlier releases wrote (committed results and scripts read it).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

from .runner import ConsumerResult, ProducerResult


@dataclass(frozen=True)
class Summary:
    """Reuse, TTFT and correctness of a set of measured requests (and of the producer side of their runs)."""

    requests: int = 0
    prompt_tokens: int = 0
    ideal_tokens: int = 0
    hit_tokens: int = 0
    block_hit_tokens: int = 0
    tail_hit_tokens: int = 0
    hit_rate: float | None = None
    ideal_hit_rate: float | None = None
    efficiency: float | None = None  # hit tokens over the ideal's
    declined_tokens: int = 0  # found stored, not loaded: the kvtool connector's cost model judged they do not pay
    found_efficiency: float | None = None  # hit and declined tokens over the ideal's: what the lookups found
    ttft_ms_p50: float | None = None
    ttft_ms_p90: float | None = None
    engine_ttft_ms_p50: float | None = None  # vLLM's own TTFT (no HTTP)
    engine_ttft_ms_p90: float | None = None
    verified: int = 0
    mismatches: int = 0
    max_logprob_diff: float | None = None
    producer_requests: int = 0
    producer_ms_p50: float | None = None
    producer_engine_ms_p50: float | None = None
    durability_wait_ms_p50: float | None = None
    durability_timeouts: int = 0
    # Each engine's own summary, where the set measured both (chat); empty otherwise.
    engines: dict[str, Summary] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "engines"}
        if self.engines:
            out["engines"] = {engine: summary.to_json() for engine, summary in self.engines.items()}
        return out


@dataclass(frozen=True)
class Mismatch:
    """A measured answer that differed from its recomputation."""

    workload: str
    step: int
    prompt_tokens: int
    reason: str

    @property
    def where(self) -> str:
        return f"{self.workload} step {self.step} ({self.prompt_tokens} tokens)"


@dataclass(frozen=True)
class ConnectorReport:
    """Everything reported for one connector: overall, per workload, per prompt-length bucket, per request."""

    summary: Summary
    workloads: dict[str, Summary]
    buckets: dict[str, Summary]
    mismatches: list[Mismatch]
    requests: list[ConsumerResult]
    producer_requests: list[ProducerResult]

    def to_json(self) -> dict[str, Any]:
        return {
            "summary": self.summary.to_json(),
            "workloads": {name: s.to_json() for name, s in self.workloads.items()},
            "buckets": {label: s.to_json() for label, s in self.buckets.items()},
            "mismatches": [asdict(m) for m in self.mismatches],
            "requests": [asdict(c) for c in self.requests],
            "producer_requests": [asdict(p) for p in self.producer_requests],
        }


def producer_overhead_ms(reports: dict[str, ConnectorReport], connector: str) -> float | None:
    """A connector's producer p50 latency above the no-connector pair's (None without a `none` run)."""
    base, mine = reports.get("none"), reports.get(connector)
    if base is None or mine is None or base.summary.producer_ms_p50 is None or mine.summary.producer_ms_p50 is None:
        return None
    return mine.summary.producer_ms_p50 - base.summary.producer_ms_p50


@dataclass
class BenchDocument:
    """The run as JSON: the configuration and seed, the pair it ran on, one report per connector."""

    config: dict[str, Any]  # the bench flags as parsed (BenchConfig), and the command line
    pair: dict[str, Any]  # the ready file read (--pair) or the pair configuration launched (--launch)
    reports: dict[str, ConnectorReport]
    compare: bool
    failures: dict[str, str] = field(default_factory=dict)  # connector -> why its run failed (--compare)

    def to_json(self) -> dict[str, Any]:
        document: dict[str, Any] = {"config": self.config, "seed": self.config["seed"], "pair": self.pair}
        if self.compare:
            document["connectors"] = {name: report.to_json() for name, report in self.reports.items()}
            document["comparison"] = {
                name: {**report.summary.to_json(), "producer_overhead_ms": producer_overhead_ms(self.reports, name)}
                for name, report in self.reports.items()
            }
        else:
            ((connector, report),) = self.reports.items()
            document["connector"] = connector
            document.update(report.to_json())
        if self.failures:
            document["failures"] = self.failures
        return document
