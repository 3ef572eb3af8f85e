import json

import pytest

from connector.config import ConfigError, load_config


def test_defaults_and_a_minimal_config():
    config = load_config({"master_server_address": "127.0.0.1:50051"})
    assert (config.hash_unit, config.backend.protocol, config.backend.metadata_server) == (1, "tcp", "P2PHANDSHAKE")


@pytest.mark.parametrize(
    "extra,named",
    [
        ({}, "master_server_address"),
        ({"master_server_address": "nohostport"}, "master_server_address"),
        ({"master_server_address": "127.0.0.1:1", "hash_unit": 0}, "hash_unit"),
        ({"master_server_address": "127.0.0.1:1", "protocol": "udp"}, "protocol"),
        ({"master_server_address": "127.0.0.1:1", "hash_uint": 4}, "hash_uint"),
        ({"master_server_address": "127.0.0.1:1", "lookup_timeout_s": -1}, "lookup_timeout_s"),
    ],
)
def test_a_bad_field_is_one_sentence_naming_it(extra, named):
    with pytest.raises(ConfigError) as info:
        load_config(extra)
    message = str(info.value)
    assert named in message and "\n" not in message


def test_an_unknown_field_lists_the_accepted_ones():
    with pytest.raises(ConfigError) as info:
        load_config({"master_server_address": "127.0.0.1:1", "hash_uint": 4})
    assert "accepted:" in str(info.value) and "hash_unit" in str(info.value)


def test_mooncake_fields_come_from_a_file_and_the_extra_config_wins(tmp_path, monkeypatch):
    monkeypatch.delenv("MOONCAKE_CONFIG_PATH", raising=False)
    path = tmp_path / "mooncake.json"
    path.write_text(json.dumps({"master_server_address": "127.0.0.9:1", "global_segment_size": 1024, "other": 1}))
    config = load_config({"mooncake_config_path": str(path), "master_server_address": "127.0.0.1:2"})
    assert (config.backend.master_server_address, config.backend.global_segment_size) == ("127.0.0.1:2", 1024)


def test_an_unreadable_mooncake_file_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="'mooncake_config_path' is .*; it should name a readable Mooncake JSON file"):
        load_config({"mooncake_config_path": str(tmp_path / "missing.json")})


def test_the_store_settings_have_their_own_section_and_the_flat_fields_still_work():
    nested = load_config({"mooncake": {"master_server_address": "127.0.0.1:3", "global_segment_size": 0}})
    flat = load_config({"master_server_address": "127.0.0.1:3", "global_segment_size": 0})
    assert nested == flat and nested.backend.global_segment_size == 0
    assert nested.with_backend(global_segment_size=5).backend.global_segment_size == 5
    with pytest.raises(
        ConfigError, match="'master_server_address' is \"127.0.0.1:3\"; the mooncake section gives it as"
    ):
        load_config({"master_server_address": "127.0.0.1:3", "mooncake": {"master_server_address": "127.0.0.1:4"}})
