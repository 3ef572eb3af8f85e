"""Connector metrics: the counters every component keeps (``counters.Counters``), shipped through vLLM's
connector stats and exported as ``vllm:kvtool_<name>_total``, each with the help text ``COUNTERS`` gives.

``COUNTERS`` is the one list of what the connector counts: a name, or a family ``prefix_<label>`` whose
label is a cause or outcome. ``tests/unit/test_metrics_catalogue.py`` holds it against the names the code
counts and against the README's table.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats


# What the connector counts. A key ending in ``_<...>`` is a family: the label names what varies.
COUNTERS: dict[str, str] = {
    # lookups (scheduler side)
    "lookups": "lookups answered (hit or miss)",
    "lookup_errors": "lookups that failed (store error or time-out): served as misses",
    "lookup_batches": "lookup batches sent to the store (one per scheduler step with new requests)",
    "lookup_timeouts": "lookups not answered within lookup_timeout_s: misses",
    "lookups_abandoned": "lookups given up on: the store took longer than the request's best hit could save",
    "lookups_late_busy": "lookups given up on while no store call was slow (the engine's threads were busy): "
    "misses that keep the store in use",
    "lookups_bypassed": "requests not looked up because the store was bypassed (failing or slow): misses at once",
    "lookups_not_worth": "requests not looked up: no hit could pay for its load (the cost model), or none to gain",
    "pointer_reads_failed": "lookups whose pointer reads failed: served without the hits that needed them",
    "requests_unhashable": "requests whose token ids the key schema cannot encode: never looked up or saved",
    "session_chunks_rekeyed": "streaming-input sessions whose next chunk changed their keys",
    "request_log_dropped": "request log lines dropped: its writer fell more than 10,000 lines behind (a slow disk)",
    # loads: the cost model's verdicts (scheduler side), then the worker's loads
    "loads_<verdict>": "hits not taken as found: unprofitable (nothing loaded) or trimmed (the partial block dropped)",
    "loads_explored": "hits the cost model declined but took anyway, so that loads keep being measured",
    "loads_queued": "loads that waited for load-area slots or a fetch thread",
    "loads_oversize": "loads larger than the whole load area, read into a buffer of their own",
    "objects_loaded": "objects copied into the KV cache",
    "block_objects_loaded": "full-block objects copied into the KV cache",
    "tail_objects_loaded": "tail objects (a partial block) copied into the KV cache",
    "state_objects_loaded": "state objects (a Mamba group's state) copied into the KV cache",
    "bytes_loaded": "payload bytes copied into the KV cache",
    "load_failures_<cause>": "loads that failed, by cause (store_error, missing, timeout, slow, no_turn, checksum, "
    "namespace, hash, mismatch, truncated, version, foreign, corrupt, unloadable, no_store, no_memory): recomputed",
    # saves (worker side)
    "saves_<outcome>": "save objects by outcome (stored, present, no_space, not_ready, failed, dropped_shutdown; "
    "gone or unchecked: found stored by the lookup, absent or not answered when the save ran)",
    "saves_dropped_budget": "saves with no room in the save area at all: nothing copied",
    "save_objects_dropped_budget": "objects of saves that found the save area too full for them",
    "saves_skipped_breaker": "saves not copied because the store's breaker was open",
    "saves_copied_off_step": "saves whose blocks were copied on the copy thread, not on the engine's step",
    "saves_crashed": "saves a bug stopped (logged): dropped, never retried",
    "save_objects_not_held": "objects a save planned whose blocks vLLM no longer held",
    "bytes_saved": "payload bytes stored",
    "puts_retried_no_space": "object puts tried again after the store refused them for lack of space",
    "pointers_<outcome>": "divergence pointers put, by outcome (stored, no_space, not_ready, failed)",
    "watermarks_<outcome>": "watermark records put, by outcome (stored, no_space, not_ready, failed)",
    "state_checkpoints": "Mamba state objects saved at block boundaries inside a prompt",
    "answer_saves": "saves of prompt + answer at request end",
    "answer_saves_skipped_loading": "answer saves skipped: the request ended while its load still filled its blocks",
    "answer_saves_skipped_in_flight": (
        "answer saves skipped on a Mamba model: more than the last sampled token's step in flight "
        "(draft tokens, a stale share after a preemption) or a stop inside accepted drafts had moved the state on"
    ),
    "block_copies_repaired": "vLLM copy-on-write block copies redone whole (hybrid models)",
    # the store (connector/instrumented.py counts every call by wrapping the store interface)
    "store_calls_<call>": "store calls made, by kind (exists, get, put)",
    "store_items_<call>": "keys asked or objects moved by store calls, by kind (exists, get, put)",
    "store_call_us_<call>": "microseconds callers waited on store calls, by kind (exists, get, put)",
    "store_errors_<call>": "store calls that failed or timed out, by call (exists, get, put)",
    "breaker_skipped_<call>": "store calls skipped while the breaker was open, by call (exists, get, put)",
    "breaker_opened": "times the breaker opened after failures in a row",
    "store_slow_<call>": "store calls that answered slower than slow_call_ms, and lookups given up on (lookup)",
    "store_bypassed_slow": "times slow answers (not errors) opened the breaker: the store was bypassed",
    # the engine's threads
    "engine_thread_us": "microseconds the connector spent on the engine's threads (every hook vLLM calls)",
    "engine_thread_calls": "connector hook calls on the engine's threads",
    "engine_thread_slow_calls": "connector hook calls over 20 ms",
}


def counter_help(name: str) -> str:
    """The help text of a counter: its own entry, else its family's (the longest prefix), with the label."""
    if name in COUNTERS:
        return COUNTERS[name]
    families = [key for key in COUNTERS if key.endswith(">") and name.startswith(key[: key.index("<")])]
    if families:
        family = max(families, key=len)
        label = name[len(family[: family.index("<")]) :]
        return f"{COUNTERS[family]} [{label}]"
    return f"kvtool connector: {name.replace('_', ' ')}"


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
                documentation=counter_help(name),
                labelnames=self._labelnames,
            )
            per_engine = {idx: counter.labels(*values) for idx, values in self.per_engine_labelvalues.items()}
            self._counters[name] = per_engine
        return per_engine[engine_idx]

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0):
        for name, value in transfer_stats_data.items():
            if value:
                self._counter(name, engine_idx).inc(value)
