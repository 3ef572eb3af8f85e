"""How much memory this host can give one more engine, and how much one takes: the check a fleet makes
before it scales out (``kvtool.pair.scale``), so that an engine added never pushes the host into the
kernel's out-of-memory killer (which picks the largest process: a serving engine, or the store).

Measured, not configured: what an engine takes is what the largest engine of the fleet takes now, its
whole process tree (API server, engine core, workers), counted by proportional set size (``Pss`` in
``/proc/PID/smaps_rollup``: a page shared by several processes counts once in the sum), ``VmRSS``
where that file cannot be read. What the host can give is the kernel's ``MemAvailable``, or less where
the fleet runs in a cgroup with a memory limit (a container): its ``memory.max`` less its
``memory.current``. Linux only, as the engines are; where nothing can be read the check says nothing.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from kvtool.errors import UserError

GIB = 1 << 30
# An engine starting takes more than it holds once serving (its compile and profiling runs, the
# tokenizer's and the model's files read): the room asked for is this much more than a serving one's.
START_MARGIN = 1.15


@dataclass(frozen=True)
class HostMemory:
    """Where the kernel's numbers are read (the real ones by default; a test gives a directory)."""

    proc: Path = Path("/proc")
    cgroup: Path = Path("/sys/fs/cgroup")

    def available(self) -> int | None:
        """Bytes a new process can take without swapping or reclaim storms: ``MemAvailable``, capped by
        this process's cgroup (v2) limit less its usage; None where neither can be read."""
        host = _meminfo_field(_read(self.proc / "meminfo"), "MemAvailable")
        room = self._cgroup_room()
        known = [value for value in (host, room) if value is not None]
        return min(known) if known else None

    def _cgroup_room(self) -> int | None:
        """The least room any cgroup (v2) above this process leaves: its ``memory.max`` less its working set
        (``memory.current`` less the page cache it may drop, ``inactive_file``: model files read once
        fill it in a container). A parent's limit (a pod, a slice) binds as much as the leaf's."""
        # "0::/path" in /proc/self/cgroup names this process's cgroup under the mounted hierarchy.
        entry = next((line for line in _read(self.proc / "self" / "cgroup").splitlines() if line.startswith("0::")), "")
        if not entry:
            return None
        group, rooms = self.cgroup / entry.removeprefix("0::").strip().lstrip("/"), []
        while True:
            limit, used = _read(group / "memory.max").strip(), _read(group / "memory.current").strip()
            if limit.isdigit() and used.isdigit():  # "max": no limit at this level
                dropped = _stat_field(_read(group / "memory.stat"), "inactive_file")
                rooms.append(max(0, int(limit) - max(0, int(used) - dropped)))
            if group == self.cgroup or self.cgroup not in group.parents:
                break
            group = group.parent
        return min(rooms) if rooms else None

    def tree_bytes(self, pid: int, children: dict[int, list[int]] | None = None) -> int:
        """Memory of ``pid`` and every process below it (0 where it is gone); ``children``: the process
        table read once (``children``) for several trees."""
        table = children if children is not None else self.children()
        return sum(self._process_bytes(member) for member in _tree(pid, table))

    def _process_bytes(self, pid: int) -> int:
        rollup = _meminfo_field(_read(self.proc / str(pid) / "smaps_rollup"), "Pss")
        if rollup is not None:
            return rollup
        return _meminfo_field(_read(self.proc / str(pid) / "status"), "VmRSS") or 0

    def children(self) -> dict[int, list[int]]:
        """Each pid's children, from one read of the process table."""
        children: dict[int, list[int]] = {}
        for pid, parent in self._parents():
            children.setdefault(parent, []).append(pid)
        return children

    def _parents(self) -> Iterable[tuple[int, int]]:
        for entry in self.proc.iterdir() if self.proc.is_dir() else ():
            if not entry.name.isdigit():
                continue
            stat = _read(entry / "stat")
            # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after the last ")".
            fields = stat[stat.rfind(")") + 1 :].split()
            if len(fields) > 1 and fields[1].isdigit():
                yield int(entry.name), int(fields[1])


def check_room(name: str, largest: tuple[str, int] | None, available: int | None, kv_cache: int = 0) -> None:
    """Refuse to start engine ``name`` where the host lacks the room a serving engine takes (``largest``:
    the fleet's largest engine and its bytes), and never less than its KV cache (``kv_cache`` bytes: pages
    an engine has not touched yet are not in its PSS). Says nothing where the room is unknown, or no
    engine was measured."""
    if largest is None or available is None or largest[1] <= 0:
        return
    reference, size = largest
    if size < kv_cache:
        reference, size = "its KV cache alone", kv_cache
    else:
        reference = f"{reference} now"
    need = int(size * START_MARGIN)
    if available < need:
        raise UserError(
            f"not starting {name}: an engine of this fleet takes about {size / GIB:.1f} GiB ({reference}) and "
            f"the host has {available / GIB:.1f} GiB available; free memory, or give the engines less KV cache "
            "(--kv-cache-gib) and restart the fleet"
        )


def largest_engine(memory: HostMemory, engines: Iterable[tuple[str, int]]) -> tuple[str, int] | None:
    """The engine (name, pid) of ``engines`` whose process tree takes most memory, with its bytes."""
    children = memory.children()  # /proc read once for every engine
    sizes = [(name, memory.tree_bytes(pid, children)) for name, pid in engines]
    return max(sizes, key=lambda item: item[1], default=None)


def _tree(root: int, children: dict[int, list[int]]) -> list[int]:
    tree, todo, seen = [], [root], set()
    while todo:
        pid = todo.pop()
        if pid in seen:  # a pid reused while /proc was read could close a loop
            continue
        seen.add(pid)
        tree.append(pid)
        todo += children.get(pid, [])
    return tree


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def _meminfo_field(text: str, name: str) -> int | None:
    """``name:   1234 kB`` in a meminfo-style text, in bytes; None where absent."""
    for line in text.splitlines():
        label, _, value = line.partition(":")
        if label == name:
            number = value.split()
            return int(number[0]) * 1024 if number and number[0].isdigit() else None
    return None


def _stat_field(text: str, name: str) -> int:
    """``name 1234`` in a memory.stat text, in bytes; 0 where absent."""
    for line in text.splitlines():
        label, _, value = line.partition(" ")
        if label == name and value.strip().isdigit():
            return int(value)
    return 0
