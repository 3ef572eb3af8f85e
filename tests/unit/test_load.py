"""`kvtool bench --load`: the sessions a load test plans, vLLM's metric definitions, and a run against
a scripted server (pure logic; tests/e2e/test_fleet.py runs one on a fleet)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtool.errors import UserError
from kvtool.load.options import LoadOptions
from kvtool.load.metrics import RequestRecord, percentile, summarize
from kvtool.load.runner import LoadRunner, LoadTarget
from kvtool.load.sessions import LoadShape, plan_sessions

BLOCK = 32


def shape(**overrides) -> LoadShape:
    values = dict(
        workload="agentic",
        sessions=6,
        block_size=BLOCK,
        vocab_size=500,
        max_prompt_tokens=1000,
        answer_tokens=8,
        think_s=1.0,
        session_rate=None,
        seed=0,
    )
    return LoadShape(**{**values, **overrides})


def test_agent_sessions_share_one_system_prompt_and_grow_by_answer_and_tool_result():
    plans = plan_sessions(shape())
    firsts = [plan.turns[0].message for plan in plans]
    system = len(firsts[0]) - 1
    while any(first[:system] != firsts[0][:system] for first in firsts):
        system -= 1
    assert system >= 1000 // 3 - 1  # the shared system-and-tools prompt
    assert len({first[system:] for first in firsts}) == len(firsts)  # each its own task
    for plan in plans:
        assert plan.longest_prompt <= 1000 and len(plan.turns) >= 2
        assert all(turn.think_s > 0 for turn in plan.turns[1:]) and plan.turns[0].think_s == 0


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), workload=st.sampled_from(["agentic", "chat"]), limit=st.integers(64, 3000))
def test_no_session_passes_the_engines_limit_and_most_messages_end_mid_block(seed, workload, limit):
    for plan in plan_sessions(shape(seed=seed, workload=workload, max_prompt_tokens=limit)):
        assert plan.longest_prompt <= limit
        assert all(turn.message for turn in plan.turns)


def test_the_same_shape_gives_the_same_sessions_and_an_open_loop_spaces_their_arrivals():
    assert plan_sessions(shape()) == plan_sessions(shape())
    closed = plan_sessions(shape())
    assert all(plan.start_s == 0 for plan in closed)
    opened = plan_sessions(shape(session_rate=2.0, sessions=200))
    starts = [plan.start_s for plan in opened]
    assert starts == sorted(starts) and starts[0] == 0
    assert 0.3 < (starts[-1] / (len(starts) - 1)) < 0.8  # about 1 / rate apart


def test_percentiles_interpolate_like_numpy():
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([1.0, 2.0, 3.0, 4.0], 90) == pytest.approx(3.7)


def test_tpot_itl_throughput_goodput_and_reuse_by_vllms_definitions():
    records = [
        RequestRecord(
            0, 0, 0.0, 100, 5, ttft_s=0.5, e2e_s=0.9, itl_s=(0.1, 0.1, 0.1, 0.1), hit_tokens=0, ideal_tokens=0
        ),
        RequestRecord(0, 1, 1.0, 150, 1, ttft_s=1.5, e2e_s=1.5, hit_tokens=90, ideal_tokens=104),
        RequestRecord(1, 0, 1.5, 80, 0, 0.0, 0.0, error="HTTP 500"),
    ]
    summary = summarize(records, slo_ttft_ms=1000.0)
    assert (summary.requests, summary.failed) == (3, 1)
    assert summary.duration_s == 2.5  # first send (0.0) to the last answer (1.0 + 1.5)
    assert summary.tpot_ms["p50"] == 100.0  # (0.9 - 0.5) / 4; one-token answers have none
    assert summary.itl_ms["p99"] == 100.0
    assert summary.request_throughput == pytest.approx(0.8) and summary.output_throughput == pytest.approx(2.4)
    assert summary.goodput == pytest.approx(0.4)  # one request within 1 s
    assert summary.reuse_vs_ideal == pytest.approx(90 / 104)


class ScriptedServer:
    """Answers a streamed completion with ``max_tokens`` token ids, and a hit of everything it saw before."""

    def __init__(self):
        self.prompts: list[list[int]] = []
        self.seen: list[tuple[int, ...]] = []

    def __call__(self, url, model, prompt, max_tokens, **kwargs):
        self.prompts.append(list(prompt))
        if kwargs.get("prompt_logprobs"):
            return self._answer(prompt, max_tokens, hit=0)
        hit = max((n for seen in self.seen for n in [_common(seen, prompt)]), default=0)
        self.seen.append(tuple(prompt))
        return self._answer(prompt, max_tokens, hit=min(hit, len(prompt) - 1))

    def _answer(self, prompt, max_tokens, hit):
        answer = [7 + (sum(prompt) + n) % 50 for n in range(max_tokens)]
        return {
            "choices": [{"index": 0, "text": "x", "token_ids": answer, "logprobs": {"tokens": [], "top_logprobs": []}}],
            "usage": {"prompt_tokens_details": {"cached_tokens": hit}},
            "kvtool_timing": {"ttft_s": 0.01, "total_s": 0.02, "token_chunk_s": [0.01, 0.015, 0.02]},
        }


def _common(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_a_run_sends_each_turn_after_its_answer_and_measures_reuse_against_the_ideal(monkeypatch):
    server = ScriptedServer()
    monkeypatch.setattr("kvtool.load.runner.complete", server)
    monkeypatch.setattr("kvtool.load.runner.compare_answers", lambda a, b, t: type("C", (), {"matches": True})())
    plans = plan_sessions(shape(think_s=0.0, sessions=3, max_prompt_tokens=600))
    runner = LoadRunner(LoadTarget("http://r", "m", BLOCK, 1), 2, deadline_s=60, check_every=2, sleep=lambda s: None)
    run = runner.run(plans)
    assert len(run.records) == sum(len(plan.turns) for plan in plans)
    by_session: dict[int, list] = {}
    for record in run.records:
        by_session.setdefault(record.session, []).append(record)
    for plan in plans:
        records = sorted(by_session[plan.index], key=lambda r: r.turn)
        for earlier, later in zip(records, records[1:], strict=False):
            # A next turn is the previous prompt and answer and its message: all of it but the answer's
            # last token was computed before it was sent.
            assert later.ideal_tokens >= earlier.prompt_tokens + earlier.output_tokens - 1
    assert all(r.itl_s == pytest.approx((0.005, 0.005)) for r in run.records)
    assert run.checked == {"matched": len(run.records) // 2}


def test_a_failed_request_ends_its_session_not_the_run(monkeypatch):
    from kvtool.errors import ServerError

    def failing(url, model, prompt, max_tokens, **kwargs):
        raise ServerError("the router answered HTTP 503")

    monkeypatch.setattr("kvtool.load.runner.complete", failing)
    plans = plan_sessions(shape(sessions=2))
    run = LoadRunner(LoadTarget("http://r", "m", BLOCK, 1), 2, deadline_s=60, sleep=lambda s: None).run(plans)
    assert len(run.records) == 2 and all(r.error and "503" in r.error for r in run.records)


def test_ctrl_c_stops_the_run_no_session_sends_again(monkeypatch):
    import threading

    server = ScriptedServer()
    monkeypatch.setattr("kvtool.load.runner.complete", server)
    plans = plan_sessions(shape(think_s=0.0, sessions=4, max_prompt_tokens=600, session_rate=1.0))
    started = threading.Event()

    def sleep(seconds: float) -> None:
        if threading.current_thread() is threading.main_thread() and seconds > 0:
            assert started.wait(10)  # the first session has sent its first turn
            raise KeyboardInterrupt  # Ctrl-C while waiting for the next arrival

    monkeypatch.setattr(server, "_answer", _answer_after(server._answer, started))
    runner = LoadRunner(LoadTarget("http://r", "m", BLOCK, 1), 1, deadline_s=60, check_every=0, sleep=sleep)
    with pytest.raises(KeyboardInterrupt):
        runner.run(plans)
    assert 1 <= len(server.prompts) < sum(len(plan.turns) for plan in plans)  # it stopped: no other session started
    assert {tuple(p[:8]) for p in server.prompts} == {tuple(plans[0].turns[0].message[:8])}  # only the first


def _answer_after(answer, started):
    def answered(*args, **kwargs):
        started.set()
        return answer(*args, **kwargs)

    return answered


@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        ({"load": "batch"}, "--load 'batch' is not one of: agentic, chat"),
        ({"sessions": 0}, "--sessions 0 must be at least 1"),
        ({"concurrency": 0}, "--concurrency 0 must be at least 1"),
        ({"think_s": -1.0}, "--think-s -1 must be 0 or more"),
        ({"session_rate": 0.0}, "--session-rate 0 must be more than 0"),
        ({"duration": 0.0}, "--duration 0 must be more than 0"),
        ({"sweep_rates": "0.1,x"}, "--sweep-rates: 'x' is not a rate above 0"),
        ({"sweep_rates": "0.1,-2"}, "--sweep-rates: '-2' is not a rate above 0"),
        ({"sweep_rates": "0.1,inf"}, "--sweep-rates: 'inf' is not a rate above 0"),
        ({"sweep_rates": "0.1,,0.2"}, "--sweep-rates: '' is not a rate above 0"),
        ({"sweep_rates": "0.1,0.10"}, "names a rate twice"),
        ({"sweep_rates": "0.1", "session_rate": 0.2}, "--sweep-rates sets each run's session rate"),
    ],
)
def test_bad_load_flags_are_one_sentence_naming_the_flag(overrides, says):
    with pytest.raises(UserError) as raised:
        LoadOptions(**{"load": "agentic", **overrides}).check()
    assert says in raised.value.message


def test_a_sweep_runs_each_rate_and_a_plain_run_its_one_rate():
    assert LoadOptions(load="agentic", sweep_rates="0.1, 0.2,0.4").rates() == [0.1, 0.2, 0.4]
    assert LoadOptions(load="agentic", session_rate=0.3).rates() == [0.3]
    assert LoadOptions(load="agentic").rates() == [None]  # a closed loop


def _result(connector, rate, sends, ttft_s):
    from kvtool.load.options import LoadResult
    from kvtool.load.runner import LoadRun

    records = [RequestRecord(0, n, sent, 100, 2, ttft_s=ttft_s, e2e_s=ttft_s + 0.1) for n, sent in enumerate(sends)]
    return LoadResult(connector, {}, summarize(records, 2000.0), LoadRun(records=records), None, rate)


def test_a_sweeps_points_are_each_runs_sent_rate_and_ttft_by_connector(tmp_path):
    from kvtool.load.plot import sweep_points, write_sweep_plot

    results = [
        _result("kvtool", 0.2, [0.0, 1.0, 2.0], 0.5),  # 3 requests over 2 s: 1 a second
        _result("kvtool", 0.1, [0.0, 2.0, 4.0], 0.3),
        _result("none", 0.1, [0.0, 4.0], 0.9),
        _result("none", 0.2, [1.0], 0.9),  # one request: no rate, no point
    ]
    assert results[0].sent_rate == 1.0 and results[3].sent_rate is None
    points = sweep_points(results)
    assert points == {"kvtool": [(0.5, 300.0, 300.0), (1.0, 500.0, 500.0)], "none": [(0.25, 900.0, 900.0)]}
    path = tmp_path / "sweep" / "ttft.png"
    write_sweep_plot(path, results, LoadOptions(load="agentic", sweep_rates="0.1,0.2"))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_load_plot_without_a_sweep_is_one_sentence_and_no_traceback(tmp_path):
    from typer.testing import CliRunner

    from kvtool.cli import app

    ready = tmp_path / "ready.json"
    result = CliRunner().invoke(
        app, ["bench", "--pair", str(ready), "--load", "agentic", "--plot", str(tmp_path / "p.png")]
    )
    assert result.exit_code != 0 and "Traceback" not in result.output
    assert "--plot with --load draws a sweep: give --sweep-rates too" in " ".join(result.output.split())
