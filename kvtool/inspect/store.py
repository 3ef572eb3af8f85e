"""`kvtool inspect store`: capacity, use and eviction counters from the master's Prometheus metrics."""

from __future__ import annotations

from kvtool.store.admin import StoreAdmin
from kvtool.errors import UserError
from kvtool.report import Report, ReportTable

# The master's default for --eviction_high_watermark_ratio; /metrics does not expose the value in use.
DEFAULT_EVICTION_HIGH_WATERMARK = 0.9

# What the report shows, and the master metric each comes from.
STORE_METRICS = {
    "capacity_bytes": "master_total_capacity_bytes",
    "used_bytes": "master_allocated_bytes",
    "key_count": "master_key_count",
    "active_clients": "master_active_clients",
    "evicted_keys": "master_evicted_key_count",
    "evicted_bytes": "master_evicted_size_bytes",
    "evictions": "master_successful_evictions_total",
    "eviction_attempts": "master_attempted_evictions_total",
    "put_starts": "master_put_start_requests_total",
    "put_failures": "master_put_start_failures_total",
    "put_no_space_failures": "master_put_start_alloc_failures_total",
}


def store_summary(samples: dict[str, float], high_watermark: float | None) -> dict:
    """The store's numbers; missing metrics are None. ``high_watermark`` None means the master default."""
    summary: dict = {}
    for name, metric in STORE_METRICS.items():
        value = samples.get(metric)
        summary[name] = int(value) if value is not None else None
    capacity, used = summary["capacity_bytes"], summary["used_bytes"]
    summary["used_ratio"] = round(used / capacity, 4) if capacity and used is not None else None
    summary["eviction_high_watermark"] = (
        high_watermark if high_watermark is not None else DEFAULT_EVICTION_HIGH_WATERMARK
    )
    summary["eviction_high_watermark_source"] = (
        "given" if high_watermark is not None else "master default (not in /metrics)"
    )
    ratio = summary["used_ratio"]
    summary["above_high_watermark"] = ratio is not None and ratio >= summary["eviction_high_watermark"]
    return summary


STANDBY_NOTE = (
    "this master is a standby of a high-availability group: it holds no objects; give the leader's --admin "
    "(each master's GET /role says which)"
)


def store_report(store: StoreAdmin, high_watermark: float | None) -> Report:
    if high_watermark is not None and not 0 < high_watermark <= 1:
        raise UserError(f"--eviction-high-watermark {high_watermark} is not a ratio in (0, 1]")
    summary = store_summary(store.metrics(), high_watermark)
    summary["ha_role"] = store.role()  # None: not a master of a high-availability group
    rows = [{"metric": name, "value": _human(name, value)} for name, value in summary.items()]
    notes = []
    if summary["ha_role"] == "standby":
        notes.append(STANDBY_NOTE)
    if not summary["capacity_bytes"]:
        notes.append("capacity is 0: no client has mounted a segment yet (engines lend it when they start)")
    return Report(
        tables=[ReportTable(f"store at {store.url}", ["metric", "value"], rows)],
        notes=notes,
        payload={"admin": store.url, **summary, "notes": notes},
    )


def _human(name: str, value):
    if name.endswith("_bytes") and isinstance(value, int):
        return f"{value} ({value / (1 << 20):.1f} MiB)"
    return value
