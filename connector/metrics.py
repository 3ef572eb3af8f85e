"""Connector metrics: worker counters shipped through vLLM's connector stats, and their Prometheus form.

Counter names: objects_loaded, block_objects_loaded, tail_objects_loaded, bytes_loaded,
load_failures_<cause> (store_error, missing, namespace, checksum, truncated, mismatch, hash, foreign,
version, corrupt), saves_<outcome> (stored, no_space, failed), bytes_saved.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats


class KVToolStats(KVConnectorStats):
    def reset(self):
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        merged = dict(self.data)
        for name, value in other.data.items():
            merged[name] = merged.get(name, 0) + value
        return KVToolStats(data=merged)

    def reduce(self) -> dict[str, int | float]:
        return dict(sorted(self.data.items()))

    def is_empty(self) -> bool:
        return not any(self.data.values())


class KVToolPromMetrics(KVConnectorPromMetrics):
    """Each counter becomes ``vllm:kvtool_<name>_total``, labelled per engine."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters: dict[str, dict[int, Any]] = {}

    def _counter(self, name: str, engine_idx: int):
        per_engine = self._counters.get(name)
        if per_engine is None:
            counter = self._counter_cls(
                name=f"vllm:kvtool_{name}",
                documentation=f"kvtool connector: {name.replace('_', ' ')}",
                labelnames=self._labelnames,
            )
            per_engine = {idx: counter.labels(*values) for idx, values in self.per_engine_labelvalues.items()}
            self._counters[name] = per_engine
        return per_engine[engine_idx]

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0):
        for name, value in transfer_stats_data.items():
            if value:
                self._counter(name, engine_idx).inc(value)
