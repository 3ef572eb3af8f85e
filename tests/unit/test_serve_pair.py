"""serve-pair's pure logic: configs, command lines, ready file, and its one-line user errors."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from kvtool import procs
from kvtool.errors import UserError
from kvtool.files import write_json_atomically
from kvtool.pair.config import ServePairConfig
from kvtool.pair.engines import (
    cpu_halves,
    rank_binding,
    engine_argv,
    engine_env,
    kv_transfer_config,
    kvtool_extra_config,
    request_log_path,
)
from kvtool.pair.preflight import preflight
from kvtool.store.mooncake import master_argv, mooncake_config_path, store_argv, vllm_mooncake_file_config
from kvtool.pair.ready import admin_url_for, ready_info
from kvtool.pair.smoke import metric_total, smoke_prompts

MiB = 1 << 20


def make_config(tmp_path: Path, model: Path | None = None, **overrides) -> ServePairConfig:
    return ServePairConfig(model=model or tmp_path / "model", log_dir=tmp_path / "logs", **overrides)


def flag_value(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_kvtool_extra_config_has_the_stores_section_on_loopback():
    assert kvtool_extra_config("127.0.0.1:50051", hash_unit=4) == {
        "mooncake": {
            "master_server_address": "127.0.0.1:50051",
            "metadata_server": "P2PHANDSHAKE",
            "protocol": "tcp",
            "local_hostname": "127.0.0.1",
            "global_segment_size": 256 * MiB,
            "local_buffer_size": 64 * MiB,
        },
        "hash_unit": 4,
    }


def test_kvtool_extra_config_is_accepted_by_the_connector():
    config_module = pytest.importorskip("connector.config")
    loaded = config_module.load_config(kvtool_extra_config("127.0.0.1:50051", hash_unit=8, global_segment_size=0))
    assert loaded.hash_unit == 8
    assert loaded.backend.global_segment_size == 0


@pytest.mark.parametrize("role, kv_role", [("producer", "kv_producer"), ("consumer", "kv_consumer")])
def test_kvtool_connector_transfer_config(tmp_path, role, kv_role):
    cfg = make_config(tmp_path, master_port=6000, hash_unit=2)
    transfer = kv_transfer_config(cfg, role)
    assert transfer == {
        "kv_connector": "KVToolConnector",
        "kv_connector_module_path": "connector.connector",
        "kv_role": kv_role,
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": kvtool_extra_config(
            "127.0.0.1:6000", hash_unit=2, request_log=request_log_path(cfg, role)
        ),
    }
    assert transfer["kv_connector_extra_config"]["request_log"].endswith(f"{role}-requests.jsonl")


@pytest.mark.parametrize("role", ["producer", "consumer"])
def test_roles_both_makes_each_kvtool_engine_kv_both(tmp_path, role):
    cfg = make_config(tmp_path, master_port=6000, roles="both")
    transfer = kv_transfer_config(cfg, role)
    assert transfer == {
        "kv_connector": "KVToolConnector",
        "kv_connector_module_path": "connector.connector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            **kvtool_extra_config("127.0.0.1:6000", request_log=request_log_path(cfg, role)),
            "save_answers": True,
        },
    }
    # Each engine keeps its own request log: both now save and load, and save their answers.
    assert transfer["kv_connector_extra_config"]["request_log"].endswith(f"{role}-requests.jsonl")
    assert json.loads(flag_value(engine_argv(cfg, role, python="python"), "--kv-transfer-config")) == transfer


def test_roles_default_to_producer_and_consumer(tmp_path):
    cfg = make_config(tmp_path)
    assert cfg.roles == "pd"
    assert [kv_transfer_config(cfg, role)["kv_role"] for role in ("producer", "consumer")] == [
        "kv_producer",
        "kv_consumer",
    ]


@pytest.mark.parametrize("roles, kv_roles", [("pd", ["kv_producer", "kv_consumer"]), ("both", ["kv_both", "kv_both"])])
def test_roles_with_vllms_store_connector(tmp_path, roles, kv_roles):
    cfg = make_config(tmp_path, connector="vllm-mooncake-store", roles=roles)
    transfers = [kv_transfer_config(cfg, role) for role in ("producer", "consumer")]
    assert [t["kv_role"] for t in transfers] == kv_roles
    # With roles both it saves its decoded blocks too (whole blocks only), as kvtool saves its answers.
    extra = {"kv_connector_extra_config": {"save_decode_cache": True}} if roles == "both" else {}
    assert all(
        t == {"kv_connector": "MooncakeStoreConnector", "kv_role": kv, "kv_load_failure_policy": "recompute", **extra}
        for t, kv in zip(transfers, kv_roles, strict=True)
    )


def test_roles_both_without_a_connector_is_refused(tmp_path, model_dir):
    cfg = make_config(tmp_path, model_dir, connector="none", roles="both")
    with pytest.raises(UserError) as caught:
        preflight(cfg)
    assert caught.value.message == (
        "--roles both needs a connector; drop it or pick --connector kvtool or vllm-mooncake-store"
    )
    assert kv_transfer_config(cfg, "producer") is None


def test_unknown_roles_value_is_refused():
    from pydantic import ValidationError

    with pytest.raises(ValidationError):
        ServePairConfig(model=Path("/m"), log_dir=Path("/l"), roles="kv_both")


def test_bench_compare_runs_the_no_connector_baseline_without_roles(tmp_path):
    from kvtool.bench.command import launch_config

    cfg = make_config(tmp_path, roles="both")
    assert launch_config(cfg, "kvtool", compare=True).roles == "both"
    assert launch_config(cfg, "vllm-mooncake-store", compare=True).roles == "both"
    assert launch_config(cfg, "none", compare=True).roles == "pd"
    assert launch_config(cfg, "none").roles == "both"  # alone, preflight refuses it with one sentence


def test_kv_load_failure_policy_exists_in_installed_vllm():
    kv_transfer = pytest.importorskip("vllm.config.kv_transfer")
    assert "recompute" in str(kv_transfer.KVTransferConfig.__dataclass_fields__["kv_load_failure_policy"].type)


def test_standalone_store_engines_lend_no_segment(tmp_path):
    cfg = make_config(tmp_path, store="standalone", store_port=7000)
    extra = kv_transfer_config(cfg, "producer")["kv_connector_extra_config"]
    assert extra["mooncake"]["global_segment_size"] == 0
    argv = store_argv(cfg, "mooncake_client")
    assert "--host=127.0.0.1" in argv and "--port=7000" in argv
    assert "--metadata_server=P2PHANDSHAKE" in argv
    assert f"--global_segment_size={1 << 30}" in argv


def test_vllm_mooncake_store_connector(tmp_path):
    cfg = make_config(tmp_path, connector="vllm-mooncake-store", master_port=6001)
    assert kv_transfer_config(cfg, "consumer") == {
        "kv_connector": "MooncakeStoreConnector",
        "kv_role": "kv_consumer",
        "kv_load_failure_policy": "recompute",
    }
    env = engine_env(cfg, "consumer", base={})
    assert env["MOONCAKE_CONFIG_PATH"] == str(mooncake_config_path(cfg))
    assert vllm_mooncake_file_config("127.0.0.1:6001") == {
        "local_hostname": "127.0.0.1",
        "metadata_server": "P2PHANDSHAKE",
        "global_segment_size": 256 * MiB,
        "local_buffer_size": 64 * MiB,
        "protocol": "tcp",
        "device_name": "",
        "master_server_address": "127.0.0.1:6001",
    }
    assert vllm_mooncake_file_config("127.0.0.1:6001", global_segment_size=0)["mode"] == "standalone-store"


def test_no_connector_means_no_transfer_config_and_no_mooncake(tmp_path):
    cfg = make_config(tmp_path, connector="none")
    assert kv_transfer_config(cfg, "producer") is None
    assert "--kv-transfer-config" not in engine_argv(cfg, "producer")
    assert not cfg.starts_master and cfg.master_address is None


def test_engine_argv_and_env(tmp_path):
    cfg = make_config(tmp_path, producer_port=8111, block_size=64)
    argv = engine_argv(cfg, "producer", python="python")
    assert argv[:3] == ["python", "-m", "vllm.entrypoints.openai.api_server"]
    assert flag_value(argv, "--host") == "127.0.0.1"
    assert flag_value(argv, "--port") == "8111"
    assert flag_value(argv, "--block-size") == "64"
    assert flag_value(argv, "--gpu-memory-utilization") == "0.3"
    assert json.loads(flag_value(argv, "--kv-transfer-config"))["kv_role"] == "kv_producer"

    env = engine_env(cfg, "producer", base={"MOONCAKE_CONFIG_PATH": "/elsewhere.json", "PYTHONPATH": "/x"})
    assert env["VLLM_HOST_IP"] == env["MC_TCP_BIND_ADDRESS"] == "127.0.0.1"
    assert env["HF_HUB_OFFLINE"] == "1"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert "MOONCAKE_CONFIG_PATH" not in env  # must not leak into the kvtool connector's config
    assert env["PYTHONPATH"].split(":")[-1] == "/x"
    assert (Path(env["PYTHONPATH"].split(":")[0]) / "kvtool").is_dir()


def test_cpu_halves_split_disjointly():
    assert cpu_halves([0, 1]) == ("0", "1")
    assert cpu_halves([0, 1, 2, 3]) == ("0,1", "2,3")
    assert cpu_halves([5]) == ("all", "all")


def test_master_stays_on_loopback(tmp_path):
    argv = master_argv(6002, 6003, "mooncake_master")
    assert "--rpc_address=127.0.0.1" in argv and "--rpc_port=6002" in argv
    assert "--metrics_host=127.0.0.1" in argv and "--metrics_port=6003" in argv
    assert "--enable_http_metadata_server=false" in argv


def test_ready_info_content(tmp_path):
    cfg = make_config(tmp_path, producer_port=8101, consumer_port=8201, master_port=6004, admin_port=6005)
    pids = {"master": 1, "producer": 2, "consumer": 3}
    info = ready_info(cfg, pids, admin_url_for(cfg), {"master": 2}).to_json()
    assert info == {
        "producer": "http://127.0.0.1:8101",
        "consumer": "http://127.0.0.1:8201",
        "master": "127.0.0.1:6004",
        "admin": "http://127.0.0.1:6005",
        "master_pid": 1,
        "model": str(tmp_path / "model"),
        "block_size": 32,
        "hash_unit": 1,
        "divergence_grid": 8,  # the auto grid: a quarter of the 32-token block
        "max_model_len": 2048,
        "connector": "kvtool",
        "roles": "pd",
        "store": "embedded",
        "store_address": None,
        "log_dir": str(tmp_path / "logs"),
        "request_logs": {
            "producer": str(tmp_path / "logs" / "producer-requests.jsonl"),
            "consumer": str(tmp_path / "logs" / "consumer-requests.jsonl"),
        },
        "pids": {"master": 1, "producer": 2, "consumer": 3},
        "restarts": {"master": 2},
        "router": None,
        "router_policy": None,
        "engines": {},
        "scaling": None,
    }
    ready = tmp_path / "ready.json"
    write_json_atomically(ready, info)
    assert json.loads(ready.read_text()) == info
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_an_external_master_has_an_admin_url_but_no_pid(tmp_path):
    cfg = make_config(tmp_path, external_master="10.0.0.7:50051", admin_port=9100)
    info = ready_info(cfg, {"producer": 2, "consumer": 3}, admin_url_for(cfg))
    assert (info.master, info.admin, info.master_pid, info.restarts) == (
        "10.0.0.7:50051",
        "http://10.0.0.7:9100",
        None,
        {},
    )
    assert admin_url_for(make_config(tmp_path, connector="none")) is None


@pytest.mark.parametrize("connector, roles, written", [("kvtool", "both", "both"), ("none", "pd", None)])
def test_ready_info_names_the_roles(tmp_path, connector, roles, written):
    cfg = make_config(tmp_path, connector=connector, roles=roles)
    assert ready_info(cfg, {"producer": 2, "consumer": 3}, admin_url_for(cfg)).roles == written


def test_port_in_use_names_the_flag():
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        with pytest.raises(UserError) as caught:
            procs.ensure_port_free(port, "--producer-port")
    assert caught.value.message == f"port {port} is already in use on 127.0.0.1; pick another with --producer-port"


def test_preflight_rejects_duplicate_ports(tmp_path, model_dir):
    cfg = make_config(tmp_path, model_dir, producer_port=8123, consumer_port=8123)
    with pytest.raises(UserError, match="--producer-port and --consumer-port are both 8123"):
        preflight(cfg)


def test_preflight_rejects_block_size_the_cpu_backend_refuses(tmp_path, model_dir, monkeypatch):
    monkeypatch.setattr("kvtool.pair.preflight.is_cpu_vllm", lambda: True)
    with pytest.raises(UserError, match="multiple of 32"):
        preflight(make_config(tmp_path, model_dir, block_size=16))


@pytest.mark.parametrize("gib", [0.25, 1.5, 0])
def test_preflight_rejects_a_kv_cache_the_cpu_backend_cannot_take(tmp_path, model_dir, monkeypatch, gib):
    monkeypatch.setattr("kvtool.pair.preflight.is_cpu_vllm", lambda: True)
    with pytest.raises(UserError, match=f"--kv-cache-gib {gib:g} cannot be given to vLLM's CPU backend"):
        preflight(make_config(tmp_path, model_dir, kv_cache_gib=gib))


def test_smoke_prompts_extend_the_producer_prompt():
    (short, short_ext), (long, long_ext) = smoke_prompts(1024)
    assert (len(short), len(short_ext), len(long), len(long_ext)) == (20, 50, 85, 115)
    assert short_ext[:20] == short and long_ext[:85] == long
    assert all(3 <= t < 1024 for t in short_ext + long_ext)
    assert smoke_prompts(1024) == smoke_prompts(1024)


def test_metric_total_sums_label_sets():
    text = '# HELP x\nvllm:hits_total{a="1"} 3.0\nvllm:hits_total{a="2"} 4\nvllm:hits_total_other 9\n'
    assert metric_total(text, "vllm:hits_total") == 7.0
    assert metric_total(text, "missing") is None


def test_the_cpu_demo_configs_are_what_serve_pair_generates(tmp_path):
    configs = Path(__file__).resolve().parents[2] / "configs" / "cpu-demo"
    for roles, files in (("pd", {"producer": "producer", "consumer": "consumer"}), ("both", {"producer": "both"})):
        cfg = make_config(tmp_path, roles=roles)
        for role, name in files.items():
            generated = kv_transfer_config(cfg, role)
            del generated["kv_connector_extra_config"]["request_log"]  # a per-run path, not part of the example
            assert json.loads((configs / f"kv-transfer-{name}.json").read_text()) == generated, name
    expected = vllm_mooncake_file_config(make_config(tmp_path).master_address)
    assert json.loads((configs / "mooncake.json").read_text()) == expected


def test_the_ready_file_serve_pair_writes_is_the_one_every_reader_parses(tmp_path):
    from kvtool.pair.ready import parse_ready_file

    cfg = ServePairConfig(model=tmp_path, log_dir=tmp_path, max_model_len=1024)
    written = ready_info(cfg, {"master": 11, "producer": 12, "consumer": 13}, "http://127.0.0.1:9003", {"master": 1})
    parsed = parse_ready_file(json.loads(json.dumps(written.to_json())), "the ready file")
    assert (parsed.max_model_len, parsed.admin, parsed.master_pid, parsed.restarts) == (
        1024,
        "http://127.0.0.1:9003",
        11,
        {"master": 1},
    )
    assert parsed == written


def test_every_connector_choice_has_one_profile_and_they_say_what_the_branches_said():
    from kvtool.pair.profiles import CONNECTOR_NAMES, PROFILES, profile

    assert CONNECTOR_NAMES == ("kvtool", "vllm-mooncake-store", "lmcache", "none") == tuple(PROFILES)
    kvtool, vllm, lmcache, none = (profile(name) for name in CONNECTOR_NAMES)
    # What code used to learn by comparing names, each profile says.
    assert [p.name for p in PROFILES.values() if p.starts_lmcache] == ["lmcache"]
    assert [p.name for p in PROFILES.values() if p.has_divergence_grid] == ["kvtool"]
    assert [p.name for p in PROFILES.values() if not p.has_roles] == ["none"]
    assert (lmcache.uses_store, lmcache.durability, lmcache.hits_from) == (False, "settle", "usage")
    assert (kvtool.durability, kvtool.hits_from, kvtool.uses_store) == ("signal", "request_log", True)
    assert (vllm.durability, vllm.hits_from, vllm.mooncake_config_file) == ("key_count", "usage", True)
    assert (none.uses_store, none.durability) == (False, "none")


def test_a_fault_plan_reaches_the_connectors_through_their_config_only_when_a_test_sets_one(tmp_path):

    plain = ServePairConfig(model=tmp_path, log_dir=tmp_path)
    assert "fault_control_file" not in kv_transfer_config(plain, "consumer")["kv_connector_extra_config"]
    faulty = ServePairConfig(model=tmp_path, log_dir=tmp_path, fault_control_file=tmp_path / "faults.json")
    extra = kv_transfer_config(faulty, "producer")["kv_connector_extra_config"]
    assert extra["fault_control_file"] == str(tmp_path / "faults.json")


def test_a_mamba_preset_pair_gets_its_engine_flags_and_the_engines_block_size(tmp_path, monkeypatch):
    from kvtool.commands.pairoptions import PairOptions

    monkeypatch.setattr("kvtool.model.ensure_default_model", lambda preset: tmp_path / preset)
    cfg = PairOptions(model_preset="mamba", log_dir=tmp_path).config(report=lambda _: None)
    producer, consumer = engine_argv(cfg, "producer"), engine_argv(cfg, "consumer")
    for argv in (producer, consumer):
        assert (
            flag_value(argv, "--mamba-cache-mode") == "align" and flag_value(argv, "--max-num-batched-tokens") == "64"
        )
        assert flag_value(argv, "--prefix-cache-retention-interval") == "64"  # a state at every block boundary
        assert flag_value(argv, "--block-size") == "32"  # vLLM raises it to 64 itself
    # The producer's prefill stops one token short of the prompt (see ModelPreset.engine_args_for).
    assert flag_value(producer, "--prefix-match-unit") == "1" and "--prefix-match-unit" not in consumer
    in_tree = cfg.model_copy(update={"connector": "vllm-mooncake-store"})
    assert flag_value(engine_argv(in_tree, "consumer"), "--prefix-match-unit") == "1"  # its own sub-block hits
    assert ready_info(cfg, {}, None).block_size == 64


def test_plain_presets_add_no_engine_flags(tmp_path, monkeypatch):
    from kvtool.commands.pairoptions import PairOptions

    monkeypatch.setattr("kvtool.model.ensure_default_model", lambda preset: tmp_path / preset)
    for preset in ("tiny", "swa"):
        cfg = PairOptions(model_preset=preset, log_dir=tmp_path).config(report=lambda _: None)
        argv = engine_argv(cfg, "producer")
        assert "--prefix-match-unit" not in argv and "--mamba-cache-mode" not in argv
        assert ready_info(cfg, {}, None).block_size == 32


def test_max_num_batched_tokens_sets_the_engines_prefill_chunk(tmp_path, monkeypatch):
    from kvtool.commands.pairoptions import PairOptions

    monkeypatch.setattr("kvtool.model.ensure_default_model", lambda preset: tmp_path / preset)
    cfg = PairOptions(model_preset="swa", log_dir=tmp_path, max_num_batched_tokens=64).config(report=lambda _: None)
    for role in ("producer", "consumer"):
        assert flag_value(engine_argv(cfg, role), "--max-num-batched-tokens") == "64"
    with pytest.raises(UserError, match="mamba preset"):
        PairOptions(model_preset="mamba", log_dir=tmp_path, max_num_batched_tokens=128).config(report=lambda _: None)


def test_tensor_parallel_engines_bind_one_core_list_per_rank(tmp_path):
    cfg = make_config(tmp_path, tensor_parallel_size=2)
    argv = engine_argv(cfg, "consumer", python="python")
    assert flag_value(argv, "--tensor-parallel-size") == "2"
    assert flag_value(argv, "--distributed-executor-backend") == "mp"
    assert engine_env(cfg, "consumer", base={})["VLLM_CPU_OMP_THREADS_BIND"].count("|") == 1
    assert "--tensor-parallel-size" not in engine_argv(make_config(tmp_path), "consumer", python="python")
    gpu = make_config(tmp_path, attention_backend="FLASH_ATTN")
    assert flag_value(engine_argv(gpu, "producer", python="python"), "--attention-backend") == "FLASH_ATTN"
    assert rank_binding("0,1", 1) == "0,1"
    assert rank_binding("0,1,2,3", 2) == "0,1|2,3"
    assert rank_binding("0", 2, usable=[0, 1]) == "0|1"  # fewer cores than ranks: the machine's, shared
    assert rank_binding("all", 2, usable=[0, 1, 2, 3]) == "0,1|2,3"
    assert rank_binding("0", 2, usable=[0]) == "0|0"
