"""The memory this engine lends the store, faulted in before puts land in it.

Mooncake allocates the segment an engine lends (``global_segment_size``) at set-up and leaves its pages
untouched, so every put into a fresh part of it first takes a page fault per 4 KiB page: measured
here, a 2.5 MB put into a fresh segment cost 1.44 ms of CPU against 0.59 ms once its pages were in,
and a 100-token save of the bench model 4.4 ms against 3.0 (``benchmarks/fast-path/segment_faults.py``).
In the embedded mode that CPU is the engine's (the put's copy into the segment runs in this
process). Until the segment has been filled once, every save paid it.

The client does not say where the segment is. It is the one new private anonymous mapping of at least
its size that set-up made (``/proc/self/maps`` read before and after); ``MADV_POPULATE_WRITE`` (Linux
5.14) faults its pages in without writing to them, so it is safe while puts already land there. It
runs on a background thread, in chunks, once per client. Where the mapping is not found (none or
several candidates) or the kernel refuses, nothing is done: puts fault their pages in as before.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

logger = logging.getLogger("vllm.kvtool")

MADV_POPULATE_WRITE = 23  # linux/mman.h, since 5.14
CHUNK_BYTES = 64 << 20  # one madvise call (the GIL is released during it); a close stops between chunks
MAPS = "/proc/self/maps"

Region = tuple[int, int]  # [start, end) addresses


def anonymous_regions(maps_text: str) -> set[Region]:
    """The private, writable mappings with no backing file (``/proc/<pid>/maps`` lines): where a
    malloc'd or mmap'd heap buffer lives. Named pseudo-files ([heap], [stack]) are left out too."""
    regions = set()
    for line in maps_text.splitlines():
        fields = line.split()
        if len(fields) < 5 or not fields[1].startswith("rw") or fields[1][3:4] != "p" or len(fields) > 5:
            continue
        start, _, end = fields[0].partition("-")
        regions.add((int(start, 16), int(end, 16)))
    return regions


def new_region(before: str, after: str, min_bytes: int) -> Region | None:
    """The one stretch of anonymous memory mapped in ``after`` and not in ``before`` spanning at least
    ``min_bytes``; None when there is none or more than one (which is the segment cannot be told).

    Only what is new counts: the kernel merges a new mapping into an adjacent one of the same kind,
    and the older part (someone else's memory, perhaps a large reservation that is never touched)
    must not be faulted in with it."""
    old = sorted(anonymous_regions(before))
    grown = []
    for start, end in anonymous_regions(after):
        cursor = start
        for old_start, old_end in old:  # the parts of [start, end) no old mapping covered
            if old_end <= cursor or old_start >= end:
                continue
            if old_start > cursor:
                grown.append((cursor, old_start))
            cursor = max(cursor, old_end)
        if cursor < end:
            grown.append((cursor, end))
    grown = [r for r in grown if r[1] - r[0] >= min_bytes]
    return grown[0] if len(grown) == 1 else None


@dataclass
class Prefault:
    """One segment's fault-in: where, and how it went (``done`` is set when the thread has ended)."""

    region: Region
    faulted_bytes: int = 0
    error: int | None = None  # errno of a refused madvise
    seconds: float = 0.0

    def __post_init__(self) -> None:
        self.done = threading.Event()
        self.cancelled = threading.Event()  # the client is closing: no further chunk is faulted in

    @property
    def complete(self) -> bool:
        """Every page of the region was faulted in (not refused, not cut short by a close)."""
        return self.done.is_set() and self.faulted_bytes == self.region[1] - self.region[0]


def _madvise() -> Callable[[int, int, int], int]:
    libc = ctypes.CDLL(None, use_errno=True)
    call = libc.madvise
    call.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    call.restype = ctypes.c_int
    return call


def fault_in(job: Prefault, madvise: Callable[[int, int, int], int] | None = None) -> None:
    """Fault the region's pages in, chunk by chunk; stop at the first refusal (its errno recorded)."""
    call = madvise or _madvise()
    start, end = job.region
    began = time.perf_counter()
    try:
        for offset in range(start, end, CHUNK_BYTES):
            if job.cancelled.is_set():
                return
            length = min(CHUNK_BYTES, end - offset)
            if call(offset, length, MADV_POPULATE_WRITE) != 0:
                job.error = ctypes.get_errno() or -1
                return
            job.faulted_bytes += length
    finally:
        job.seconds = time.perf_counter() - began
        job.done.set()


def prefault_in_background(region: Region, name: str = "kvtool-prefault") -> Prefault:
    """Start faulting the region in on a daemon thread; its outcome is logged when it ends."""
    job = Prefault(region)

    def run() -> None:
        fault_in(job)
        size_mib = (region[1] - region[0]) >> 20
        if job.cancelled.is_set():
            return
        if job.error is None:
            logger.info("kvtool: the store segment's %d MiB faulted in, in %.2f s", size_mib, job.seconds)
        else:
            logger.info(
                "kvtool: the kernel refused to fault the store segment in (errno %d after %d MiB); puts fault "
                "its pages in as they come",
                job.error,
                job.faulted_bytes >> 20,
            )

    threading.Thread(target=run, name=name, daemon=True).start()
    return job


def read_maps() -> str:
    try:
        with open(MAPS) as handle:
            return handle.read()
    except OSError:
        return ""  # not Linux: no region is ever found
