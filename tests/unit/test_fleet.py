"""A fleet (serve-pair --engines N): N kv_both engines behind vLLM's router. Pure builders and the
launcher's rules, without starting anything (tests/e2e/test_fleet.py runs one)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from kvtool.errors import UserError
from kvtool.pair.engines import engine_argv, engine_cpus, engine_env, kv_role_for, kv_transfer_config
from kvtool.pair.launch import _engine_left_fleet
from kvtool.pair.preflight import check_values
from kvtool.procs import ProcessSet
from kvtool.pair.ready import ready_info
from kvtool.pair.router import router_argv

from .test_serve_pair import flag_value, make_config


def fleet(tmp_path: Path, **overrides):
    return make_config(tmp_path, **{"engines": 3, "producer_port": 8100, **overrides})


def test_a_fleets_engines_are_kv_both_save_their_answers_and_listen_on_their_own_ports(tmp_path):
    cfg = fleet(tmp_path)
    assert cfg.engine_names == ("engine-0", "engine-1", "engine-2")
    assert [cfg.port(name) for name in cfg.engine_names] == [8100, 8101, 8102]
    for name in cfg.engine_names:
        transfer = kv_transfer_config(cfg, name)
        assert kv_role_for(cfg, name) == transfer["kv_role"] == "kv_both"
        assert transfer["kv_connector_extra_config"]["save_answers"] is True
        assert flag_value(engine_argv(cfg, name), "--port") == str(cfg.port(name))
    given = fleet(tmp_path, engine_ports=(9001, 9005, 9003))
    assert [given.port(name) for name in given.engine_names] == [9001, 9005, 9003]


def test_engines_get_disjoint_cores_or_one_each_in_turn():
    assert [engine_cpus(i, 2, [0, 1, 2, 3]) for i in range(2)] == ["0,1", "2,3"]
    assert [engine_cpus(i, 3, [0, 1, 2, 3]) for i in range(3)] == ["0", "1", "2,3"]
    assert [engine_cpus(i, 3, [0, 1]) for i in range(3)] == ["0", "1", "0"]  # more engines than cores
    assert engine_cpus(0, 3, [7]) == "all"


def test_each_fleet_engine_is_bound_to_its_share(tmp_path, monkeypatch):
    monkeypatch.setattr("kvtool.pair.engines.usable_cpus", lambda: [0, 1])
    cfg = fleet(tmp_path)
    binds = [engine_env(cfg, name, base={})["VLLM_CPU_OMP_THREADS_BIND"] for name in cfg.engine_names]
    assert binds == ["0", "1", "0"]


def test_the_router_binds_loopback_and_routes_to_every_engine_by_the_policy(tmp_path):
    cfg = fleet(tmp_path, router_port=8000, router_metrics_port=29001, router_policy="power_of_two")
    argv = router_argv(cfg, "vllm-router")
    assert flag_value(argv, "--host") == flag_value(argv, "--prometheus-host") == "127.0.0.1"
    assert flag_value(argv, "--port") == "8000" and flag_value(argv, "--prometheus-port") == "29001"
    start = argv.index("--worker-urls") + 1
    assert argv[start : start + 3] == [f"http://127.0.0.1:{port}" for port in (8100, 8101, 8102)]
    assert flag_value(argv, "--policy") == "power_of_two"


def test_kv_aware_routing_wires_each_engines_kv_events_to_the_router(tmp_path):
    cfg = fleet(tmp_path, router_policy="kv_aware", kv_events_port=6100, block_size=64)
    endpoints = []
    for name in cfg.engine_names:
        events = json.loads(flag_value(engine_argv(cfg, name), "--kv-events-config"))
        assert events["enable_kv_cache_events"] is True and events["publisher"] == "zmq"
        endpoints.append(events["endpoint"])
    assert endpoints == ["tcp://127.0.0.1:6100", "tcp://127.0.0.1:6101", "tcp://127.0.0.1:6102"]
    argv = router_argv(cfg, "vllm-router")
    sources = [argv[i + 1] for i, arg in enumerate(argv) if arg == "--kv-event-source"]
    assert sources == [f"http://127.0.0.1:{8100 + i}=tcp://127.0.0.1:{6100 + i}" for i in range(3)]
    assert flag_value(argv, "--kv-event-block-size") == "64" and flag_value(argv, "--policy") == "kv_aware"
    # Any other policy: no events published, none read.
    plain = fleet(tmp_path)
    assert "--kv-events-config" not in engine_argv(plain, "engine-0")
    assert "--kv-event-source" not in router_argv(plain, "vllm-router")
    clash = fleet(tmp_path, router_policy="kv_aware", kv_events_port=8099)  # 8099 + 1 is engine-0's port
    with pytest.raises(UserError) as raised:
        check_values(clash)
    assert "8100" in raised.value.message and "--kv-events-port" in raised.value.message


def test_the_ready_file_sends_both_roles_through_the_router_and_lists_the_engines_serving(tmp_path):
    cfg = fleet(tmp_path, router_port=8000)
    pids = {"master": 1, "engine-0": 2, "engine-2": 4, "router": 5}  # engine-1 was let go
    info = ready_info(cfg, pids, None)
    assert info.producer == info.consumer == info.router == "http://127.0.0.1:8000"
    assert info.router_policy == "round_robin"
    assert info.engines == {"engine-0": "http://127.0.0.1:8100", "engine-2": "http://127.0.0.1:8102"}
    assert set(info.request_logs or {}) == {"engine-0", "engine-1", "engine-2"}


@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        ({"engines": 1}, "--engines 1 is no fleet"),
        ({"engines": 2, "engine_ports": (9001,)}, "--engine-port is given 1 time(s) for --engines 2"),
        ({"engines": 2, "producer_port": 8000, "router_port": 8001}, "both 8001"),
    ],
)
def test_bad_fleet_settings_are_one_sentence_naming_the_flag(tmp_path, overrides, says):
    with pytest.raises(UserError, match=r".*") as raised:
        check_values(make_config(tmp_path, **overrides))
    assert says in raised.value.message


def test_the_fleets_ports_are_checked_for_clashes(tmp_path):
    ports = dict((flag, port) for port, flag in check_values(fleet(tmp_path, router_port=8000)))
    assert ports["--router-port"] == 8000 and ports["--producer-port (+ the engine's index) of engine-2"] == 8102


def _ended(procs: ProcessSet, name: str) -> None:
    procs.start(name, [sys.executable, "-c", "pass"]).popen.wait(10)


def test_an_engine_that_dies_is_let_go_while_others_serve_and_the_last_one_stops_the_fleet(tmp_path):
    cfg, said, departed = fleet(tmp_path), [], []
    procs = ProcessSet(tmp_path / "logs")
    procs.on_departed = departed.append
    try:
        _ended(procs, "engine-1")
        procs.start("engine-0", [sys.executable, "-c", "import time; time.sleep(60)"])
        procs.start("engine-2", [sys.executable, "-c", "import time; time.sleep(60)"])
        dead = procs.first_dead()
        assert dead is not None and dead.name == "engine-1"
        assert _engine_left_fleet(cfg, procs, dead, said.append)
        assert procs.first_dead() is None and "engine-1" not in procs.pids() and departed == ["engine-1"]
        assert "the router takes it out of the rotation, 2 engine(s) serve on" in said[0]
    finally:
        procs.stop_all()


def test_the_pairs_engines_and_the_last_fleet_engine_still_stop_everything(tmp_path):
    procs = ProcessSet(tmp_path / "logs")
    try:
        _ended(procs, "consumer")
        dead = procs.first_dead()
        assert dead is not None and not _engine_left_fleet(make_config(tmp_path), procs, dead, print)
        cfg = fleet(tmp_path, engines=2)
        procs.departed.add("engine-0")
        _ended(procs, "engine-1")
        last = next(p for p in procs.processes if p.name == "engine-1")
        assert not _engine_left_fleet(cfg, procs, last, print)
    finally:
        procs.stop_all()


def test_serve_pair_says_a_fleet_without_the_router_installed_in_one_sentence(tmp_path, monkeypatch):
    monkeypatch.setattr("kvtool.pair.router.sys.executable", str(tmp_path / "python"))
    monkeypatch.setenv("PATH", str(tmp_path))
    from kvtool.pair.router import router_binary

    with pytest.raises(UserError, match="vllm-router is not installed"):
        router_binary()


class ScriptedEngines:
    """Answers a fleet warm-up's requests: a save (its watermark key), or a load that goes through once
    the (saver, loader) pair's first transfer is done (``stalls`` failed loads first)."""

    def __init__(self, cfg, stalls: dict[tuple[str, str], int]):
        self.by_url = {cfg.base_url(name): name for name in cfg.engine_names}
        self.stalls = dict(stalls)
        self.saved: dict[tuple[int, ...], str] = {}

    def __call__(self, url, tokens):
        from connector.core.hits import HitDetails

        engine = self.by_url[url]
        saver = self.saved.get(tuple(tokens[:-1]))
        if saver is None:
            self.saved[tuple(tokens)] = engine
            return HitDetails(prompt_tokens=len(tokens), lookup="miss", watermark_key=f"w/{len(self.saved)}")
        if self.stalls.get((saver, engine), 0) > 0:
            self.stalls[(saver, engine)] -= 1
            return HitDetails(prompt_tokens=len(tokens), lookup="load failed: timeout", load_failure="timeout")
        return HitDetails(prompt_tokens=len(tokens), lookup="hit", external_hit_tokens=len(tokens) - 1)


def _warmable(tmp_path, monkeypatch):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text('{"vocab_size": 100}')
    monkeypatch.setattr("kvtool.pair.warmup.wait_for_key", lambda admin, key, timeout_s: True)
    return fleet(tmp_path)


def test_the_warm_up_goes_on_until_every_engine_loaded_what_every_other_saved(tmp_path, monkeypatch):
    from kvtool.pair.warmup import warm_fleet

    cfg, said = _warmable(tmp_path, monkeypatch), []
    engines = ScriptedEngines(cfg, {("engine-0", "engine-2"): 2, ("engine-1", "engine-0"): 1})
    assert warm_fleet(cfg, said.append, ask=engines) == set()
    assert not any(engines.stalls.values()) and said[-1].startswith("warm: every load went through")


def test_a_pair_still_cold_at_the_deadline_is_said_and_the_fleet_serves_anyway(tmp_path, monkeypatch):
    from kvtool.pair import warmup

    cfg, said = _warmable(tmp_path, monkeypatch), []
    clock = iter(range(0, 10_000, 60))
    monkeypatch.setattr(warmup.time, "monotonic", lambda: next(clock))
    engines = ScriptedEngines(cfg, {("engine-2", "engine-1"): 10_000})
    assert warmup.warm_fleet(cfg, said.append, ask=engines) == {("engine-2", "engine-1")}
    assert "engine-1 from engine-2" in said[-1] and "serving anyway" in said[-1]


def test_only_a_kvtool_fleet_is_warmed_up(tmp_path, monkeypatch):
    from kvtool.pair.warmup import warm_fleet

    def never(url, tokens):
        raise AssertionError("no request expected")

    assert warm_fleet(make_config(tmp_path), print, ask=never) == set()  # a pair
    assert warm_fleet(fleet(tmp_path, connector="none"), print, ask=never) == set()


def test_a_fleet_defaults_to_a_standalone_store_and_the_pair_to_the_engines_segments():
    from kvtool.commands.pairoptions import PairOptions

    assert PairOptions().chosen_store == "embedded"
    assert PairOptions(engines=3).chosen_store == "standalone"  # no engine serves the others' transfers
    assert PairOptions(engines=3, connector="none").chosen_store == "embedded"  # none holds nothing
    assert PairOptions(engines=3, store="embedded").chosen_store == "embedded"  # what is given wins


def test_an_engine_rejoining_is_warmed_up_both_ways_with_each_engine_serving_and_no_other_pair(tmp_path, monkeypatch):
    from kvtool.pair.warmup import warm_engine

    cfg, said = _warmable(tmp_path, monkeypatch), []
    engines = ScriptedEngines(cfg, {("engine-1", "engine-2"): 1, ("engine-0", "engine-1"): 2})
    assert warm_engine(cfg, "engine-1", ["engine-0", "engine-2"], said.append, ask=engines) == set()
    assert not any(engines.stalls.values())
    assert said[0] == "warming engine-1 up with the 2 engine(s) serving (4 pairs)"
    assert warm_engine(cfg, "engine-1", [], said.append, ask=engines) == set()  # alone: nothing to warm


def test_a_cpu_engine_starts_without_aot_compile_unless_the_operator_set_it(tmp_path, monkeypatch):
    monkeypatch.setattr("kvtool.pair.engines.is_cpu_vllm", lambda: True)
    cfg = fleet(tmp_path)
    assert engine_env(cfg, "engine-0", base={})["VLLM_USE_AOT_COMPILE"] == "0"
    assert engine_env(cfg, "engine-0", base={"VLLM_USE_AOT_COMPILE": "1"})["VLLM_USE_AOT_COMPILE"] == "1"
    monkeypatch.setattr("kvtool.pair.engines.is_cpu_vllm", lambda: False)
    assert "VLLM_USE_AOT_COMPILE" not in engine_env(cfg, "engine-0", base={})


def test_a_fleet_of_lmcache_engines_shares_one_multiprocess_server(tmp_path):
    cfg = fleet(tmp_path, connector="lmcache")
    check_values(cfg)  # no refusal: every engine kv_both, on the one server at --store-port
    for name in cfg.engine_names:
        transfer = kv_transfer_config(cfg, name)
        assert transfer["kv_role"] == "kv_both"
        assert transfer["kv_connector_extra_config"]["lmcache.mp.port"] == cfg.store_port
        assert engine_env(cfg, name)["PYTHONHASHSEED"] == "0"  # its chunk keys agree across engines
