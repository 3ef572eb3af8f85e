"""``kvtool bench --load --add-engine-after``: when the engine is asked for, when the router's list
shows it in (the rule, on scripted polls), each phase's TTFT, and the flag's checks."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtool.errors import UserError
from kvtool.load.join import Join, JoinWatch, fleet_to_grow, join_note, join_phases
from kvtool.load.options import LoadOptions

from .test_load_churn import OTHERS, _ready, _record

NEW = "http://127.0.0.1:8102"


def test_the_engine_is_asked_for_when_due_and_seen_when_a_new_url_is_in_the_routers_list(tmp_path):
    asked: list[tuple[Path, int]] = []
    watch = JoinWatch(None, tmp_path, 2, 10.0, clock=lambda: 0.0, ask=lambda d, n: asked.append((d, n)))  # type: ignore[arg-type]
    watch.observe(0.5, set(OTHERS))  # the list at the load's start (start() reads it; here the first poll)
    watch.observe(9.5, set(OTHERS))
    assert asked == [] and watch.join == Join(2)
    watch.observe(10.0, set(OTHERS))
    assert asked == [(tmp_path, 3)] and watch.join.asked_s == 10.0
    watch.observe(30.0, None)  # a poll the router did not answer changes nothing
    watch.observe(60.0, OTHERS | {NEW})
    watch.observe(61.0, OTHERS | {NEW, "http://127.0.0.1:8103"})  # a later change is not this join's
    assert watch.join == Join(2, asked_s=10.0, joined_s=60.0, url=NEW) and asked == [(tmp_path, 3)]
    assert join_note(watch.join) == f"engine 3 of the fleet asked for at 10 s, {NEW} in the router's list at 60 s"


def test_each_phase_holds_the_requests_sent_in_it():
    records = [_record(1.0, 0.2), _record(12.0, 3.0), _record(20.0, 0.0, "HTTP 503"), _record(90.0, 0.3)]
    phases = join_phases(records, Join(2, 10.0, 80.0, NEW), slo_ttft_ms=2000.0)
    assert [(p["phase"], p["from_s"], p["to_s"], p["requests"], p["failed"]) for p in phases] == [
        ("before", 0.0, 10.0, 1, 0),
        ("joining", 10.0, 80.0, 2, 1),
        ("joined", 80.0, None, 1, 0),
    ]
    unjoined = join_phases(records, Join(2, 10.0), None)
    assert [(p["phase"], p["to_s"]) for p in unjoined] == [("before", 10.0), ("joining", None)]
    assert "not in the router's list before the load ended" in join_note(Join(2, 10.0))


def test_only_a_fleet_grows_and_the_flag_is_checked_in_one_sentence():
    fleet = _ready({"engine-0": "http://127.0.0.1:8100", "engine-1": "http://127.0.0.1:8101"})
    with pytest.raises(UserError, match="--add-engine-after needs a fleet"):
        fleet_to_grow(_ready({}, router=None))
    with pytest.raises(UserError, match="--add-engine-after needs a fleet"):
        fleet_to_grow(fleet)  # a ready file without its log directory names no fleet to ask
    grown = fleet.model_copy(update={"log_dir": "/logs"})
    assert fleet_to_grow(grown) == (Path("/logs"), 2)
    for given, said in (
        ({"add_engine_after": 0.0}, "--add-engine-after 0 must be more than 0"),
        ({"add_engine_after": 5.0, "kill_engine_after": 5.0}, "leave --sweep-rates and --kill-engine-after out"),
    ):
        with pytest.raises(UserError, match=said):
            LoadOptions(load="agentic", **given).check()
