"""Every bad setting named (issue 38): a bad field stops the engine with one sentence that names the field,
its value and what it accepts, wherever it is checked: building the config (``connector.config``), the
engine's block size (``check_block_size``), an object's size (the worker's staging areas)."""

from __future__ import annotations

import json
import logging
import math
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from connector.config import ConfigError, KVToolConfig, check_block_size, load_config
from connector.store.mooncake_config import MooncakeSettings, parse_size
from connector.worker.worker import WorkerSide

from .scripted_store import InlineCalls, ScriptedStore
from .test_worker import LAYERS, NS, NUM_BLOCKS, SMALL_AREAS, kv_caches

MASTER = {"master_server_address": "127.0.0.1:1"}


def refusal(extra) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(extra)
    message = str(info.value)
    assert "\n" not in message and message.startswith("kvtool connector config: ")
    return message


@pytest.mark.parametrize(
    "field,value",
    [
        # Raised something other than ConfigError, or said no field, before.
        ("global_segment_size", "infGB"),
        ("global_segment_size", "-5GB"),
        ("mooncake", [1]),
        ("mooncake", "x"),
        # Accepted silently before: types are exact (a bool is no number, a string no timeout).
        ("hash_unit", True),
        ("hash_unit", 2.0),
        ("divergence_grid", True),
        ("divergence_grid", -1),
        ("divergence_grid", "8"),
        ("extend_min_tokens", 0),
        ("lookup_timeout_s", "2"),
        ("load_timeout_s", math.inf),
        ("save_timeout_s", 0),
        ("connect_timeout_s", -1.0),
        ("breaker_failures", True),
        ("breaker_failures", 0),
        ("breaker_max_backoff_s", math.nan),
        ("save_buffer_bytes", 0),
        ("load_buffer_bytes", 1.5),
        ("shutdown_drain_s", -1),
        ("save_answers", 1),
        ("skip_unprofitable_loads", "yes"),
        ("prefault_segment", 0),
        ("on_cache_reset", "never"),
        ("store_backend", "redis"),
        ("model_id", ""),
        ("weights_digest", 5),
        ("request_log", ""),
        ("fault_control_file", 5),
        ("metadata_server", ""),
        ("local_hostname", ""),
        ("device_name", None),
        ("protocol", "udp"),
        ("local_buffer_size", 0),
        ("master_server_address", 50051),
    ],
)
def test_a_bad_field_is_one_sentence_naming_it_its_value_and_what_it_accepts(field, value):
    message, shown = refusal({**MASTER, field: value}), json.dumps(value)  # the value as the config writes it
    assert f"'{field}' is {shown}; it should " in message or f"'mooncake.{field}' is {shown}; it should " in message


def test_each_kind_of_field_says_what_it_accepts():
    assert refusal({**MASTER, "hash_unit": True}).endswith(
        "field 'hash_unit' is true; it should be a whole number above 0"
    )
    assert 'is "2"; it should be a finite number of seconds above 0' in refusal({**MASTER, "lookup_timeout_s": "2"})
    assert "is 1; it should be true or false" in refusal({**MASTER, "save_answers": 1})
    assert 'is ""; it should be a non-empty string, or null' in refusal({**MASTER, "model_id": ""})
    assert "is \"udp\"; it should be 'tcp' or 'rdma'" in refusal({**MASTER, "protocol": "udp"})
    assert "'mooncake.master_server_address' is missing; give it: host:port" in refusal({})


def test_the_first_back_off_is_at_most_the_longest():
    message = refusal({**MASTER, "breaker_backoff_s": 20, "breaker_max_backoff_s": 10})
    assert "field 'breaker_backoff_s' is 20.0; " in message and "at most breaker_max_backoff_s (10.0)" in message
    assert load_config({**MASTER, "breaker_backoff_s": 10, "breaker_max_backoff_s": 10}).breaker_backoff_s == 10


def test_the_extra_config_itself_and_the_file_field_are_checked():
    assert "'kv_connector_extra_config' is [1]; it should be an object" in refusal([1])
    assert "'mooncake_config_path' is 5; it should be the path of a Mooncake JSON file" in refusal(
        {"mooncake_config_path": 5}
    )


@pytest.mark.parametrize(
    "content,held", [("[1]", "a JSON list"), ('{"mooncake": 3}', "no Mooncake field"), ("{", "not JSON")]
)
def test_a_mooncake_file_that_holds_no_settings_is_named(tmp_path, content, held):
    path = tmp_path / "mooncake.json"
    path.write_text(content)
    message = refusal({"mooncake_config_path": str(path)})
    assert f"field 'mooncake_config_path' is {json.dumps(str(path))}; it should name a" in message and held in message


def test_a_section_that_is_no_object_is_named_when_a_file_gives_settings_too(tmp_path):
    path = tmp_path / "mooncake.json"
    path.write_text(json.dumps(MASTER))
    message = refusal({"mooncake_config_path": str(path), "mooncake": [1]})
    assert "field 'mooncake' is [1]; it should be an object of master_server_address" in message


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=6,
)
FIELDS = sorted({*KVToolConfig.model_fields, *MooncakeSettings.model_fields} - {"master_server_address"})


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(FIELDS), JSON_VALUES)
def test_any_value_of_any_field_is_a_config_or_a_sentence_naming_that_field(field, value):
    try:
        load_config({**MASTER, field: value})
    except ConfigError as exc:
        assert f"field '{field}" in str(exc) or f"field 'mooncake.{field}" in str(exc), str(exc)


@given(st.text(max_size=12))
def test_a_size_is_bytes_or_a_value_error(text):
    try:
        size = parse_size(text)
    except ValueError:
        return
    assert isinstance(size, int) and size >= 0


@pytest.mark.parametrize("block_size", [16, 64])
def test_the_token_grids_fit_the_engines_block_size(block_size):
    for fits in ({"hash_unit": block_size}, {"divergence_grid": block_size}, {"divergence_grid": 0}, {}):
        check_block_size(load_config({**MASTER, **fits}), block_size)  # as wide as a block: none inside
    with pytest.raises(ConfigError) as info:
        check_block_size(load_config({**MASTER, "hash_unit": 100000, "divergence_grid": block_size + 1}), block_size)
    message = str(info.value)
    assert "field 'hash_unit' is 100000; it should be at most the engine's block size" in message
    assert f"field 'divergence_grid' is {block_size + 1}; " in message and f"block size, {block_size}" in message


@pytest.mark.parametrize("field", ["save_buffer_bytes", "load_buffer_bytes"])
def test_a_staging_area_smaller_than_one_object_stops_the_engine(field):
    config = load_config({**MASTER, **SMALL_AREAS, field: 1})
    side = WorkerSide(NS, ScriptedStore(), config, saves_enabled=True, load_calls=InlineCalls())
    with pytest.raises(ConfigError, match=f"field '{field}' is 1; it should hold at least one object of this model"):
        side.register_kv_caches(kv_caches("zeros"), [LAYERS], NUM_BLOCKS)


def test_the_connector_passes_a_bad_setting_on_instead_of_serving_without_the_connector(monkeypatch):
    import connector.connector as module

    def refuse(*_args):
        raise ConfigError.of("field 'save_buffer_bytes' is 1; it should hold at least one object of this model")

    monkeypatch.setattr(module, "check_attention_layout", lambda config, layout: None)
    instance = module.KVToolConnector.__new__(module.KVToolConnector)
    instance.layout = SimpleNamespace(layer_names=(("a",),), attention=(None,))
    instance._vllm_config = None
    instance._kv_cache_config = SimpleNamespace(num_blocks=4)
    instance._worker = SimpleNamespace(register_kv_caches=refuse)
    with pytest.raises(ConfigError, match="save_buffer_bytes"):
        instance.register_kv_caches({"a": torch.zeros(4, 2)})


def store_source(caplog) -> str:
    return next(r.getMessage() for r in caplog.records if "the store's settings come from" in r.getMessage())


def test_a_stale_mooncake_config_path_in_the_environment_never_stops_a_whole_config(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("MOONCAKE_CONFIG_PATH", str(tmp_path / "gone.json"))
    caplog.set_level(logging.INFO, logger="vllm.kvtool")
    assert load_config({"mooncake": MASTER}).backend.master_server_address == "127.0.0.1:1"
    assert store_source(caplog).endswith(
        "from the extra config (MOONCAKE_CONFIG_PATH " + str(tmp_path / "gone.json") + " is not read)"
    )
    path = tmp_path / "mooncake.json"
    path.write_text(json.dumps({"master_server_address": "127.0.0.9:2"}))
    caplog.clear()
    assert load_config({"mooncake_config_path": str(path)}).backend.master_server_address == "127.0.0.9:2"
    assert f"the file {path} (mooncake_config_path)" in store_source(caplog)


def test_the_environments_file_gives_the_store_settings_the_extra_config_leaves_to_it(tmp_path, monkeypatch, caplog):
    path = tmp_path / "mooncake.json"
    path.write_text(json.dumps({"master_server_address": "127.0.0.9:2", "protocol": "rdma"}))
    monkeypatch.setenv("MOONCAKE_CONFIG_PATH", str(path))
    caplog.set_level(logging.INFO, logger="vllm.kvtool")
    config = load_config({"protocol": "tcp", "hash_unit": 4})
    assert (config.backend.master_server_address, config.backend.protocol) == ("127.0.0.9:2", "tcp")
    assert store_source(caplog).endswith(f"from the file {path} (MOONCAKE_CONFIG_PATH; fields in the extra config win)")
    monkeypatch.setenv("MOONCAKE_CONFIG_PATH", str(tmp_path / "gone.json"))
    assert "environment variable 'MOONCAKE_CONFIG_PATH' is " in refusal({"hash_unit": 4})
