"""The pair's store processes: LMCache's multiprocess server as the lmcache peer's store."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtool.errors import UserError
from kvtool.pair.config import ServePairConfig
from kvtool.pair.engines import engine_env, kv_transfer_config
from kvtool.pair.preflight import preflight
from kvtool.store.mooncake import lmcache_argv


def lmcache_config(tmp_path: Path, **overrides) -> ServePairConfig:
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text('{"vocab_size": 1024}')
    return ServePairConfig(model=model, log_dir=tmp_path / "logs", connector="lmcache", **overrides)


def test_lmcache_runs_on_loopback_in_chunks_of_one_block_with_both_transfer_paths(tmp_path):
    cfg = lmcache_config(tmp_path, store_port=6100, admin_port=6101, block_size=64)
    argv = lmcache_argv(cfg, "lmcache")
    flags = dict(zip(argv[2::2], argv[3::2], strict=False))
    assert argv[:2] == ["lmcache", "server"]
    assert flags["--host"] == flags["--http-host"] == "127.0.0.1"
    assert (flags["--port"], flags["--http-port"], flags["--chunk-size"]) == ("6100", "6101", "64")
    assert argv[argv.index("--supported-transfer-mode") + 1] == "auto"  # vLLM CPU workers are engine-driven


def test_lmcache_engines_name_the_server_and_agree_on_python_hashes(tmp_path):
    cfg = lmcache_config(tmp_path, store_port=6100)
    config = kv_transfer_config(cfg, "consumer")
    assert config["kv_connector"] == "LMCacheMPConnector" and config["kv_role"] == "kv_consumer"
    assert config["kv_connector_extra_config"] == {"lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": 6100}
    assert engine_env(cfg, "producer", base={})["PYTHONHASHSEED"] == "0"
    assert "PYTHONHASHSEED" not in engine_env(ServePairConfig(model=tmp_path, log_dir=tmp_path), "producer", base={})
    assert not cfg.uses_mooncake and cfg.starts_lmcache


def test_lmcache_not_installed_is_one_sentence_saying_how(tmp_path, monkeypatch):
    monkeypatch.setattr("kvtool.store.mooncake.importlib.util.find_spec", lambda name: None)
    monkeypatch.setattr("kvtool.pair.preflight.ensure_port_free", lambda port, flag: None)
    with pytest.raises(UserError, match="scripts/setup --with-lmcache"):
        preflight(lmcache_config(tmp_path))


def test_lmcache_ports_must_differ(tmp_path, monkeypatch):
    monkeypatch.setattr("kvtool.pair.preflight.ensure_port_free", lambda port, flag: None)
    with pytest.raises(UserError, match="--store-port and --admin-port"):
        preflight(lmcache_config(tmp_path, store_port=6100, admin_port=6100))


def test_the_store_memory_each_engine_lends_reaches_the_connectors(tmp_path):
    cfg = ServePairConfig(model=tmp_path, log_dir=tmp_path, segment_bytes=64 << 20)
    extra = kv_transfer_config(cfg, "producer")["kv_connector_extra_config"]
    assert extra["mooncake"]["global_segment_size"] == 64 << 20
    with pytest.raises(ValueError):
        ServePairConfig(model=tmp_path, log_dir=tmp_path, segment_bytes=0)


def test_a_master_group_in_ha_mode_is_named_by_its_etcd_endpoints(tmp_path, monkeypatch):
    from kvtool.pair.ready import admin_url_for

    monkeypatch.setattr("kvtool.pair.preflight.ensure_port_free", lambda port, flag: None)
    (tmp_path / "config.json").write_text("{}")
    group = "etcd://127.0.0.1:2379;127.0.0.1:2479"
    cfg = ServePairConfig(model=tmp_path, log_dir=tmp_path, external_master=group)
    extra = kv_transfer_config(cfg, "consumer")["kv_connector_extra_config"]
    assert extra["mooncake"]["master_server_address"] == group and not cfg.starts_master
    assert admin_url_for(cfg) is None  # the leader changes: inspect takes the leader's --admin
    open_endpoints = {2479}
    monkeypatch.setattr("kvtool.pair.preflight.tcp_port_open", lambda port, host: port in open_endpoints)
    preflight(cfg)  # one etcd endpoint answering is enough
    open_endpoints.clear()
    with pytest.raises(UserError, match="no etcd endpoint of the master group answers at etcd://"):
        preflight(cfg)
    bad = ServePairConfig(model=tmp_path, log_dir=tmp_path, external_master="etcd://nowhere")
    with pytest.raises(UserError, match="is not HOST:PORT"):
        preflight(bad)


def test_the_connector_takes_an_ha_group_and_fails_closed_when_no_endpoint_answers():
    from connector.calls import StoreError
    from connector.config import load_config
    from connector.store.mooncake import _check_reachable
    from kvtool.procs import find_free_port

    config = load_config({"mooncake": {"master_server_address": "etcd://127.0.0.1:2379;127.0.0.1:2479"}})
    assert config.backend.master_server_address.startswith("etcd://")
    with pytest.raises(ValueError):
        load_config({"mooncake": {"master_server_address": "etcd://127.0.0.1"}})
    closed = [find_free_port(), find_free_port()]  # nothing listens on them
    with pytest.raises(StoreError, match="is not reachable"):
        _check_reachable(f"etcd://127.0.0.1:{closed[0]};127.0.0.1:{closed[1]}", 1.0)
