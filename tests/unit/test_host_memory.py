"""The memory check before a fleet scales out (kvtool.pair.hostmemory): the kernel's numbers read from a
directory laid out as /proc and a cgroup, the real /proc, and the scaler refusing an engine the host
has no room for (nothing started, the fleet as it was)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from kvtool.errors import UserError
from kvtool.pair.hostmemory import GIB, HostMemory, check_room, largest_engine
from kvtool.pair.scale import ScaleRequest

from .test_fleet_scale import Fleet


def _process(proc: Path, pid: int, parent: int, comm: str, pss_kb: int | None, rss_kb: int) -> None:
    folder = proc / str(pid)
    folder.mkdir(parents=True)
    (folder / "stat").write_text(f"{pid} ({comm}) S {parent} {pid} {pid} 0 -1\n")
    (folder / "status").write_text(f"Name:\t{comm}\nVmRSS:\t{rss_kb} kB\n")
    if pss_kb is not None:
        (folder / "smaps_rollup").write_text(f"00400000-7fff [rollup]\nRss:  {rss_kb} kB\nPss:  {pss_kb} kB\n")


def _limit(group: Path, limit: str, used: str, inactive_file: int = 0) -> None:
    group.mkdir(parents=True, exist_ok=True)
    (group / "memory.max").write_text(limit + "\n")
    (group / "memory.current").write_text(used + "\n")
    (group / "memory.stat").write_text(f"anon 1000\nfile 5000\ninactive_file {inactive_file}\nactive_file 7\n")


def _host(tmp_path: Path, available_kb: int = 8 << 20, cgroup: tuple[str, str] | None = None) -> HostMemory:
    proc, groups = tmp_path / "proc", tmp_path / "cgroup"
    proc.mkdir(parents=True)
    (proc / "meminfo").write_text(f"MemTotal:  {24 << 20} kB\nMemFree:  1000 kB\nMemAvailable:  {available_kb} kB\n")
    (proc / "self").mkdir()
    (proc / "self" / "cgroup").write_text("0::/pod.slice/fleet.scope\n")
    if cgroup is not None:
        _limit(groups / "pod.slice" / "fleet.scope", *cgroup)
    # engine-0: an API server (100) whose engine core (101, a name with spaces and parentheses) runs a
    # worker (102, no smaps_rollup: its VmRSS counts); 200 is another engine, 1 is init.
    _process(proc, 1, 0, "init", 10, 10)
    _process(proc, 100, 1, "vllm", 600 << 10, 700 << 10)
    _process(proc, 101, 100, "VLLM::Engine (core) 0", 660 << 10, 900 << 10)
    _process(proc, 102, 101, "worker", None, 3 << 20)
    _process(proc, 200, 1, "vllm", 500 << 10, 600 << 10)
    return HostMemory(proc=proc, cgroup=groups)


def test_an_engine_is_its_whole_process_tree_counted_by_pss_where_the_kernel_gives_it(tmp_path):
    host = _host(tmp_path)
    assert host.tree_bytes(100) == (600 + 660 + 3 * 1024) << 20  # Pss, Pss, then the worker's VmRSS
    assert host.tree_bytes(200) == 500 << 20 and host.tree_bytes(999) == 0  # a pid gone: nothing
    assert largest_engine(host, [("engine-0", 100), ("engine-1", 200)]) == ("engine-0", host.tree_bytes(100))
    assert largest_engine(host, []) is None


def test_what_the_host_can_give_is_memavailable_capped_by_the_fleets_cgroup(tmp_path):
    assert _host(tmp_path / "a").available() == 8 * GIB
    limited = _host(tmp_path / "b", cgroup=(str(10 * GIB), str(7 * GIB)))
    assert limited.available() == 3 * GIB  # the container's limit less its use
    assert _host(tmp_path / "c", cgroup=("max", str(7 * GIB))).available() == 8 * GIB  # no limit set
    assert HostMemory(proc=tmp_path / "none", cgroup=tmp_path / "none").available() is None
    cached = _host(tmp_path / "d", cgroup=(str(10 * GIB), str(9 * GIB)))
    _limit(tmp_path / "d" / "cgroup" / "pod.slice" / "fleet.scope", str(10 * GIB), str(9 * GIB), 4 * GIB)
    assert cached.available() == 5 * GIB  # page cache it can drop (model files read) is room
    parent = _host(tmp_path / "e", cgroup=(str(10 * GIB), str(1 * GIB)))
    _limit(tmp_path / "e" / "cgroup" / "pod.slice", str(4 * GIB), str(2 * GIB))
    assert parent.available() == 2 * GIB  # the pod's limit binds though the leaf's leaves 9


def test_the_room_check_names_the_engine_the_sizes_and_what_to_do(tmp_path):
    check_room("engine-3", ("engine-0", 4 * GIB), 6 * GIB)  # 4 GiB and the start's margin fit
    with pytest.raises(UserError) as refused:
        check_room("engine-3", ("engine-0", 4 * GIB), 3 * GIB)
    message = refused.value.message
    assert message.startswith("not starting engine-3: an engine of this fleet takes about 4.0 GiB (engine-0 now)")
    assert "the host has 3.0 GiB available" in message and "--kv-cache-gib" in message and "\n" not in message
    check_room("engine-3", None, 1)  # nothing measured: no refusal on a guess
    check_room("engine-3", ("engine-0", 4 * GIB), None)
    with pytest.raises(UserError, match="takes about 6.0 GiB \\(its KV cache alone\\)"):
        check_room("engine-3", ("engine-0", 4 * GIB), 6 * GIB, kv_cache=6 * GIB)  # untouched KV pages count


def test_a_pid_loop_in_a_snapshot_of_proc_ends(tmp_path):
    host = _host(tmp_path)
    (tmp_path / "proc" / "1" / "stat").write_text("1 (init) S 102 1 1 0 -1\n")  # pid reuse: a loop 1 -> 100 -> ... -> 1
    assert host.tree_bytes(1) > 0


def test_the_real_proc_gives_this_hosts_numbers():
    host = HostMemory()
    available = host.available()
    assert available is not None and available > 0
    child = subprocess.Popen(["sleep", "30"])
    try:
        assert 0 < host.tree_bytes(child.pid) < host.tree_bytes(os.getpid())  # the test's tree holds the child
    finally:
        child.kill()
        child.wait(timeout=10)


class TightHost(HostMemory):
    """A host with 1 GiB available whose every engine takes 4 GiB (what the scaler must refuse)."""

    def available(self) -> int | None:
        return GIB

    def tree_bytes(self, pid: int, children: dict[int, list[int]] | None = None) -> int:
        return 4 * GIB


def test_a_fleet_without_room_for_another_engine_starts_none_and_stays_as_it_was(processes, tmp_path):
    fleet_ = Fleet(processes, tmp_path)
    fleet_.scaler.memory = TightHost()
    state = fleet_.scaler.scale(ScaleRequest("a", 3))
    assert state.state == "failed" and state.message.startswith("not starting engine-2: an engine of this fleet")
    assert fleet_.scaler.cfg.engines == 2 and [p.name for p in processes.processes] == ["engine-0", "engine-1"]
    assert fleet_.members.out == frozenset() and set(fleet_.ready().engines) == {"engine-0", "engine-1"}
    state = fleet_.scaler.scale(ScaleRequest("b", 1))  # scaling in needs no room
    assert state.state == "done" and fleet_.scaler.cfg.engines == 1
