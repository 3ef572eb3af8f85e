"""A load test's figures, by vLLM's own definitions (``vllm bench serve``). Pure.

- TTFT: from sending a request to its first generated token.
- TPOT: the time per output token after the first, ``(E2E - TTFT) / (output tokens - 1)``, for a
  request of more than one output token.
- ITL: every gap between two successive streamed chunks that carried tokens.
- E2E: from sending a request to its last token.
- Throughput: completed requests, and output tokens, a second of the run's duration (first send to
  last answer); goodput: the requests that met the TTFT objective, a second.
Percentiles interpolate linearly between the two nearest samples (NumPy's default, as vLLM's).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

PERCENTILES = (50, 90, 99)


def percentile(samples: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0-100), linear between the nearest ranks; None without samples."""
    if not samples:
        return None
    ordered = sorted(samples)
    rank = (len(ordered) - 1) * q / 100.0
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@dataclass(frozen=True)
class RequestRecord:
    """One request of a load test, as it ran."""

    session: int
    turn: int
    sent_s: float  # from the run's start
    prompt_tokens: int
    output_tokens: int
    ttft_s: float
    e2e_s: float
    itl_s: tuple[float, ...] = ()
    hit_tokens: int | None = None  # what the engine reused (its connector's, or its own prefix cache's)
    ideal_tokens: int | None = None  # what anything computed before (any engine) made reusable
    error: str | None = None

    @property
    def tpot_s(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


@dataclass(frozen=True)
class LoadSummary:
    requests: int
    failed: int
    duration_s: float
    ttft_ms: dict[str, float | None]
    tpot_ms: dict[str, float | None]
    itl_ms: dict[str, float | None]
    e2e_ms: dict[str, float | None]
    request_throughput: float  # completed requests a second
    output_throughput: float  # output tokens a second
    goodput: float | None  # requests a second within the TTFT objective (None: no objective)
    hit_tokens: int
    ideal_tokens: int
    checked: dict[str, int] = field(default_factory=dict)  # answers checked against a recomputation

    @property
    def reuse_vs_ideal(self) -> float | None:
        return self.hit_tokens / self.ideal_tokens if self.ideal_tokens else None


def _ms(samples: Sequence[float]) -> dict[str, float | None]:
    values = {f"p{q}": percentile(samples, q) for q in PERCENTILES}
    values["mean"] = sum(samples) / len(samples) if samples else None
    return {name: None if value is None else round(value * 1000.0, 2) for name, value in values.items()}


def summarize(records: Sequence[RequestRecord], slo_ttft_ms: float | None = None) -> LoadSummary:
    done = [r for r in records if r.error is None]
    duration = max((r.sent_s + r.e2e_s for r in done), default=0.0) - min((r.sent_s for r in records), default=0.0)
    per_s = 1.0 / duration if duration > 0 else 0.0
    good = None
    if slo_ttft_ms is not None:
        good = sum(1 for r in done if r.ttft_s * 1000.0 <= slo_ttft_ms) * per_s
    measured = [r for r in done if r.hit_tokens is not None and r.ideal_tokens is not None]
    return LoadSummary(
        requests=len(records),
        failed=len(records) - len(done),
        duration_s=round(duration, 3),
        ttft_ms=_ms([r.ttft_s for r in done]),
        tpot_ms=_ms([t for r in done if (t := r.tpot_s) is not None]),
        itl_ms=_ms([gap for r in done for gap in r.itl_s]),
        e2e_ms=_ms([r.e2e_s for r in done]),
        request_throughput=round(len(done) * per_s, 4),
        output_throughput=round(sum(r.output_tokens for r in done) * per_s, 3),
        goodput=None if good is None else round(good, 4),
        hit_tokens=sum(min(r.hit_tokens or 0, r.ideal_tokens or 0) for r in measured),
        ideal_tokens=sum(r.ideal_tokens or 0 for r in measured),
    )
