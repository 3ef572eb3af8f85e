"""A chat run against a fake pair (no engines: a fake answers): answers and their saves waited for,
hits measured on both engines from their request logs or from usage, and the report's tables.
The workload and its oracle: ``test_bench_chat``."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from connector.core.hits import HitDetails
from kvtool.bench.config import BenchConfig, build_workload
from kvtool.bench.oracle import ReuseOracle, ideal_hits
from kvtool.bench.report import bench_report, connector_report
from kvtool.bench.results import BenchDocument
from kvtool.pair.ready import ReadyFile
from kvtool.bench.runner import (
    ConsumerResult,
    Durability,
    PairRunner,
    ProducerResult,
    WorkloadRun,
    answer_token_ids,
)
from kvtool.bench.workloads.chat import Chat
from tests.unit.test_bench_chat import SHAPE, fake_answer, resolve_all
from tests.unit.test_cli_output import assert_fits, rendered


# ---- answers and durability -----------------------------------------------------------------


def test_answer_token_ids_from_a_response_a_stream_or_logprobs():
    assert answer_token_ids({"choices": [{"index": 0, "token_ids": [5, 6]}]}) == (5, 6)
    streamed = {
        "choices": [{"index": 0, "text": "ab"}],
        "chunks": [
            {"choices": [{"index": 0, "text": "a", "token_ids": [5], "prompt_token_ids": [1, 2]}]},
            {"choices": [{"index": 0, "text": "b", "token_ids": [6, 7]}]},
            {"choices": [], "usage": {"prompt_tokens": 2}},
        ],
    }
    assert answer_token_ids(streamed) == (5, 6, 7)
    by_logprobs = {"choices": [{"index": 0, "logprobs": {"tokens": ["token_id:8", "token_id:9"]}}]}
    assert answer_token_ids(by_logprobs) == (8, 9)
    assert answer_token_ids({"choices": [{"index": 0, "logprobs": {"tokens": ["a"]}}]}) is None
    assert answer_token_ids({"choices": [{"index": 0, "text": "x"}]}) is None


def ready(connector: str, roles: str | None = "both", logs: dict[str, str] | None = None) -> ReadyFile:
    return ReadyFile(
        producer="http://producer",
        consumer="http://consumer",
        model="m",
        block_size=16,
        hash_unit=1,
        max_model_len=1024,
        connector=connector,
        roles=roles,
        admin="http://admin",
        request_logs=logs,
    )


@pytest.fixture
def waited(monkeypatch) -> list[str]:
    """The keys the bench waits for; "key count" for a wait on the master's key count."""
    keys: list[str] = []
    monkeypatch.setattr("kvtool.bench.durability.wait_for_key", lambda _admin, key, _timeout: keys.append(key) or True)
    monkeypatch.setattr(Durability, "_wait_key_count_quiet", lambda _self: keys.append("key count") or True)
    return keys


@pytest.mark.parametrize(
    ("connector", "roles", "record", "expected"),
    [
        ("kvtool", "both", HitDetails(9, "hit", answer_tokens=12, answer_last_key="k"), ["k"]),
        ("kvtool", "pd", HitDetails(9, "hit"), []),  # no answer save: nothing to wait for
        ("vllm-mooncake-store", "both", None, ["key count"]),
        ("vllm-mooncake-store", "pd", None, []),  # a kv_consumer saves nothing
        ("none", None, None, []),
    ],
)
def test_an_answer_save_is_waited_for_when_there_is_one(waited, connector, roles, record, expected):
    durability = Durability(ready(connector, roles), timeout_s=1.0)
    durability.answered(record)
    assert (durability.wait() is None) == (not expected)
    assert waited == expected


# ---- a run against a fake pair --------------------------------------------------------------


@dataclass
class FakePair:
    """Answers /v1/completions like a pair would: ``fake_answer`` tokens, streamed in two chunks
    for a streamed request, and a kvtool request-log line for a tagged one."""

    connector: str
    logs: dict[str, Path]
    waited: list[str]
    sent: list[dict[str, Any]]

    def complete(self, url: str, model: str, prompt: list[int], max_tokens: int, **options: Any) -> dict[str, Any]:
        engine = "producer" if "producer" in url else "consumer"
        extra = options.get("extra") or {}
        answer = list(fake_answer(tuple(prompt), max_tokens))
        self.sent.append({"engine": engine, "prompt": tuple(prompt), "waited": list(self.waited), **options})
        choice: dict[str, Any] = {"index": 0, "text": "x" * len(answer)}
        if extra.get("return_token_ids"):
            choice["token_ids"] = answer
        if options.get("logprobs"):
            names = [f"token_id:{t}" for t in answer]
            choice["logprobs"] = {"tokens": names, "top_logprobs": [{name: -0.5} for name in names]}
        response: dict[str, Any] = {
            "choices": [choice],
            "usage": {"prompt_tokens_details": {"cached_tokens": 16}},
            "kvtool_timing": {"ttft_s": 0.01, "total_s": 0.02},
        }
        if engine == "producer" and self.connector == "kvtool":
            saved = {"save_last_key": f"save-{len(prompt)}", "save_objects": 1}
            response["kv_transfer_params"] = {"kvtool": {"prompt_tokens": len(prompt), "lookup": "miss", **saved}}
        tag = (options.get("kv_transfer_params") or {}).get("kvtool_tag")
        if tag is not None:
            self._log(engine, tag, len(prompt), len(answer))
        if options.get("stream") and "token_ids" in choice:
            ids = choice.pop("token_ids")  # kvtool.client's merged choice has none; its chunks have them
            response["chunks"] = [{"choices": [{"index": 0, "token_ids": part}]} for part in (ids[:1], ids[1:])]
        return response

    def _log(self, engine: str, tag: str, prompt_tokens: int, answer_tokens: int) -> None:
        # The consumer saves its answer (roles both); the fake's last key of that save is the tag.
        saved = (
            {"answer_tokens": prompt_tokens + answer_tokens - 1, "answer_last_key": tag} if engine == "consumer" else {}
        )
        record = HitDetails(
            prompt_tokens, "hit", local_hit_tokens=16, external_hit_tokens=5, tail_hit_tokens=5, tag=tag, **saved
        )
        with open(self.logs[engine], "a") as log:
            log.write(json.dumps(record.to_dict()) + "\n")


def run_chat(tmp_path: Path, monkeypatch, waited: list[str], connector: str, verify: bool = False):
    logs = {engine: tmp_path / f"{engine}-requests.jsonl" for engine in ("producer", "consumer")}
    fake = FakePair(connector, logs, waited, [])
    monkeypatch.setattr("kvtool.bench.runner.complete", fake.complete)
    pair = ready(connector, logs={engine: str(path) for engine, path in logs.items()})
    steps = Chat().steps(SHAPE)
    run = PairRunner(pair, BenchConfig(verify=verify, quiet_s=0)).run("chat", steps, None, lambda _target: None)
    return steps, run, [request for request in fake.sent if request.get("prompt_logprobs") is None]


def test_a_kvtool_run_measures_both_engines_from_their_request_logs(tmp_path, monkeypatch, waited):
    steps, run, sent = run_chat(tmp_path, monkeypatch, waited, "kvtool", verify=True)
    assert [request["engine"] for request in sent] == [step.target for step in steps]
    assert [request["prompt"] for request in sent] == resolve_all(steps)
    assert all(request["extra"]["return_token_ids"] for request in sent)
    assert len(run.consumers) == SHAPE.requests and len(run.measured_producers) == len(run.producers)
    assert all(c.matched for c in run.consumers) and not any(p.verified for p in run.measured_producers)
    assert {(r.engine, r.hit_tokens, r.tail_hit_tokens) for r in run.measured} == {
        ("producer", 21, 5),
        ("consumer", 21, 5),
    }
    oracle = ReuseOracle(16, 1)
    for result in run.measured:
        step, prompt = steps[result.step], sent[result.step]["prompt"]
        assert result.engine == step.target and result.prompt_tokens == len(prompt)
        assert result.ideal_tokens == oracle.of(result.step, prompt)
        oracle.ran(prompt, fake_answer(prompt, step.max_tokens))
        if step.target == "consumer":
            assert result.ideal_tokens == len(prompt) - 1
            assert sent[result.step]["waited"][-1] == f"save-{len(prompt)}"  # the producer's save of P_t
        elif step.history:
            previous = step.depends_on[0]
            answer = fake_answer(sent[previous]["prompt"], SHAPE.max_tokens)
            assert result.ideal_tokens == len(sent[previous]["prompt"]) + len(answer) - 1
            # Before turn t+1 the consumer's answer save of turn t is durable (its key is the tag here).
            assert sent[result.step]["waited"][-1].endswith(f"-chat-{previous}")


def test_without_the_kvtool_connector_hits_come_from_usage(tmp_path, monkeypatch, waited):
    _, run, sent = run_chat(tmp_path, monkeypatch, waited, "none")
    assert all(request.get("kv_transfer_params") is None for request in sent)
    assert {(r.hit_tokens, r.tail_hit_tokens) for r in run.measured} == {(16, 0)}
    assert waited == []


def test_static_workloads_measure_only_the_consumer(tmp_path, monkeypatch, waited):
    logs = {engine: tmp_path / f"{engine}.jsonl" for engine in ("producer", "consumer")}
    fake = FakePair("kvtool", logs, waited, [])
    monkeypatch.setattr("kvtool.bench.runner.complete", fake.complete)
    steps = build_workload("multi-turn", BenchConfig()).steps(SHAPE)
    pair = ready("kvtool", logs={engine: str(path) for engine, path in logs.items()})
    run = PairRunner(pair, BenchConfig(verify=False, quiet_s=0)).run(
        "w", steps, ideal_hits(steps, 16, 1), lambda _: None
    )
    assert not run.measured_producers and len(run.consumers) == SHAPE.requests
    assert all(r.get("kv_transfer_params") is None for r in fake.sent if r["engine"] == "producer")
    assert all("return_token_ids" not in r["extra"] for r in fake.sent)
    assert waited and all(key.startswith("save-") for key in waited)  # no consumer's answer save is waited on


# ---- the report -----------------------------------------------------------------------------


def measured(step: int, engine: str, prompt: int, ideal: int, hit: int) -> ConsumerResult:
    consumer = engine == "consumer"
    return ConsumerResult(
        "chat", step, "x", prompt, ideal, hit, hit, 0, 10.0 + step, consumer, consumer or None, 0.0, engine=engine
    )


def chat_run() -> WorkloadRun:
    consumers = [measured(1, "consumer", 40, 39, 32), measured(3, "consumer", 90, 89, 64)]
    producers = [measured(0, "producer", 40, 0, 0), measured(2, "producer", 90, 47, 32)]
    return WorkloadRun("chat", consumers, [ProducerResult("chat", i, 40, 5.0, 2) for i in (0, 2)], [], 0, producers)


def test_the_report_shows_each_engine_and_both():
    report = connector_report([chat_run()], block_size=16)
    chat = report.workloads["chat"]
    assert (chat.requests, chat.ideal_tokens, chat.hit_tokens) == (4, 175, 128)
    producer, consumer = chat.engines["producer"], chat.engines["consumer"]
    assert producer.efficiency == pytest.approx(32 / 47) and consumer.efficiency == pytest.approx(96 / 128)
    assert chat.ttft_ms_p50 == consumer.ttft_ms_p50 == 12.0  # TTFT is the consumer's
    assert producer.ttft_ms_p50 == 11.0 and producer.verified == 0
    assert report.summary.engines["producer"].requests == 2
    assert [r.engine for r in report.requests] == ["producer", "consumer", "producer", "consumer"]
    document = json.loads(json.dumps(BenchDocument({"seed": 0}, {}, {"kvtool": report}, compare=False).to_json()))
    assert document["summary"]["engines"]["producer"]["requests"] == 2
    assert [r["engine"] for r in document["requests"]] == ["producer", "consumer", "producer", "consumer"]


def test_a_workload_measured_on_the_consumer_only_has_no_engine_split():
    run = WorkloadRun("sub-block", [measured(1, "consumer", 20, 19, 0)])
    report = connector_report([run], block_size=16)
    assert not report.summary.engines and not report.workloads["sub-block"].engines
    assert "engines" not in report.to_json()["summary"] and "engines" not in report.to_json()["workloads"]["sub-block"]


def test_chat_tables_fit_80_columns():
    static = WorkloadRun("sub-block", [measured(1, "consumer", 20, 19, 0)])
    report = connector_report([static, chat_run()], block_size=16)
    text = rendered(bench_report(BenchDocument({"seed": 0}, {}, {"kvtool": report}, compare=False)), 80)
    assert_fits(text, ("chat", "chat (producer)", "chat (consumer)", "all (producer)", "not verified"))
    reports = {name: report for name in ("kvtool", "vllm-mooncake-store", "none")}
    text = rendered(bench_report(BenchDocument({"seed": 0}, {}, reports, compare=True)), 80)
    assert_fits(text, ("chat (producer)", "chat (consumer)", "68.1% / 11.0", "75.0% / 12.0"))


def test_every_request_restarts_the_quiet_clock_warm_up_and_recomputation_too(tmp_path, monkeypatch, waited):
    """A warm-up request and a verified answer's recomputation are requests: the quiet time counts from
    their end, or an interleaved run's second pair would start while the first pair's engine still works."""
    from kvtool.bench.runner import QuietClock

    events: list[str] = []

    class Spy(QuietClock):
        def wait(self) -> None:
            events.append("wait")

        def done(self) -> None:
            events.append("done")

    logs = {engine: tmp_path / f"{engine}-requests.jsonl" for engine in ("producer", "consumer")}
    fake = FakePair("kvtool", logs, waited, [])

    def sent(*args, **options):
        events.append("recompute" if options.get("prompt_logprobs") else "request")
        return fake.complete(*args, **options)

    monkeypatch.setattr("kvtool.bench.runner.complete", sent)
    pair = ready("kvtool", logs={engine: str(path) for engine, path in logs.items()})
    runner = PairRunner(pair, BenchConfig(verify=True, quiet_s=0), Spy(0))
    runner.warm_up()
    assert events == ["request", "done"] * 4  # two to each engine
    runner.run("chat", Chat().steps(SHAPE), None, print)
    assert "recompute" in events
    pending = False
    for event in events:
        assert not (event == "wait" and pending), events
        pending = event in ("request", "recompute") or (pending and event != "done")
    assert not pending
