"""serve-pair and model print through the one output object (kvtool/report.py): a table, or with
--format json one JSON document (serve-pair's: the ready file's content, and --smoke's exchanges);
the smoke check's table whatever the consumer's kv_transfer_params hold."""

from __future__ import annotations

import json

import pytest
from rich.console import Console
from typer.testing import CliRunner

from kvtool.cli import app
from kvtool.pair.ready import ReadyFile
from kvtool.report import Report

runner = CliRunner()


@pytest.mark.parametrize("params", [None, {"kvtool": {"external_hit_tokens": 85, "tail_hit_tokens": 21}}])
def test_smoke_table_tolerates_absent_kv_transfer_params(monkeypatch, params):
    import kvtool.pair.smoke as smoke

    sent = []
    monkeypatch.setattr(smoke, "_metrics", lambda url: "master_key_count 2\nvllm:external_prefix_cache_hits_total 0\n")
    monkeypatch.setattr(smoke, "model_vocab_size", lambda model: 1024)

    def fake_complete(base_url, model, prompt, **kwargs):
        sent.append((base_url, len(prompt), kwargs))
        return {"usage": {"prompt_tokens_details": {"cached_tokens": 0}}, "kv_transfer_params": params}

    monkeypatch.setattr(smoke, "complete", fake_complete)
    info = ReadyFile(
        model="/m", producer="P", consumer="C", connector="kvtool", block_size=32, hash_unit=1, max_model_len=2048
    )
    console = Console(record=True, width=100)
    cases = smoke.run_smoke(info)
    assert [(url, n) for url, n, _ in sent] == [("P", 20), ("C", 50), ("P", 85), ("C", 115)]
    assert sent[1][2] == {"max_tokens": 8, "logprobs": 5}
    assert [c["kv_transfer_params"] for c in cases] == [params, params]
    Report([smoke.smoke_table(info, cases)]).render(console)
    text = console.export_text()
    assert ("(absent)" in text) == (params is None)
    assert ("kvtool.tail_hit_tokens" in text) == (params is not None)


def test_model_with_format_json_prints_one_json_document(monkeypatch, tmp_path):
    monkeypatch.setattr("kvtool.model.ensure_default_model", lambda path, preset: tmp_path / f"{preset}-llama")
    result = runner.invoke(app, ["model", "--preset", "bench", "--format", "json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == {"preset": "bench", "path": str(tmp_path / "bench-llama")}
    table = runner.invoke(app, ["model", "--preset", "bench"])
    assert f"path: {tmp_path / 'bench-llama'}" in table.stdout


def _serving():
    """run_pair as if the pair came up: the ready callback, then the smoke check where asked."""
    from kvtool.pair.ready import ReadyFile

    info = ReadyFile(
        producer="http://127.0.0.1:8100",
        consumer="http://127.0.0.1:8200",
        model="/m",
        block_size=32,
        hash_unit=1,
        max_model_len=2048,
        connector="kvtool",
        pids={"master": 10, "producer": 11, "consumer": 12},
        log_dir="logs",
    )

    def run_pair(cfg, say, on_ready, smoke=None, policy=None):
        on_ready(info)
        if smoke is not None:
            smoke(info)
        return 0

    return info, run_pair


@pytest.mark.parametrize("smoke", [False, True])
def test_serve_pair_with_format_json_prints_one_json_document(monkeypatch, smoke):
    cases = [
        {
            "producer_prompt_tokens": 20,
            "consumer_prompt_tokens": 50,
            "store_keys": None,
            "cached_tokens": 0,
            "external_hit_tokens_metric": 0.0,
            "kv_transfer_params": None,
        }
    ]
    info, run_pair = _serving()
    monkeypatch.setattr("kvtool.pair.launch.run_pair", run_pair)
    monkeypatch.setattr("kvtool.pair.smoke.run_smoke", lambda info: cases)
    argv = ["serve-pair", "--format", "json", *(["--smoke"] if smoke else [])]
    result = runner.invoke(app, argv)
    assert result.exit_code == 0, result.output
    document = json.loads(result.stdout)  # one document, nothing else on stdout
    assert document["pair"] == info.to_json()
    assert ("smoke" in document) == smoke and document.get("smoke", cases) == cases
    table = runner.invoke(app, ["serve-pair", *(["--smoke"] if smoke else [])], env={"COLUMNS": "200"})
    assert "kvtool serve-pair" in table.stdout and "http://127.0.0.1:8100" in table.stdout
    assert ("exchange 1" in table.stdout) == smoke
