"""kvtool bench --compare --interleave: the alternation of the pairs and their ports (pure logic; the
e2e run is in tests/e2e/test_bench.py)."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtool.bench.command import check_bench_input
from kvtool.bench.config import BenchConfig
from kvtool.bench.interleave import PAIR_PORT_FIELDS, alternate, base_ports, own_ports, rotation
from kvtool.errors import ServerError, UserError
from kvtool.pair.config import ServePairConfig


def stepper(name: str, steps: int, log: list[tuple[str, int]], fail_at: int | None = None):
    for index in range(steps):
        if index == fail_at:
            raise ServerError(f"{name}'s consumer died")
        log.append((name, index))
        yield "consumer"


@given(st.lists(st.text(min_size=1, max_size=3), min_size=1, max_size=5, unique=True), st.integers(0, 50))
def test_each_pair_goes_first_in_turn_and_every_pair_gets_every_step(names, index):
    order = rotation(names, index)
    assert sorted(order) == sorted(names)
    assert order[0] == names[index % len(names)]


def test_every_step_goes_to_every_pair_before_the_next_step():
    log: list[tuple[str, int]] = []
    names = ["kvtool", "vllm-mooncake-store", "none"]
    alternate({name: stepper(name, 4, log) for name in names}, ["consumer"] * 4, lambda *_: None, pytest.fail)
    assert [index for _, index in log] == [i for i in range(4) for _ in names]
    firsts = [log[i * len(names)][0] for i in range(4)]
    assert firsts == ["kvtool", "vllm-mooncake-store", "none", "kvtool"]


@given(st.lists(st.sampled_from(["producer", "consumer"]), max_size=24), st.integers(2, 4))
def test_each_pair_goes_first_equally_often_on_each_engine(targets, pairs):
    """Rotated per target: a workload that alternates producer and consumer steps does not send one
    pair's consumer requests first every time."""
    names = [f"pair{i}" for i in range(pairs)]
    log: list[tuple[str, int]] = []
    alternate({name: stepper(name, len(targets), log) for name in names}, targets, lambda *_: None, pytest.fail)
    for target in ("producer", "consumer"):
        firsts = [log[i * pairs][0] for i, t in enumerate(targets) if t == target]
        counts = [firsts.count(name) for name in names]
        assert max(counts) - min(counts) <= 1, (target, firsts)


def test_a_pair_that_fails_is_dropped_and_the_others_finish():
    log: list[tuple[str, int]] = []
    failed: list[tuple[str, str]] = []
    steps_seen: list[str] = []
    alternate(
        {"kvtool": stepper("kvtool", 3, log), "none": stepper("none", 3, log, fail_at=1)},
        ["consumer"] * 3,
        lambda name, _target: steps_seen.append(name),
        lambda name, exc: failed.append((name, exc.message)),
    )
    assert failed == [("none", "none's consumer died")]
    assert [index for name, index in log if name == "kvtool"] == [0, 1, 2]
    assert [index for name, index in log if name == "none"] == [0]
    assert steps_seen.count("kvtool") == 3 and steps_seen.count("none") == 1


def config(tmp_path: Path, **overrides) -> ServePairConfig:
    return ServePairConfig(model=tmp_path, log_dir=tmp_path / "logs", **overrides)


def test_the_pairs_after_the_first_get_ports_of_their_own(tmp_path):
    cfg = config(tmp_path)
    taken = base_ports(cfg)
    counter = itertools.count(40000)
    # A probe that answers a taken port (the base's, then one it gave already) is asked again.
    answers = iter([cfg.producer_port, 40000, 40000, *range(40001, 40100)])
    second = own_ports(cfg, taken, lambda: next(answers))
    third = own_ports(cfg, taken, lambda: next(counter))
    ports = [getattr(c, name) for c in (cfg, second, third) for name in PAIR_PORT_FIELDS]
    assert len(set(ports)) == len(ports)


def test_a_shared_master_keeps_its_ports(tmp_path):
    cfg = config(tmp_path, external_master="127.0.0.1:50051", admin_port=9003)
    other = own_ports(cfg, base_ports(cfg), iter(range(41000, 41100)).__next__)
    assert (other.master_port, other.admin_port) == (cfg.master_port, cfg.admin_port)
    assert other.producer_port != cfg.producer_port and other.consumer_port != cfg.consumer_port


def test_interleave_needs_two_connectors_to_alternate():
    with pytest.raises(UserError, match="--interleave"):
        check_bench_input(BenchConfig(interleave=True), None, True, ["kvtool"])
    with pytest.raises(UserError, match="--interleave"):
        check_bench_input(BenchConfig(interleave=True), None, True, [])
    check_bench_input(BenchConfig(interleave=True), None, True, ["kvtool", "none"])
