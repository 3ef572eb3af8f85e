"""The results: one pair's counts (requests, faults, master events, failures, latencies) and the whole run's JSON."""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from typing import Any

from kvtool.pair.ready import ReadyFile
from kvtool.verify import DEFAULT_LOGPROB_TOLERANCE

from master import MasterEvent
from pair_soak import REQUEST_TIMEOUT_S, PairSoak
from plan import FAULT_WEIGHTS, FAULTS
from saves import PIPELINE_CHECK_S, SAVE_WAIT_S, SLOW_SAVE_WAIT_S


def event_report(soak: PairSoak, event: MasterEvent) -> dict[str, Any]:
    during = [(s, e, engine, purpose) for s, e, engine, purpose in soak.timeline if event.covers(s, e)]
    answered_inside = [
        1
        for s, e, *_ in during
        if event.down_at is not None and event.back_at is not None and event.down_at <= e <= event.back_at
    ]
    return {
        "kind": event.kind,
        "iteration": event.iteration,
        "freeze_s": event.freeze_s if event.kind == "freeze" else None,
        "old_pid": event.old_pid,
        "new_pid": event.new_pid,
        "replaced": event.replaced,
        "at_s": round(event.down_at - soak.started, 2) if event.down_at else None,
        "down_s": round(event.back_at - event.down_at, 2) if event.down_at and event.back_at else None,
        "requests_in_flight_while_down": len(during),
        "requests_answered_while_down": len(answered_inside),
        "slowest_request_while_down_s": round(max((e - s for s, e, *_ in during), default=0.0), 2),
        "note": event.note.strip(),
    }


def pair_report(soak: PairSoak, wall_s: float) -> dict[str, Any]:
    events = [event_report(soak, e) for e in soak.events]
    latencies = sorted(e - s for s, e, *_ in soak.timeline)
    final = soak.final_ready
    return {
        "roles": soak.pair.roles,
        "kv_roles": {"producer": "kv_both", "consumer": "kv_both"}
        if soak.pair.roles == "both"
        else {"producer": "kv_producer", "consumer": "kv_consumer"},
        "command": " ".join(["kvtool", *soak.pair.argv[3:]]),
        "iterations": soak.args.iterations,
        "requests_served": dict(soak.requests),
        "requests_total": sum(soak.requests.values()),
        "answers_verified": soak.verified,
        "faults_injected": dict(soak.faults),
        "master_kills": sum(e.kind == "kill" for e in soak.events),
        "master_freezes": sum(e.kind == "freeze" for e in soak.events),
        "master_replaced_while_frozen": sum(e.kind == "freeze" and e.replaced for e in soak.events),
        "master_restarts_by_serve_pair": final.restarts.get("master") if final is not None else None,
        "requests_in_flight_while_master_down": sum(e["requests_in_flight_while_down"] for e in events),
        "requests_answered_while_master_down": sum(e["requests_answered_while_down"] for e in events),
        "master_events": events,
        "outcomes": dict(sorted(soak.outcomes.items())),
        "saves": dict(sorted(soak.saves.items())),
        "mismatches": len(soak.mismatches),
        "hangs": len(soak.hangs),
        "errors": len(soak.errors),
        "worst_logprob_diff_of_matches": soak.worst_logprob_diff,
        "latency_s": {
            "p50": round(latencies[len(latencies) // 2], 3) if latencies else None,
            "p99": round(latencies[int(len(latencies) * 0.99)], 3) if latencies else None,
            "max": round(latencies[-1], 3) if latencies else None,
        },
        "mismatch_list": soak.mismatches,
        "hang_list": soak.hangs,
        "error_list": soak.errors,
        "log_dir": soak.pair.info.log_dir,
        "wall_s": round(wall_s, 1),
    }


def run_result(args: argparse.Namespace, reports: dict[str, dict], pair_info: ReadyFile | None, wall_s: float) -> dict:
    """The whole run: its command and configuration, totals over the pairs, and each pair's report."""
    return {
        "command": " ".join(["python", "benchmarks/soak/soak.py", *sys.argv[1:]]),
        "config": {
            "iterations_per_pair": args.iterations,
            "pairs": args.roles_list,
            "fault_rate": args.fault_rate,
            "shared_prefix_rate": args.shared_prefix_rate,
            "master_kills_per_pair": args.kills,
            "master_freezes_per_pair": args.freezes,
            "freeze_seconds": args.freeze_list,
            "seed": args.seed,
            "model": pair_info.model if pair_info else None,
            "block_size": pair_info.block_size if pair_info else None,
            "hash_unit": pair_info.hash_unit if pair_info else None,
            "logprob_tolerance": DEFAULT_LOGPROB_TOLERANCE,
            "request_timeout_s": REQUEST_TIMEOUT_S,
            "save_wait_s": {"default": SAVE_WAIT_S, "slow_store_or_save_in_flight": SLOW_SAVE_WAIT_S},
            "pipeline_check_s": PIPELINE_CHECK_S,
            "fault_plans": FAULTS,
            "fault_weights": FAULT_WEIGHTS,
        },
        "requests_total": sum(r["requests_total"] for r in reports.values()),
        "faults_injected": dict(sum((Counter(r["faults_injected"]) for r in reports.values()), Counter())),
        "master_kills": sum(r["master_kills"] for r in reports.values()),
        "master_freezes": sum(r["master_freezes"] for r in reports.values()),
        "mismatches": sum(r["mismatches"] for r in reports.values()),
        "hangs": sum(r["hangs"] for r in reports.values()),
        "errors": sum(r["errors"] for r in reports.values()),
        "pairs": reports,
        "wall_s": round(wall_s, 1),
    }
