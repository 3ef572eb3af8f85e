"""``kvtool bench --load trace:PATH``: a Mooncake trace at its timestamps, each request a session of
one turn; its prompts made from its hash ids (equal ids, equal tokens), its arrivals scaled. Pure,
on the committed excerpt of the shared trace (tests/data/README.md)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvtool.bench.workloads.trace import TRACE_BLOCK_TOKENS, read_trace
from kvtool.errors import UserError
from kvtool.load.options import LoadOptions
from kvtool.load.sessions import LoadShape, TraceLoad, plan_sessions

TRACE = Path(__file__).resolve().parents[1] / "data" / "mooncake_synthetic_trace_tail.jsonl"


def shape(trace: TraceLoad, sessions: int = 24, max_prompt_tokens: int = 4096) -> LoadShape:
    return LoadShape("trace", sessions, 16, 1000, max_prompt_tokens, 16, 1.0, None, 0, trace)


def test_each_request_arrives_at_its_timestamp_times_the_scale_as_one_turn():
    requests = read_trace(TRACE, 0, 24)
    plans = plan_sessions(shape(TraceLoad(TRACE, block_tokens=16, time_scale=2.0)))
    assert len(plans) == 24 and all(len(plan.turns) == 1 for plan in plans)
    first = requests[0].timestamp_ms
    assert [plan.start_s for plan in plans] == [(r.timestamp_ms - first) / 1000.0 * 2.0 for r in requests]
    for plan, request in zip(plans, requests, strict=True):
        turn = plan.turns[0]
        assert turn.max_tokens == max(1, min(request.output_length, 16))
        whole, part = divmod(request.input_length, TRACE_BLOCK_TOKENS)
        assert len(turn.message) // 16 == whole and (len(turn.message) % 16 > 0) == (part > 0)


def test_equal_hash_ids_give_equal_tokens_and_a_long_prompt_is_cut_to_the_engines_limit():
    requests = read_trace(TRACE, 0, 24)
    plans = plan_sessions(shape(TraceLoad(TRACE, block_tokens=16), max_prompt_tokens=100))
    assert max(len(plan.turns[0].message) for plan in plans) <= 100
    full = plan_sessions(shape(TraceLoad(TRACE, block_tokens=16)))
    by_id: dict[int, tuple[int, ...]] = {}
    for plan, request in zip(full, requests, strict=True):
        for position, block in enumerate(request.hash_ids[:-1]):  # the last may be partial
            tokens = plan.turns[0].message[16 * position : 16 * (position + 1)]
            assert by_id.setdefault(block, tokens) == tokens
    assert plan_sessions(shape(TraceLoad(TRACE))) == full  # seeded: the same shape, the same sessions


def test_a_record_without_a_timestamp_arrives_with_the_one_before_it(tmp_path):
    lines = [json.loads(line) for line in TRACE.read_text().splitlines()[:3]]
    del lines[1]["timestamp"]
    trace = tmp_path / "trace.jsonl"
    trace.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    plans = plan_sessions(shape(TraceLoad(trace), sessions=3))
    assert plans[0].start_s == plans[1].start_s == 0.0 < plans[2].start_s


@pytest.mark.parametrize(
    ("given", "said"),
    [
        ({"load": "trace"}, "is not one of: agentic, chat, trace:PATH"),
        ({"load": "chat:x"}, "is not one of: agentic, chat, trace:PATH"),
        ({"load": f"trace:{TRACE}", "session_rate": 0.5}, "sends at the trace's timestamps"),
        ({"load": f"trace:{TRACE}", "sweep_rates": "0.1,0.2"}, "sends at the trace's timestamps"),
        ({"load": f"trace:{TRACE}", "time_scale": 0.0}, "--time-scale 0 must be a number above 0"),
    ],
)
def test_a_bad_trace_load_is_one_sentence(given, said):
    with pytest.raises(UserError, match=said):
        LoadOptions(**given).check()


def test_a_bad_timestamp_names_its_line(tmp_path):
    record = json.loads(TRACE.read_text().splitlines()[0]) | {"timestamp": "soon"}
    trace = tmp_path / "trace.jsonl"
    trace.write_text(json.dumps(record) + "\n")
    with pytest.raises(UserError, match="line 1: timestamp must be a number of milliseconds"):
        read_trace(trace, 0, 1)
