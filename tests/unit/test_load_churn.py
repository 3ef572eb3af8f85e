"""``kvtool bench --load --kill-engine-after``: when the engine is killed, when the router's list shows
it out and back (the rule, on scripted polls), each phase's TTFT, and the flag's checks."""

from __future__ import annotations

import pytest

from kvtool.errors import UserError
from kvtool.load.churn import Churn, RotationWatch, phase_summaries, victim
from kvtool.load.metrics import RequestRecord
from kvtool.load.options import LoadOptions
from kvtool.pair.ready import ReadyFile

URL = "http://127.0.0.1:8102"
OTHERS = {"http://127.0.0.1:8100", "http://127.0.0.1:8101"}


def watch_of(killed: list[int]) -> RotationWatch:
    return RotationWatch(None, "engine-2", URL, 4242, kill_after_s=10.0, clock=lambda: 0.0, kill=killed.append)  # type: ignore[arg-type]


def test_the_engine_is_killed_when_due_and_seen_out_then_back_in_the_routers_list():
    killed: list[int] = []
    watch = watch_of(killed)
    watch.observe(9.5, OTHERS | {URL})
    assert killed == [] and watch.churn == Churn("engine-2", URL)
    watch.observe(10.0, OTHERS | {URL})
    assert killed == [4242] and watch.churn.killed_s == 10.0
    watch.observe(10.5, OTHERS | {URL})  # the router has not taken it out yet
    watch.observe(11.0, None)  # a poll the router did not answer changes nothing
    assert watch.churn.out_s is None
    watch.observe(11.5, OTHERS)
    watch.observe(40.0, OTHERS)
    watch.observe(80.5, OTHERS | {URL})
    watch.observe(81.0, OTHERS)  # a later change is not this churn's
    assert watch.churn == Churn("engine-2", URL, killed_s=10.0, out_s=11.5, back_s=80.5)
    assert killed == [4242]


def test_an_engine_that_ended_before_its_kill_still_starts_its_phase():
    def gone(pid: int) -> None:
        raise ProcessLookupError(pid)

    watch = RotationWatch(None, "engine-2", URL, 1, 5.0, clock=lambda: 0.0, kill=gone)  # type: ignore[arg-type]
    watch.observe(5.0, OTHERS)
    assert watch.churn.killed_s == 5.0


def _record(sent_s: float, ttft_s: float, error: str | None = None) -> RequestRecord:
    return RequestRecord(
        0, 0, sent_s, 100, 2, ttft_s=ttft_s, e2e_s=ttft_s + 0.1, hit_tokens=50, ideal_tokens=100, error=error
    )


def test_each_phase_holds_the_requests_sent_in_it_with_their_own_percentiles():
    records = [
        _record(1.0, 0.2),
        _record(5.0, 0.4),
        _record(12.0, 3.0),
        _record(20.0, 0.0, "HTTP 503"),
        _record(90.0, 0.3),
    ]
    phases = phase_summaries(records, Churn("engine-2", URL, 10.0, 11.5, 80.5), slo_ttft_ms=2000.0)
    assert [(p["phase"], p["from_s"], p["to_s"], p["requests"], p["failed"]) for p in phases] == [
        ("before", 0.0, 10.0, 2, 0),
        ("down", 10.0, 80.5, 2, 1),
        ("rejoined", 80.5, None, 1, 0),
    ]
    assert phases[0]["ttft_ms"]["p50"] == 300.0 and phases[1]["ttft_ms"]["p99"] == 3000.0


def test_an_engine_not_back_before_the_end_leaves_the_down_phase_open_and_no_rejoined_one():
    phases = phase_summaries([_record(1.0, 0.2), _record(30.0, 0.5)], Churn("engine-2", URL, 10.0, 11.0), None)
    assert [(p["phase"], p["to_s"]) for p in phases] == [("before", 10.0), ("down", None)]


def _ready(engines: dict[str, str], router: str | None = "http://127.0.0.1:8000") -> ReadyFile:
    return ReadyFile(
        producer="p",
        consumer="c",
        model="m",
        block_size=16,
        hash_unit=1,
        max_model_len=2048,
        connector="kvtool",
        router=router,
        engines=engines,
        pids={name: 100 + i for i, name in enumerate(engines)},
    )


def test_the_victim_is_the_fleets_last_engine_and_a_pair_is_refused_in_one_sentence():
    fleet = _ready({"engine-0": "http://127.0.0.1:8100", "engine-1": "http://127.0.0.1:8101"})
    assert victim(fleet) == ("engine-1", "http://127.0.0.1:8101", 101)
    for lone in (_ready({"engine-0": "http://127.0.0.1:8100"}), _ready({}, router=None)):
        with pytest.raises(UserError, match="--kill-engine-after needs a fleet of 2 engines or more"):
            victim(lone)


@pytest.mark.parametrize(
    ("given", "said"),
    [
        ({"kill_engine_after": 0.0}, "--kill-engine-after 0 must be more than 0"),
        ({"kill_engine_after": 5.0, "sweep_rates": "0.1,0.2"}, "leave --sweep-rates out"),
    ],
)
def test_a_bad_kill_engine_after_is_one_sentence(given, said):
    with pytest.raises(UserError, match=said):
        LoadOptions(load="agentic", **given).check()
