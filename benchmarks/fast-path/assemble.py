"""Issue 19's fast-path figures in one file, each from the run that measured it side by side with its
baseline: ``results.json`` names every source, its goal, and whether it is met. A figure no run here
has measured yet is null with the reason, never a guess.

    .venv/bin/python benchmarks/fast-path/assemble.py   # after the runs in README.md
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvtool.bench.report import bucket_label, percentile
from kvtool.portable import portable

HERE = Path(__file__).resolve().parent
# The peers runs pooled (``pooled``): --compare kvtool,vllm-mooncake-store,lmcache,none and the reverse
# order, twice (a second round where it was run).
PEER_RUNS = [
    HERE.parent / "compare-peers" / name
    for name in ("results.json", "results-reversed.json", "results-round2.json", "results-round2-reversed.json")
]

# kvtool against each peer, each pair of pairs interleaved (../compare-peers/interleaved/command.sh).
INTERLEAVED = HERE.parent / "compare-peers" / "interleaved"
INTERLEAVED_SOURCE = (
    "../compare-peers/interleaved/kvtool-vs-*.json (command.sh there: --compare kvtool,PEER --interleave)"
)
# The workloads those runs leave out, likewise (../compare-peers/interleaved-answers/command.sh).
ANSWERS = HERE.parent / "compare-peers" / "interleaved-answers"
ANSWERS_SOURCE = (
    "../compare-peers/interleaved-answers/{answers,trace256}-kvtool-vs-*.json (command.sh there: --compare "
    "kvtool,PEER --interleave; chat, shared-prefix, prefix-repetition with --roles both; the trace at block 256)"
)


def load(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.exists() else None


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    return round(numerator / denominator, 3) if numerator and denominator else None


def field(value: Any, goal: str, met: bool | None, source: str, note: str = "") -> dict[str, Any]:
    entry = {"value": value, "goal": goal, "met": met, "source": source}
    if note:
        entry["note"] = note
    return entry


def data_path_fields(data: dict[str, Any] | None) -> dict[str, Any]:
    source = "data_path.json (data_path.py)"
    if data is None:
        return {name: field(None, ">= 0.8", None, source, "not run") for name in ("load_vs_raw", "save_vs_raw")}
    return {
        "load_vs_raw": field(data["load_vs_raw"], ">= 0.8", data["load_vs_raw"] >= 0.8, source),
        "save_vs_raw": field(data["save_vs_raw"], ">= 0.8", data["save_vs_raw"] >= 0.8, source),
    }


def lookup_fields(latency: dict[str, Any] | None, cpu: dict[str, Any] | None) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    if latency is not None:
        p99 = {str(level): value for level, value in latency["lookup_p99_ms"].items()}
        met = all(value < 2.0 for value in p99.values())
        rows = latency["lookup_ms_by_batch"]
        floor = {level: row["raw_exists_p99_ms"] for level, row in rows.items() if "raw_exists_p99_ms" in row}
        note = f"the master's own p99 for the same existence queries, asked straight: {floor} ms" if floor else ""
        fields["lookup_p99_ms"] = field(p99, "< 2 ms at 1, 16 and 64", met, "lookup_latency.json", note)
    if cpu is not None:
        at_256 = cpu["lookup_cpu_ms_by_prompt_tokens"]  # block 256, hash unit 1, a miss (the worst case)
        met = at_256.get("32768", 1e9) < 20.0
        fields["lookup_cpu_ms_by_prompt_tokens"] = field(at_256, "< 20 ms at 32768", met, "lookup_cpu.json")
    return fields


def pooled(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per connector, the consumer TTFT p50s (overall, vLLM's own, per workload, per prompt-length bucket),
    efficiency and mismatches over the requests of every run in ``docs`` together. The peers run in
    both orders (``--compare kvtool,...,none`` and ``none,...,kvtool``): the pairs run one after the
    other for about twenty minutes and this machine drifts by more than the differences between them,
    so each connector's requests are pooled from a run where it went early and one where it went late."""
    requests: dict[str, list[dict[str, Any]]] = {}
    for doc in docs:
        for name, run in doc["connectors"].items():
            requests.setdefault(name, []).extend(run["requests"])
    # The block size the bench's buckets use: the engines' own where a model sets it (hybrids).
    sizes = {doc["pair"].get("kv_block_size") or doc["pair"]["block_size"] for doc in docs}
    if len(sizes) != 1:
        raise SystemExit(f"the peers runs to pool used different block sizes: {sorted(sizes)}")
    block_size = sizes.pop()
    return {name: _pooled_summary(rows, block_size) for name, rows in requests.items()}


def _pooled_summary(rows: list[dict[str, Any]], block_size: int) -> dict[str, Any]:
    def p50(members: list[dict[str, Any]], key: str = "ttft_ms") -> float | None:
        # As ``summarize``: the consumer's TTFT where the set has consumer requests (else every request's:
        # chat's producer turns), and vLLM's engine TTFT of consumer requests only.
        consumers = [r for r in members if r.get("engine") == "consumer"]
        if not consumers and key == "ttft_ms":
            consumers = members
        return percentile([r[key] for r in consumers if r.get(key) is not None], 0.5)

    workloads: dict[str, list[dict[str, Any]]] = {}
    buckets: dict[str, list[dict[str, Any]]] = {}
    for row in sorted(rows, key=lambda r: r["prompt_tokens"]):
        workloads.setdefault(row["workload"], []).append(row)
        buckets.setdefault(bucket_label(row["prompt_tokens"], block_size), []).append(row)
    ideal = sum(r["ideal_tokens"] for r in rows)
    return {
        "ttft_ms_p50": p50(rows),
        "engine_ttft_ms_p50": p50(rows, "engine_ttft_ms"),
        "workloads": {workload: p50(members) for workload, members in workloads.items()},
        "engine_workloads": {workload: p50(members, "engine_ttft_ms") for workload, members in workloads.items()},
        "buckets": {bucket: p50(members) for bucket, members in buckets.items()},
        "efficiency": sum(r["hit_tokens"] for r in rows) / ideal if ideal else None,
        # What the lookups found: the hits and what the cost model declined (bench results since 0fa16bb).
        "found_efficiency": sum(r["hit_tokens"] + r.get("declined_tokens", 0) for r in rows) / ideal if ideal else None,
        "mismatches": sum(1 for r in rows if r.get("matched") is False),
        "requests": len(rows),
    }


def peer_fields(docs: list[dict[str, Any] | None]) -> dict[str, Any]:
    docs = [doc for doc in docs if doc is not None]
    if not docs:
        return {}
    orders = " and ".join(f"--compare {','.join(doc['connectors'])}" for doc in docs)
    source = f"../compare-peers/results*.json (kvtool bench {orders}; every request of these runs pooled)"
    runs = pooled(docs)
    if "kvtool" not in runs:  # its pair failed in every run (the files' ``failures`` say why)
        return {}
    kvtool = runs["kvtool"]
    others = {name: run for name, run in runs.items() if name != "kvtool"}

    def lowest(value: float | None, peers: list[float | None]) -> bool:
        peers = [v for v in peers if v is not None]
        return value is not None and bool(peers) and value <= min(peers)

    by_workload = {
        workload: {name: run["workloads"].get(workload) for name, run in runs.items()}
        for workload in kvtool["workloads"]
    }
    workloads_met = all(
        lowest(row["kvtool"], [v for n, v in row.items() if n != "kvtool"]) for row in by_workload.values()
    )
    return {
        "consumer_ttft_ms_p50_by_prompt_tokens": field(
            {name: run["buckets"] for name, run in runs.items()}, "kvtool no higher than the best peer", None, source
        ),
        "consumer_ttft_ms_p50": field(
            {name: run["ttft_ms_p50"] for name, run in runs.items()},
            "kvtool no higher than the best peer",
            lowest(kvtool["ttft_ms_p50"], [run["ttft_ms_p50"] for run in others.values()]),
            source,
        ),
        "consumer_engine_ttft_ms_p50": field(
            {name: run["engine_ttft_ms_p50"] for name, run in runs.items()},
            "kvtool no higher than any other (none included; vLLM's own TTFT: no HTTP)",
            lowest(kvtool["engine_ttft_ms_p50"], [run["engine_ttft_ms_p50"] for run in others.values()]),
            source,
        ),
        "consumer_ttft_ms_p50_by_workload": field(
            by_workload,
            "kvtool no higher than any other (none included) on every workload",
            workloads_met,
            source,
            "the pairs one after another, before --interleave and before the cost model judged the bench model's "
            "hits: each connector's TTFT follows the minutes it ran in; interleaved_consumer_ttft_ms_p50_by_workload "
            "measures the same goal with every request of both pairs in the same minutes",
        ),
        "consumer_engine_ttft_ms_p50_by_workload": field(
            {
                workload: {name: run["engine_workloads"].get(workload) for name, run in runs.items()}
                for workload in kvtool["workloads"]
            },
            "none (what the consumer's vLLM measured, without HTTP: beside the goal above)",
            None,
            source,
        ),
        "efficiency": field(
            {name: round(run["efficiency"], 4) for name, run in runs.items()},
            "kvtool >= 0.99",
            kvtool.get("efficiency", 0) >= 0.99,
            source,
        ),
        "mismatches": field(
            {name: run["mismatches"] for name, run in runs.items()}, "0", kvtool.get("mismatches") == 0, source
        ),
    }


def interleaved_fields(
    runs: list[tuple[str, dict[str, Any] | None]], prefix: str = "interleaved", source: str = ""
) -> dict[str, Any]:
    """kvtool against each peer head to head, each run interleaved (``kvtool bench --compare kvtool,PEER
    --interleave``: both pairs up at once, every step sent to both in turn), so both connectors'
    requests share every stretch of the machine's drift: the goal judged in the same run, per peer.
    ``runs``: (label, document) per run, the label naming its peer (and its workloads, where a peer has
    several runs)."""
    runs = [
        (label, doc)
        for label, doc in runs
        if doc is not None and "kvtool" in doc["connectors"] and len(doc["connectors"]) == 2
    ]
    if not runs:
        return {}
    source = source or INTERLEAVED_SOURCE
    overall: dict[str, dict[str, Any]] = {}
    by_workload: dict[str, dict[str, dict[str, Any]]] = {}
    engine_by_workload: dict[str, dict[str, dict[str, Any]]] = {}
    efficiency: dict[str, dict[str, Any]] = {}
    for label, doc in runs:
        summaries = pooled([doc])
        peer = next(name for name in summaries if name != "kvtool")
        overall[label] = {name: summaries[name]["ttft_ms_p50"] for name in ("kvtool", peer)}
        overall[label]["engine"] = {name: summaries[name]["engine_ttft_ms_p50"] for name in ("kvtool", peer)}
        by_workload[label] = {
            workload: {name: summaries[name]["workloads"].get(workload) for name in ("kvtool", peer)}
            for workload in summaries["kvtool"]["workloads"]
        }
        engine_by_workload[label] = {
            workload: {name: summaries[name]["engine_workloads"].get(workload) for name in ("kvtool", peer)}
            for workload in summaries["kvtool"]["engine_workloads"]
        }
        efficiency[label] = {
            name: {
                "efficiency": round(summaries[name]["efficiency"], 4),
                "found_efficiency": round(summaries[name]["found_efficiency"], 4),
                "mismatches": summaries[name]["mismatches"],
            }
            for name in ("kvtool", peer)
        }

    def no_higher(pair: dict[str, Any], _label: str = "") -> bool:
        peer = next(name for name in pair if name not in ("kvtool", "engine"))
        return pair["kvtool"] is not None and pair[peer] is not None and pair["kvtool"] <= pair[peer]

    return {
        f"{prefix}_consumer_ttft_ms_p50": field(
            overall,
            "kvtool no higher than each peer in the same interleaved run (client TTFT; engine beside it)",
            all(no_higher(pair) for pair in overall.values()),
            source,
        ),
        f"{prefix}_consumer_ttft_ms_p50_by_workload": field(
            by_workload,
            "kvtool no higher than each peer on every workload, in the same interleaved run",
            all(no_higher(pair) for rows in by_workload.values() for pair in rows.values()),
            source,
        ),
        f"{prefix}_consumer_engine_ttft_ms_p50_by_workload": field(
            engine_by_workload,
            "none (the consumer's vLLM's own TTFT, without HTTP: beside the goal above)",
            None,
            source,
            higher_cells(engine_by_workload, no_higher),
        ),
        f"{prefix}_efficiency_and_mismatches": field(
            efficiency,
            "kvtool >= 0.99 (hits taken over the ideal) and 0 mismatches in every run",
            all(e["kvtool"]["efficiency"] >= 0.99 and e["kvtool"]["mismatches"] == 0 for e in efficiency.values()),
            source,
            "found_efficiency: the hits and what the cost model declined as costing more than they save",
        ),
    }


def answers_runs() -> list[tuple[str, dict[str, Any] | None]]:
    """../compare-peers/interleaved-answers: per peer, the answers workloads and the trace at block 256."""
    kinds = {"answers": "chat, shared-prefix, prefix-repetition", "trace256": "the trace at block 256"}
    return [
        (f"{path.stem.split('-vs-', 1)[1]} ({kinds[path.stem.split('-', 1)[0]]})", load(path))
        for path in sorted(ANSWERS.glob("*-kvtool-vs-*.json"))
    ]


def higher_cells(table: dict[str, dict[str, dict[str, Any]]], no_higher: Callable[[dict[str, Any], str], bool]) -> str:
    """Where kvtool's value is above the peer's in a per-peer, per-workload table, said in one line."""
    cells = [
        f"{workload} against {peer}"
        for peer, rows in table.items()
        for workload, pair in rows.items()
        if not no_higher(pair, peer)
    ]
    return "kvtool's higher on: " + "; ".join(cells) if cells else "kvtool's no higher on any workload of any run"


def capacity_fields(capacity: dict[str, Any] | None) -> dict[str, Any]:
    """Reuse under capacity pressure (``../capacity-pressure``): kvtool's reused tokens over vLLM's connector's."""
    if capacity is None:
        return {}
    summary = {name: run["summary"] for name, run in capacity["connectors"].items()}
    kvtool, peer = summary.get("kvtool", {}), summary.get("vllm-mooncake-store", {})
    value = ratio(kvtool.get("hit_tokens"), peer.get("hit_tokens"))
    blocks = ratio(kvtool.get("block_hit_tokens"), peer.get("block_hit_tokens"))
    return {
        "capacity_pressure_reuse_vs_vllm_connector": field(
            {"reused_tokens": value, "block_tokens": blocks},
            ">= 1.0 (reused tokens, tails never costing blocks)",
            value is not None and value >= 1.0 and blocks is not None and blocks >= 1.0,
            "../capacity-pressure/results.json (kvtool bench --compare --segment-mib 16)",
        )
    }


def producer_fields(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The producer's throughput against none from ``producer.json`` (``kvtool bench --compare
    kvtool,none``, this head) and ``producer-none-first.json`` (``--compare none,kvtool``), which replace
    the peers run's figure. The pairs run one after the other and the machine drifts between them by
    as much as the effect, so each order is run once and the figure is the geometric mean of the two
    runs' ratios (a drift that favours the pair run second cancels); each run's ratio is beside it."""
    runs = [run for run in runs if run is not None]
    if not runs:
        return {}
    source = "producer.json and producer-none-first.json (kvtool bench --compare kvtool,none and none,kvtool)"
    by_run = []
    for run in runs:
        summary = {name: r["summary"] for name, r in run["connectors"].items()}
        kvtool, none = summary["kvtool"], summary["none"]
        engine_ratio = ratio(none.get("producer_engine_ms_p50"), kvtool.get("producer_engine_ms_p50"))
        client_ratio = ratio(none.get("producer_ms_p50"), kvtool.get("producer_ms_p50"))
        order = ",".join(run["connectors"])
        by_run.append(
            (engine_ratio, client_ratio, order, none["producer_engine_ms_p50"], kvtool["producer_engine_ms_p50"])
        )
    engine = geometric_mean([r[0] for r in by_run])
    client = geometric_mean([r[1] for r in by_run])
    note = (
        "serial producer requests, each a new prompt (a miss): none's producer p50 over kvtool's by vLLM's own "
        "latency; the geometric mean of "
        + "; ".join(
            f"--compare {order}: {value} ({none_ms:.1f} / {kvtool_ms:.1f} ms)"
            for value, _, order, none_ms, kvtool_ms in by_run
        )
    )
    client_note = "the same by the client's latency: " + ", ".join(str(r[1]) for r in by_run)
    return {
        "producer_throughput_vs_none": field(engine, ">= 0.97", engine is not None and engine >= 0.97, source, note),
        "producer_throughput_vs_none_client": field(
            client, ">= 0.97", client is not None and client >= 0.97, source, client_note
        ),
    }


def geometric_mean(values: list[float | None]) -> float | None:
    if not values or any(value is None for value in values):
        return None
    product = 1.0
    for value in values:
        product *= value
    return round(product ** (1 / len(values)), 3)


def stream_fields(gaps: dict[str, Any] | None) -> dict[str, Any]:
    source = "stream_gap.json (stream_gap.py)"
    if gaps is None:
        return {"stream_gap_vs_none": field(None, "<= 1.2", None, source, "not run")}
    value = gaps["stream_gap_vs_none"]
    config = gaps["configuration"]
    note = (
        f"worst inter-token gap of a decoding stream while {config['savers']} requests of "
        f"{config['prompt_tokens']} tokens are prefilled and saved: kvtool {gaps['kvtool']['gap_ms_max']} ms, "
        f"none {gaps['none']['gap_ms_max']} ms (p99 {gaps['stream_gap_p99_vs_none']}x)"
    )
    return {"stream_gap_vs_none": field(value, "<= 1.2", value <= 1.2, source, note)}


def main() -> None:
    results: dict[str, Any] = {
        **data_path_fields(load(HERE / "data_path.json")),
        **lookup_fields(load(HERE / "lookup_latency.json"), load(HERE / "lookup_cpu.json")),
        **peer_fields([load(path) for path in PEER_RUNS]),
        **interleaved_fields(
            [
                (path.stem.removeprefix("kvtool-vs-"), load(path))
                for path in sorted(INTERLEAVED.glob("kvtool-vs-*.json"))
            ]
        ),
        **interleaved_fields(answers_runs(), "interleaved_answers_and_trace256", ANSWERS_SOURCE),
        **producer_fields([load(HERE / "producer.json"), load(HERE / "producer-none-first.json")]),
        **capacity_fields(load(HERE.parent / "capacity-pressure" / "results.json")),
        **stream_fields(load(HERE / "stream_gap.json")),
    }
    (HERE / "results.json").write_text(json.dumps(portable(results), indent=2) + "\n")
    print(json.dumps({name: (entry["value"], entry["met"]) for name, entry in results.items()}, indent=1))


if __name__ == "__main__":
    main()
