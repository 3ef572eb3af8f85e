"""The commands' shared output and exit codes, without a pair or a master: --format json, --output,
-q, the old --json names, exit code 2 before any I/O, 130 on Ctrl-C, and tables that fit 80 columns."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from connector.core.hashing import RequestIdentity
from connector.core.keys import Namespace, watermark_key
from connector.core.prefix import PromptKeys, plan_save
from connector.core.watermarks import SaveState, WatermarkRecord
from kvtool.bench.command import BenchOutcome
from kvtool.bench.report import (
    COMPARISON_COLUMNS,
    SUMMARY_COLUMNS,
    bench_report,
    connector_report,
)
from kvtool.bench.results import BenchDocument, ConnectorReport
from kvtool.bench.runner import ProducerResult, WorkloadRun
from kvtool.cli import app
from kvtool.errors import EXIT_CODES
from kvtool.inspect.target import Target
from kvtool.inspect.watermarks import latest_record_keys, load_records
from kvtool.report import Report
from tests.unit.fake_admin import fake_admin
from tests.unit.test_bench_report import consumer, write_ready

runner = CliRunner()
NS = Namespace(model="m", dtype="float32", kv_layout="cpu", block_size=32, num_layers=2, num_kv_heads=2, head_size=64)
WORKLOADS = ("sub-block", "cross-block", "shared-prefix", "multi-turn", "max-tokens-1", "prefix-repetition")


def fake_reports(workloads=("sub-block", "cross-block"), connectors=("kvtool",)) -> dict[str, ConnectorReport]:
    runs = [
        WorkloadRun(
            name,
            [consumer(name, prompt=p, ideal=p - 1, hit=p - 2, ttft=1234.5, matched=p != 300) for p in (20, 100, 300)],
            [ProducerResult(name, 0, 40, 55.0, 2)],
        )
        for name in workloads
    ]
    return {connector: connector_report(runs, 32) for connector in connectors}


def fake_outcome(compare=False) -> BenchOutcome:
    reports = fake_reports(connectors=("kvtool", "vllm-mooncake-store", "none") if compare else ("kvtool",))
    return BenchOutcome(BenchDocument({"seed": 0, "workloads": ["sub-block"]}, {"model": "m"}, reports, compare))


def doc(reports, compare: bool) -> BenchDocument:
    return BenchDocument({"seed": 0}, {}, reports, compare)


def rendered(report: Report, width: int) -> str:
    console = Console(width=width, record=True, file=io.StringIO())
    report.render(console)
    return console.export_text()


def assert_fits(text: str, headers, width: int = 80) -> None:
    assert "…" not in text, text
    assert all(len(line) <= width for line in text.splitlines()), text
    for header in headers:
        assert header in text, (header, text)


# ---- tables at 80 columns -----------------------------------------------------------------


@pytest.mark.parametrize("workloads", [("sub-block", "cross-block"), WORKLOADS + ("trace:mooncake_trace.jsonl",)])
def test_bench_tables_fit_80_columns_with_every_header(workloads):
    reports = fake_reports(workloads)
    text = rendered(bench_report(doc(reports, False)), 80)
    assert_fits(text, ("workload", "prompt tokens", *SUMMARY_COLUMNS, *workloads, "all", "0-31", "256-511"))
    assert "mismatch sub-block step 1 (300 tokens)" in text


def test_bench_comparison_tables_fit_80_columns_with_every_header():
    reports = fake_reports(connectors=("kvtool", "vllm-mooncake-store", "none"))
    text = rendered(bench_report(doc(reports, True)), 80)
    assert_fits(text, ("connector", *COMPARISON_COLUMNS, "kvtool", "vllm-mooncake-store", "none", "cross-block"))
    assert "mismatch (vllm-mooncake-store) cross-block" in text


def test_a_wide_console_shows_the_bench_table_whole():
    text = rendered(bench_report(doc(fake_reports(), False)), 200)
    header_line = next(line for line in text.splitlines() if "requests" in line)
    assert all(header in header_line for header in ("workload", *SUMMARY_COLUMNS))
    assert "…" not in text


def keys_of_a_prompt(others: bool = True) -> list[str]:
    """The stored keys of an 85-token prompt; ``others``: a watermark record and a foreign key too."""
    keys = PromptKeys.build(list(range(100, 185)), 32, 1, NS.key_component(), RequestIdentity().root_hash())
    stored = [save.key for save in plan_save(keys)]
    if not others:
        return stored
    return stored + [watermark_key(NS.key_component(), "req-1", 1), "someone-elses/" + "x" * 70]


def test_inspect_keys_prompt_and_store_tables_fit_80_columns():
    with fake_admin() as admin:
        admin.keys = keys_of_a_prompt()
        env = {"COLUMNS": "80"}
        keys = runner.invoke(app, ["inspect", "keys", "--admin", admin.url, "--block-size", "32"], env=env)
        assert keys.exit_code == 0, keys.output
        assert_fits(keys.stdout, ("kind", "namespace", "end_token", "tokens", "hash", "size_bytes", "key"))
        assert "foreign" in keys.stdout and "someone-elses/" in keys.stdout

        admin.keys = keys_of_a_prompt(others=False)  # a watermark record would need the master to read it
        tokens = ",".join(map(str, range(100, 185)))
        args = ["inspect", "prompt", "--admin", admin.url, "--tokens", tokens, "--block-size", "32", "--no-verify"]
        prompt = runner.invoke(app, args, env=env)
        assert prompt.exit_code == 0, prompt.output
        assert_fits(prompt.stdout, ("end_token", "kind", "stored", "in_hit", "miss_reason", "key", "hit tokens: 84"))

        store = runner.invoke(app, ["inspect", "store", "--admin", admin.url], env=env)
        assert store.exit_code == 0, store.output
        assert_fits(store.stdout, ("metric", "value", "capacity_bytes", "eviction_high_watermark_source"))


def test_inspect_watermarks_table_fits_80_columns(monkeypatch):
    from kvtool.inspect import watermarks

    record = WatermarkRecord(
        "cmpl-a-long-request-id-0", "bench-tag", 85, 64, 85, False, SaveState.FAILED, "no space", 1.0
    )
    key = watermark_key(NS.key_component(), "cmpl-a-long-request-id-0", 1)
    loaded = load_records(latest_record_keys([key]), lambda keys: [record.encode()])
    monkeypatch.setattr(watermarks, "read_watermarks", lambda target, namespace: loaded)
    report = watermarks.watermarks_report(Target(admin="http://127.0.0.1:1"), None, None)
    text = rendered(report, 80)
    assert_fits(text, (*report.tables[0].columns, "cmpl-a-long-request-id-0", "no space"))


# ---- --format json, --output, -q ------------------------------------------------------------


@pytest.fixture
def fake_bench(monkeypatch):
    """run_bench answers a fake outcome; the calls it got are recorded."""
    calls: list[dict] = []

    def run_bench(config, say, pair_file, launch, compare, progress_console=None):
        calls.append({"config": config, "pair_file": pair_file, "launch": launch, "compare": compare})
        return fake_outcome(compare=bool(compare))

    monkeypatch.setattr("kvtool.bench.command.run_bench", run_bench)
    return calls


def test_bench_format_json_prints_only_the_json_document(tmp_path, fake_bench):
    ready = write_ready(tmp_path, tmp_path)
    result = runner.invoke(app, ["bench", "--pair", str(ready), "--format", "json"])
    assert result.exit_code == 0, result.output
    document = json.loads(result.stdout)
    assert document["summary"]["requests"] == 6 and document["connector"] == "kvtool"
    assert fake_bench[0]["pair_file"] == ready


def test_bench_output_writes_the_file_and_still_prints_the_table(tmp_path, fake_bench):
    ready, target = write_ready(tmp_path, tmp_path), tmp_path / "out" / "bench.json"
    result = runner.invoke(app, ["bench", "--pair", str(ready), "--output", str(target)], env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    assert json.loads(target.read_text())["summary"]["mismatches"] == 2
    assert "kvtool bench: kvtool connector" in result.stdout and "…" not in result.stdout


def test_bench_quiet_prints_no_table_and_the_old_json_flag_is_output(tmp_path, fake_bench):
    ready, target = write_ready(tmp_path, tmp_path), tmp_path / "bench.json"
    result = runner.invoke(app, ["bench", "--pair", str(ready), "-q", "--json", str(target)])
    assert result.exit_code == 0, result.output
    # -q keeps stdout empty; the one line on stderr says the flag's new name (kept for one release).
    assert result.stdout == "" and result.stderr.strip().splitlines() == [
        "kvtool: --json PATH is the old name of --output PATH and goes away in the next release; use --output"
    ]
    assert json.loads(target.read_text())["seed"] == 0


def test_bench_compare_json_holds_every_connector(tmp_path, fake_bench, monkeypatch):
    monkeypatch.setattr("kvtool.commands.pairoptions.PairOptions.config", lambda self, **_: "launch-config")
    result = runner.invoke(app, ["bench", "--launch", "--compare", "kvtool,none", "--format", "json"])
    assert result.exit_code == 0, result.output
    assert set(json.loads(result.stdout)["connectors"]) == {"kvtool", "vllm-mooncake-store", "none"}
    assert fake_bench[0]["launch"] == "launch-config" and fake_bench[0]["compare"] == ["kvtool", "none"]


def test_bench_launch_builds_its_pair_from_the_shared_pair_flags(tmp_path, fake_bench):
    args = ["bench", "--launch", "--model", str(tmp_path), "--block-size", "64", "--roles", "both"]
    args += ["--producer-port", "8111", "--log-dir", str(tmp_path / "logs"), "-q"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    launched = fake_bench[0]["launch"]
    assert (launched.block_size, launched.roles, launched.producer_port) == (64, "both", 8111)
    assert launched.model == tmp_path.resolve() and launched.external_master is None


def test_inspect_format_json_output_quiet_and_the_old_json_flag(tmp_path):
    with fake_admin() as admin:
        admin.keys = keys_of_a_prompt()
        for flags in (["--format", "json"], ["--json"]):
            result = runner.invoke(app, ["inspect", "keys", "--admin", admin.url, *flags])
            assert result.exit_code == 0, result.output
            assert json.loads(result.stdout)["total_keys"] == len(admin.keys)
            assert ("the old name of --format json" in result.stderr) == (flags == ["--json"])
        result = runner.invoke(app, ["inspect", "store", "--admin", admin.url, "--format", "json"])
        assert json.loads(result.stdout)["capacity_bytes"] == 1000
        target = tmp_path / "store.json"
        result = runner.invoke(app, ["inspect", "store", "--admin", admin.url, "-q", "--output", str(target)])
        assert result.exit_code == 0 and result.stdout == "", result.output
        assert json.loads(target.read_text())["used_ratio"] == 0.95
        watermarks = runner.invoke(app, ["inspect", "watermarks", "--admin", admin.url, "--namespace", "0" * 16])
        assert watermarks.exit_code == 0 and "no watermark records" in watermarks.stdout, watermarks.output
        watermarks = runner.invoke(app, ["inspect", "watermarks", "--admin", admin.url, "-n", "0" * 16, "--json"])
        assert watermarks.exit_code == 2  # -n is no flag of inspect: a usage error
        admin.keys = keys_of_a_prompt(others=False)
        tokens = ",".join(map(str, range(100, 185)))
        args = ["inspect", "prompt", "--admin", admin.url, "--tokens", tokens, "--block-size", "32", "--no-verify"]
        prompt = json.loads(runner.invoke(app, [*args, "--format", "json"]).stdout)
        assert prompt["hit_tokens"] == 84
        watermarks = runner.invoke(app, ["inspect", "watermarks", "--admin", admin.url, "--format", "json"])
        assert json.loads(watermarks.stdout)["watermarks"] == []


# ---- exit codes -----------------------------------------------------------------------------


@pytest.fixture
def no_pair(monkeypatch):
    """Fails the test if a bench reaches a pair: launching one, generating a model, reading a ready file."""

    def forbidden(*_args, **_kwargs):
        raise AssertionError("bad input must be refused before any I/O")

    monkeypatch.setattr("kvtool.bench.command.run_bench", forbidden)
    monkeypatch.setattr("kvtool.model.ensure_default_model", forbidden)


@pytest.mark.parametrize(
    "args",
    [
        ["--launch", "--compare", "kvtool,sglang"],
        ["--launch", "--workload", "no-such-workload"],
        ["--launch", "--workload", "trace:/no/such/trace.jsonl"],
        ["--launch", "--format", "xml"],
        ["--launch", "--output", "/dev/null/bench.json"],
        ["--launch", "--plot", "/dev/null/bench.png"],
        ["--launch", "--requests", "0"],
        ["--launch", "--model-preset", "huge"],
        ["--launch", "--model-size", "huge"],
        ["--launch", "--connector", "sglang"],
        ["--launch", "--output", "a.json", "--json", "b.json"],
        ["--pair", "ready.json", "--launch"],
        ["--pair", "ready.json", "--compare", "kvtool,none"],
    ],
)
def test_bench_bad_input_exits_2_before_any_io(args, no_pair):
    result = runner.invoke(app, ["bench", *args])
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output


def test_inspect_bad_input_exits_2_before_the_admin_is_asked():
    with fake_admin() as admin:
        for args in (
            ["keys", "--kind", "blocks"],
            ["keys", "--limit", "0"],
            ["keys", "--format", "yaml"],
            ["store", "--eviction-high-watermark", "1.5"],
            ["store", "--output", "/dev/null/store.json"],
            ["prompt", "--tokens", "1,x"],
            ["prompt", "--tokens", "1,2"],  # no block size: not from --pair, not given
        ):
            result = runner.invoke(app, ["inspect", *args, "--admin", admin.url])
            assert result.exit_code == 2, (args, result.output)
        assert admin.requests == []


def test_a_dead_admin_is_exit_1():
    result = runner.invoke(app, ["inspect", "store", "--admin", "http://127.0.0.1:9", "--format", "json"])
    assert result.exit_code == 1 and result.stdout == ""
    assert result.stderr.startswith("error: the Mooncake master admin")


def test_ctrl_c_is_exit_130(tmp_path, monkeypatch):
    def interrupted(*_args, **_kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("kvtool.bench.command.run_bench", interrupted)
    result = runner.invoke(app, ["bench", "--pair", str(write_ready(tmp_path, tmp_path))])
    assert result.exit_code == 130, result.output


def test_every_command_shows_the_exit_codes_and_hides_the_old_flag_names():
    for command in (["serve-pair"], ["bench"], ["model"], ["inspect", "keys"], ["inspect", "store"]):
        result = runner.invoke(app, [*command, "--help"], env={"COLUMNS": "160"})
        assert result.exit_code == 0, result.output
        assert "Exit codes:" in result.stdout, command
        for code, meaning in EXIT_CODES:
            assert f"{code:<4} {meaning[:30]}" in result.stdout, (command, code)
        assert "--model-size" not in result.stdout and "--json" not in result.stdout
    serve_help = runner.invoke(app, ["serve-pair", "--help"], env={"COLUMNS": "160"}).stdout
    bench_help = runner.invoke(app, ["bench", "--help"], env={"COLUMNS": "160"}).stdout
    for flag in ("--model-preset", "--master-port", "--block-size", "--roles", "--startup-timeout", "--master "):
        assert flag in serve_help and flag in bench_help, flag


def test_the_old_preset_names_still_work():
    result = runner.invoke(app, ["serve-pair", "--model-size", "huge"])
    assert result.exit_code == 2 and "--model-preset 'huge' is not one of: tiny, bench" in result.stderr
    assert "--size" not in runner.invoke(app, ["model", "--help"]).stdout
    result = runner.invoke(app, ["model", "--size", "huge"])
    assert result.exit_code == 2 and "--preset 'huge' is not one of" in result.stderr


def test_the_cli_and_the_inspect_library_do_not_import_each_other():
    probe = (
        "import sys, kvtool.inspect.keys, kvtool.inspect.prompt, kvtool.inspect.store, kvtool.inspect.watermarks;"
        "assert not [m for m in sys.modules if m.startswith(('kvtool.cli', 'kvtool.commands'))], sorted(sys.modules);"
        "import kvtool.cli"
    )
    done = subprocess.run([sys.executable, "-c", probe], cwd=Path(__file__).resolve().parents[2], capture_output=True)
    assert done.returncode == 0, done.stderr.decode()


def test_sigterm_stops_a_bench_as_ctrl_c_does(tmp_path):
    """SIGTERM while the bench waits on its pair: one line, exit 130, no traceback."""
    import http.server
    import signal
    import threading

    asked = threading.Event()
    release = threading.Event()

    class Pair(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # /health: both engines are up
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def do_POST(self):  # the first completion never answers until the test is done
            asked.set()
            release.wait(60)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Pair)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"vocab_size": 1000}))
    url = f"http://127.0.0.1:{server.server_port}"
    ready = tmp_path / "ready.json"
    ready.write_text(
        json.dumps(
            {
                "producer": url,
                "consumer": url,
                "model": str(model),
                "block_size": 32,
                "hash_unit": 1,
                "max_model_len": 2048,
                "connector": "none",
            }
        )
    )
    bench = subprocess.Popen(
        [sys.executable, "-m", "kvtool.cli", "bench", "--pair", str(ready), "--requests", "2"],
        cwd=Path(__file__).resolve().parents[2],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        assert asked.wait(120), "the bench never sent a request"
        bench.send_signal(signal.SIGTERM)
        _, stderr = bench.communicate(timeout=60)
    finally:
        release.set()
        if bench.poll() is None:
            bench.kill()
        server.shutdown()
    assert bench.returncode == 130, stderr.decode()
    assert "interrupted" in stderr.decode() and "Traceback" not in stderr.decode()
