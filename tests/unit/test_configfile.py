"""`kvtool config` and the files under configs/: every file there validates as what it is, a bad field is
one sentence naming it and what it accepts, and a pair file fills in serve-pair's flags."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from typer.testing import CliRunner

from connector.store.mooncake_config import parse_size
from kvtool.cli import app
from kvtool.commands.pairoptions import PairOptions
from kvtool.configfile import KV_TRANSFER_FIELDS, check_config_file
from kvtool.errors import UserError

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
FILES = sorted(p for p in CONFIGS.rglob("*") if p.suffix in (".json", ".toml"))


def expected_kind(path: Path) -> str:
    return {".toml": "pair"}.get(path.suffix) or ("mooncake" if path.name == "mooncake.json" else "connector")


def run(*args: str):
    return CliRunner().invoke(app, ["config", *args])


def test_configs_holds_each_setting_for_each_deployment():
    for setting in ("cpu-demo", "gpu-store", "multi-node-ha"):
        names = {p.name for p in (CONFIGS / setting).iterdir()}
        assert {f"kv-transfer-{role}.json" for role in ("producer", "consumer", "both")} | {"mooncake.json"} <= names
    assert (CONFIGS / "cpu-demo" / "pair.toml").is_file() and (CONFIGS / "README.md").is_file()


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(CONFIGS)))
def test_every_file_under_configs_validates_as_what_it_is(path):
    result = run("validate", str(path), "--format", "json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["valid"] and report["kind"] == expected_kind(path)
    assert path.name in (CONFIGS / "README.md").read_text()  # each file is described beside it


def test_the_kvtool_connector_configs_hold_the_roles_their_names_say():
    for path in CONFIGS.rglob("kv-transfer-*.json"):
        checked = check_config_file(path)
        role = {"producer": "kv_producer", "consumer": "kv_consumer", "both": "kv_both"}[path.stem.split("-")[-1]]
        assert checked.content["kv_role"] == role and checked.connector is not None
        assert checked.connector.save_answers == (role == "kv_both")  # a kv_both engine saves its answers


BAD = {
    "pair.toml": ('block-size = "big"\n', "field 'block-size'"),
    "typo.toml": ("blok-size = 32\n", "unknown field 'blok-size' (accepted: model, model-preset"),
    "connector.toml": ('connector = "sglang"\n', "is not one of: kvtool, vllm-mooncake-store, lmcache, none"),
    "size.json": (
        {
            "kv_connector": "KVToolConnector",
            "kv_connector_module_path": "connector.connector",
            "kv_role": "kv_producer",
            "kv_connector_extra_config": {"mooncake": {"master_server_address": "h:1", "global_segment_size": "4XB"}},
        },
        "'mooncake.global_segment_size'",
    ),
    "role.json": ({"kv_connector": "KVToolConnector", "kv_role": "producer"}, "use one of kv_producer, kv_consumer"),
    "module.json": ({"kv_connector": "KVToolConnector", "kv_role": "kv_both"}, "'kv_connector_module_path'"),
    "extra.json": ({"master_server_address": "127.0.0.1:1", "hash_unt": 2}, "unknown field 'hash_unt'"),
    "mode.json": (
        {"master_server_address": "127.0.0.1:1", "mode": "standalone-store", "global_segment_size": 5},
        "needs global_segment_size 0",
    ),
    "lends.json": ({"master_server_address": "127.0.0.1:1", "mode": "standalone-store"}, "needs global_segment_size 0"),
    "list.json": ([1], "must hold an object"),
    "vllm.json": ({"kv_connector": "KVToolConnector", "kv_role": "kv_both", "kv_buffer_size": 1}, "'kv_buffer_size'"),
    "broken.json": ("{", "is not valid JSON"),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_a_bad_file_is_one_sentence_naming_the_field_exit_2(tmp_path, name):
    content, expected = BAD[name]
    path = tmp_path / name
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    result = run("validate", str(path))
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in result.output, result.output
    assert expected in result.output.replace("\n", ""), result.output


def test_a_mooncake_file_without_a_segment_size_lends_the_readers_default(tmp_path):
    (tmp_path / "m.json").write_text('{"master_server_address": "127.0.0.1:1", "mode": "embedded"}')
    assert check_config_file(tmp_path / "m.json").kind == "mooncake"


def test_a_file_of_no_known_kind_asks_for_kind(tmp_path):
    (tmp_path / "x.json").write_text('{"colour": "blue"}')
    assert "--kind" in run("validate", str(tmp_path / "x.json")).output
    assert run("validate", str(tmp_path / "x.json"), "--kind", "sideways").exit_code == 2


def test_kv_transfer_fields_are_vllms():
    from vllm.config.kv_transfer import KVTransferConfig

    assert set(KV_TRANSFER_FIELDS) == {f.name for f in dataclasses.fields(KVTransferConfig)}


def test_a_pair_file_fills_in_the_flags_the_command_line_does_not_give(tmp_path):
    (tmp_path / "pair.toml").write_text('block-size = 64\nroles = "both"\nmodel = "models/m"\nhash_unit = 4\n')
    options = PairOptions(config_file=tmp_path / "pair.toml", roles="pd")
    filled = options.with_file(given={"roles"})
    assert (filled.block_size, filled.roles, filled.hash_unit) == (64, "pd", 4)  # --roles given: it wins
    assert filled.model == tmp_path / "models" / "m"  # relative to the file
    assert PairOptions().with_file() == PairOptions()  # no --config: nothing changes
    (tmp_path / "bad.toml").write_text("fault-control-file = '/x'\n")  # a testing flag no file may set
    with pytest.raises(UserError, match="unknown field 'fault-control-file'"):
        PairOptions(config_file=tmp_path / "bad.toml").with_file()


def test_serve_pair_refuses_a_bad_pair_file_before_starting_anything(tmp_path):
    (tmp_path / "pair.toml").write_text("producer-port = 0.5\n")
    result = CliRunner().invoke(app, ["serve-pair", "--config", str(tmp_path / "pair.toml")])
    assert result.exit_code == 2 and "field 'producer-port'" in result.output, result.output


@pytest.mark.parametrize(
    ("content", "named"),
    [
        ("memory-utilization = 2.0", "--memory-utilization"),
        ("startup-timeout = 0", "--startup-timeout"),
        ("producer-port = 99999", "--producer-port"),
        ("producer-port = 8100\nconsumer-port = 8100", "--consumer-port are both 8100"),
        ("segment-mib = 0", "--segment-mib"),
        ("hash-unit = 64", "--hash-unit 64 is larger"),
        ("block-size = 0", "block-size"),
        ('model = "nowhere"', "does not exist"),
    ],
)
def test_validate_refuses_a_pair_file_serve_pair_would_refuse(tmp_path, content, named):
    """What serve-pair refuses before it starts anything, validate refuses too (it said "valid")."""
    (tmp_path / "pair.toml").write_text(content + "\n")
    result = run("validate", str(tmp_path / "pair.toml"))
    assert result.exit_code == 2, result.output
    assert named in result.output and str(tmp_path / "pair.toml") in result.output and "Traceback" not in result.output


def test_serve_pair_names_the_flag_of_a_bad_value_before_starting_anything():
    result = CliRunner().invoke(app, ["serve-pair", "--memory-utilization", "5", "--segment-mib", "64"])
    assert result.exit_code == 2 and "--memory-utilization" in result.output, result.output
    result = CliRunner().invoke(app, ["serve-pair", "--segment-mib", "0"])
    assert result.exit_code == 2 and "--segment-mib" in result.output, result.output


def test_show_prints_the_effective_connector_config_of_each_engine_of_the_demo_pair():
    result = run("show", str(CONFIGS / "cpu-demo" / "pair.toml"))
    assert result.exit_code == 0, result.output
    shown = json.loads(result.output)
    assert shown["pair"]["block_size"] == 32 and shown["pair"]["connector"] == "kvtool"
    producer, consumer = shown["engines"]["producer"], shown["engines"]["consumer"]
    assert producer["kv_transfer_config"]["kv_role"] == "kv_producer"
    assert consumer["kv_transfer_config"]["kv_role"] == "kv_consumer"
    assert consumer["connector"]["lookup_timeout_s"] == 2.0  # defaults filled in
    assert consumer["connector"]["mooncake"]["master_server_address"] == "127.0.0.1:50051"


def test_show_without_a_file_prints_the_defaults_and_with_one_its_effective_config(tmp_path):
    defaults = json.loads(run("show").output)["connector"]
    assert defaults["divergence_grid"] == "auto" and defaults["mooncake"]["protocol"] == "tcp"
    shown = json.loads(run("show", str(CONFIGS / "gpu-store" / "kv-transfer-consumer.json")).output)["connector"]
    assert shown["mooncake"]["global_segment_size"] == 0 and shown["mooncake"]["local_buffer_size"] == 1 << 30
    assert run("show", str(CONFIGS / "cpu-demo" / "mooncake.json"), "--output", str(tmp_path / "o.json")).exit_code == 0
    assert json.loads((tmp_path / "o.json").read_text())["connector"]["mooncake"]["local_hostname"] == "127.0.0.1"


@pytest.mark.parametrize(
    ("text", "size"), [("4GB", 4 << 30), ("512 MB", 512 << 20), ("64MiB", 64 << 20), ("1.5gb", 3 << 29), ("100", 100)]
)
def test_sizes_as_mooncake_files_write_them(text, size):
    assert parse_size(text) == size


@given(st.integers(min_value=0, max_value=1 << 50), st.sampled_from(["", "B", "KB", "MB", "GB"]))
def test_a_whole_size_in_any_unit_parses_exactly(number, unit):
    assert parse_size(f"{number}{unit}") == number * {"": 1, "B": 1, "KB": 1 << 10, "MB": 1 << 20, "GB": 1 << 30}[unit]


def test_the_operators_guide_names_every_connector_field():
    from connector.config import KVToolConfig
    from connector.store.mooncake_config import MooncakeSettings

    guide = (Path(__file__).resolve().parents[2] / "docs" / "operators-guide.md").read_text()
    table = guide[guide.index("| field | default | meaning |") :].split("\n\n")[0]
    named = {
        name
        for cell in re.findall(r"^\| ([^|]+) \|", table, flags=re.MULTILINE)
        for name in re.findall(r"`(\w+)`", cell)
    }
    fields = (set(KVToolConfig.model_fields) - {"backend", "store_backend"}) | set(MooncakeSettings.model_fields)
    assert fields - named == set(), sorted(fields - named)


def test_serve_pair_takes_the_file_and_the_flags_given_on_its_command_line_win(tmp_path, monkeypatch):
    (tmp_path / "m").mkdir()
    (tmp_path / "pair.toml").write_text('model = "m"\nproducer-port = 8100\nblock-size = 64\nroles = "both"\n')
    started = []
    monkeypatch.setattr("kvtool.pair.launch.run_pair", lambda cfg, *args, **kwargs: started.append(cfg) or 0)
    argv = ["serve-pair", "--config", str(tmp_path / "pair.toml"), "--producer-port", "9999", "--roles", "pd"]
    result = CliRunner().invoke(app, argv)
    assert result.exit_code == 0, result.output
    (cfg,) = started
    assert (cfg.producer_port, cfg.roles, cfg.block_size, cfg.model) == (9999, "pd", 64, (tmp_path / "m").resolve())
