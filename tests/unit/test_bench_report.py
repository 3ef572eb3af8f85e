"""The bench's summaries, JSON document, plot, and its one-line user errors (no pair needed)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from typer.testing import CliRunner

from connector.core.hits import HitDetails
from kvtool.bench.command import parse_compare
from kvtool.bench.report import bucket_label, connector_report, percentile, summarize
from kvtool.bench.results import BenchDocument
from kvtool.bench.runner import (
    ConsumerResult,
    ProducerResult,
    RequestLogReader,
    WorkloadRun,
    cached_tokens_hit,
    kvtool_hit,
)
from kvtool.cli import app
from kvtool.pair.ready import read_ready_file
from kvtool.errors import UserError
from kvtool.procs import find_free_port

SUMMARY_FIELDS = {
    "requests",
    "prompt_tokens",
    "ideal_tokens",
    "hit_tokens",
    "block_hit_tokens",
    "tail_hit_tokens",
    "hit_rate",
    "efficiency",
    "ttft_ms_p50",
    "ttft_ms_p90",
    "mismatches",
}


def consumer(workload="w", prompt=40, ideal=30, hit=30, block=0, tail=30, ttft=10.0, matched=True, step=1):
    return ConsumerResult(workload, step, "x", prompt, ideal, hit, block, tail, ttft, True, matched, 0.0)


def test_percentile_interpolates():
    assert percentile([], 0.5) is None
    assert percentile([5.0], 0.9) == 5.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 0.5) == 2.5
    assert percentile([10.0, 0.0, 20.0], 0.9) == pytest.approx(18.0)


def test_bucket_labels_follow_blocks():
    assert [bucket_label(n, 32) for n in (1, 31, 32, 63, 64, 200, 511, 512, 4000)] == [
        "0-31",
        "0-31",
        "32-63",
        "32-63",
        "64-127",
        "128-255",
        "256-511",
        ">=512",
        ">=512",
    ]


def test_summary_counts_tokens_rates_and_mismatches():
    results = [consumer(hit=30), consumer(prompt=100, ideal=90, hit=64, block=64, tail=0, ttft=30.0, matched=False)]
    run = WorkloadRun("w", results, [ProducerResult("w", 0, 40, 5.0, 2)], [1.0, 3.0], 0)
    summary = summarize(results, [run]).to_json()
    assert SUMMARY_FIELDS <= set(summary)
    assert (summary["prompt_tokens"], summary["ideal_tokens"], summary["hit_tokens"]) == (140, 120, 94)
    assert (summary["block_hit_tokens"], summary["tail_hit_tokens"]) == (64, 30)
    assert summary["hit_rate"] == pytest.approx(94 / 140)
    assert summary["efficiency"] == pytest.approx(94 / 120)
    assert summary["ttft_ms_p50"] == 20.0 and summary["mismatches"] == 1
    assert summary["producer_ms_p50"] == 5.0 and summary["durability_wait_ms_p50"] == 2.0
    assert summarize([]).efficiency is None


def test_json_document_has_summary_config_seed_and_lists_mismatches():
    run = WorkloadRun("w", [consumer(), consumer(matched=False, step=3)])
    report = connector_report([run], block_size=32)
    document = BenchDocument({"seed": 5, "requests": 2}, {"model": "m"}, {"kvtool": report}, compare=False).to_json()
    assert document["seed"] == 5 and document["config"]["requests"] == 2
    assert SUMMARY_FIELDS <= set(document["summary"])
    assert document["mismatches"] == [{"workload": "w", "step": 3, "prompt_tokens": 40, "reason": ""}]
    assert set(document["workloads"]) == {"w"} and "32-63" in document["buckets"]
    json.dumps(document)

    compared = BenchDocument({"seed": 5}, {}, {"kvtool": report, "none": report}, compare=True).to_json()
    assert set(compared["connectors"]) == {"kvtool", "none"}
    assert SUMMARY_FIELDS <= set(compared["connectors"]["none"]["summary"])


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("PIL")
    from kvtool.bench.plot import write_plot

    report = connector_report([WorkloadRun("w", [consumer(), consumer(hit=10)])], 32)
    target = tmp_path / "plot.png"
    write_plot(target, {"kvtool": report, "none": report})
    assert target.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_hits_from_the_request_log_and_from_usage():
    record = HitDetails(85, "hit", local_hit_tokens=32, external_hit_tokens=53, block_hit_tokens=32, tail_hit_tokens=21)
    hit = kvtool_hit(record)
    assert (hit.tokens, hit.block_tokens, hit.tail_tokens, hit.lookup) == (85, 64, 21, "hit")
    # A request served wholly from vLLM's own cache: the connector reports it as a local hit.
    local_only = HitDetails(85, "miss", stored_prefix_tokens=64, local_hit_tokens=64)
    hit = kvtool_hit(local_only)
    assert (hit.tokens, hit.block_tokens, hit.tail_tokens) == (64, 64, 0)
    usage = {"usage": {"prompt_tokens_details": {"cached_tokens": 64}}}
    assert (cached_tokens_hit(usage).tokens, cached_tokens_hit(usage).tail_tokens) == (64, 0)
    assert cached_tokens_hit({"usage": {"prompt_tokens_details": None}}).tokens == 0


def test_what_the_cost_model_declined_is_counted_apart_from_what_was_reused():
    """A 66-token prompt: 64 tokens in vLLM's own cache, the 65th stored as a tail the cost model judged
    not worth its load; a tail trimmed off a hit; a hit taken whole declines nothing."""
    unpaid = HitDetails(66, "miss", stored_prefix_tokens=66, local_hit_tokens=64, load_skipped="unprofitable: x")
    assert (kvtool_hit(unpaid).tokens, kvtool_hit(unpaid).declined_tokens) == (64, 1)  # vLLM computes the last
    trimmed = HitDetails(90, "hit", stored_prefix_tokens=85, external_hit_tokens=64, load_skipped="trimmed: x")
    assert kvtool_hit(trimmed).declined_tokens == 21
    whole = HitDetails(90, "hit", stored_prefix_tokens=85, external_hit_tokens=85, tail_hit_tokens=21)
    assert kvtool_hit(whole).declined_tokens == 0
    # Not looked up, no hit could pay: what the ideal offered beyond vLLM's own hit was declined.
    unasked = HitDetails(66, "not looked up: no hit could pay: a load costs 3.0 ms", local_hit_tokens=64)
    assert (kvtool_hit(unasked, ideal_tokens=65).tokens, kvtool_hit(unasked, ideal_tokens=65).declined_tokens) == (
        64,
        1,
    )
    assert kvtool_hit(unasked).declined_tokens == 0  # no ideal known
    results = [consumer(hit=30), replace(consumer(ideal=30, hit=20, tail=20), declined_tokens=10)]
    summary = summarize(results)
    assert summary.declined_tokens == 10
    assert summary.efficiency == pytest.approx(50 / 60) and summary.found_efficiency == pytest.approx(1.0)


def test_hit_details_round_trip_and_ignore_fields_of_a_newer_connector():
    details = HitDetails(40, "hit", external_hit_tokens=39, tail_hit_tokens=7, request_id="r", tag="t")
    assert HitDetails.from_dict({**details.to_dict(), "a_newer_field": 1}) == details
    assert "tag" not in HitDetails(1, "miss").to_dict()
    with pytest.raises(ValueError):
        HitDetails.from_dict({"lookup": "hit"})  # no prompt_tokens


def test_request_log_reader_finds_tags_written_after_it_started(tmp_path):
    log = tmp_path / "consumer-requests.jsonl"
    log.write_text(json.dumps({"tag": "old", "lookup": "miss", "prompt_tokens": 5}) + "\n")
    reader = RequestLogReader(log)
    with open(log, "a") as out:
        a = json.dumps({"tag": "a", "lookup": "hit", "prompt_tokens": 5})
        out.write(a + "\n" + '{"tag": "b", "prompt_tokens": 5, "lo')  # b: half written
    assert reader.record("a", timeout_s=0).lookup == "hit"
    assert reader.record("old", timeout_s=0) is None
    assert reader.record("b", timeout_s=0) is None
    with open(log, "a") as out:
        out.write('okup": "miss"}\n')
    assert reader.record("b", timeout_s=0).lookup == "miss"


def test_compare_list_is_checked():
    assert parse_compare("kvtool, none") == ["kvtool", "none"]
    assert parse_compare(None) == []
    for bad in ("kvtool,sglang", "", "none,none"):
        with pytest.raises(UserError):
            parse_compare(bad)


def test_compare_runs_the_baseline_without_the_store_and_roles_only_connectors_take(tmp_path):
    """--store standalone and --roles both apply to the connectors; the pair without one was refused
    when its turn came (after the others' whole runs)."""
    from kvtool.bench.command import launch_config
    from kvtool.pair.config import ServePairConfig
    from kvtool.pair.preflight import check_values

    cfg = ServePairConfig(model=tmp_path, log_dir=tmp_path, store="standalone", roles="both")
    for connector in ("kvtool", "none", "vllm-mooncake-store"):
        check_values(launch_config(cfg, connector, compare=True))  # every pair of the run is valid
    baseline = launch_config(cfg, "none", compare=True)
    assert (baseline.store, baseline.roles) == ("embedded", "pd")
    assert launch_config(cfg, "kvtool", compare=True).store == "standalone"


def test_ready_file_errors_are_sentences(tmp_path):
    with pytest.raises(UserError, match="cannot read the ready file"):
        read_ready_file(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(UserError, match="is not JSON"):
        read_ready_file(tmp_path / "bad.json")
    (tmp_path / "partial.json").write_text('{"producer": "http://127.0.0.1:1"}')
    with pytest.raises(UserError, match="is not a serve-pair ready file"):
        read_ready_file(tmp_path / "partial.json")
    whole = {"producer": "P", "consumer": "C", "model": "/m", "block_size": 32, "hash_unit": 1, "max_model_len": 64}
    (tmp_path / "sglang.json").write_text(json.dumps({**whole, "connector": "sglang"}))
    with pytest.raises(UserError, match="field 'connector'"):  # the choices are the pair config's own
        read_ready_file(tmp_path / "sglang.json")
    (tmp_path / "ok.json").write_text(json.dumps({**whole, "connector": "kvtool", "roles": "both"}))
    assert read_ready_file(tmp_path / "ok.json").roles == "both"


def one_line_error(args: list[str]) -> str:
    result = CliRunner().invoke(app, ["bench", *args])
    assert result.exit_code != 0, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    assert "Traceback" not in result.output
    return lines[0]


def write_ready(tmp_path: Path, model: Path) -> Path:
    port = find_free_port()
    ready = tmp_path / "ready.json"
    ready.write_text(
        json.dumps(
            {
                "producer": f"http://127.0.0.1:{port}",
                "consumer": f"http://127.0.0.1:{port}",
                "admin": None,
                "model": str(model),
                "block_size": 32,
                "hash_unit": 1,
                "max_model_len": 2048,
                "connector": "kvtool",
            }
        )
    )
    return ready


def test_cli_bad_input_is_one_line(tmp_path):
    assert "--pair READY_FILE" in one_line_error([])
    assert "cannot read the ready file" in one_line_error(["--pair", str(tmp_path / "nope.json")])
    ready = write_ready(tmp_path, tmp_path)
    assert "is not reachable" in one_line_error(["--pair", str(ready)])
    assert "--compare" in one_line_error(["--pair", str(ready), "--compare", "kvtool,none"])
    assert "--compare 'kvtool,x'" in one_line_error(["--launch", "--compare", "kvtool,x"])
    assert "--requests" in one_line_error(["--pair", str(ready), "--requests", "0"])


def test_engine_ttft_is_the_one_request_between_two_readings():
    from kvtool.bench.runner import engine_ms

    assert engine_ms((1.0, 4), (1.032, 5)) == pytest.approx(32.0)
    assert engine_ms((1.0, 4), (1.5, 6)) is None  # another request finished in between
    assert engine_ms(None, (1.5, 5)) is None and engine_ms((1.0, 4), None) is None


def test_bench_flags_map_to_the_config_and_a_bad_one_is_named():
    from kvtool.bench.config import BenchConfig
    from kvtool.errors import UserError

    options = dict(
        workloads=("sub-block",),
        requests=2,
        max_tokens=3,
        seed=1,
        verify=True,
        tolerance=1e-3,
        quiet_s=0.0,
        trace_block_tokens=16,
        trace_start=4,
        trace_requests=None,
        prefix_len=80,
        suffix_len=24,
        num_prefixes=2,
    )
    config = BenchConfig.from_options(**options)
    trace, repetition = config.workload_options["trace"], config.workload_options["prefix-repetition"]
    assert trace.trace_start == 4 and config.quiet_s == 0.0 and repetition.prefix_len == 80
    with pytest.raises(UserError, match="--trace-block-tokens"):
        BenchConfig.from_options(**{**options, "trace_block_tokens": 0})
    with pytest.raises(UserError, match="--quiet-s"):
        BenchConfig.from_options(**{**options, "quiet_s": -1.0})


def test_a_bench_result_names_the_commit_it_measured(tmp_path):
    """A result says which code produced it: the checkout's short head (``+`` for uncommitted changes to
    tracked files, benchmark results aside), when, and on how many cores; outside a git checkout the head is None."""
    import subprocess

    from kvtool.bench.command import provenance

    def git(*args):
        subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True)

    assert provenance(tmp_path)["head"] is None
    git("init", "-q")
    (tmp_path / "a.txt").write_text("one\n")
    git("add", "a.txt")
    git("-c", "user.name=t", "-c", "user.email=t@example.com", "commit", "-q", "-m", "one")
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=tmp_path, capture_output=True, text=True)
    found = provenance(tmp_path)
    assert found["head"] == head.stdout.strip() and found["cpus"] >= 1 and found["started_at"].endswith("+00:00")
    (tmp_path / "benchmarks" / "peers").mkdir(parents=True)  # a benchmark's earlier results: not code
    for result in ("benchmarks/peers/run.json", "benchmarks/peers/run.png"):
        (tmp_path / result).write_text("{}")
        git("add", result)
    git("-c", "user.name=t", "-c", "user.email=t@example.com", "commit", "-q", "-m", "results")
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=tmp_path, capture_output=True, text=True)
    for result in ("benchmarks/peers/run.json", "benchmarks/peers/run.png"):
        (tmp_path / result).write_text("{1}")
    assert provenance(tmp_path)["head"] == head.stdout.strip()
    (tmp_path / "a.txt").write_text("two\n")
    assert provenance(tmp_path)["head"] == head.stdout.strip() + "+"
    # A directory inside another project's checkout (kvtool installed there) is not kvtool's checkout.
    (tmp_path / "site").mkdir()
    assert provenance(tmp_path / "site")["head"] is None
