"""The lent segment's fault-in (connector/segment.py): finding its mapping, and faulting it in."""

from __future__ import annotations

import ctypes
import mmap

from hypothesis import given
from hypothesis import strategies as st

from connector.store.segment import CHUNK_BYTES, MADV_POPULATE_WRITE, Prefault, anonymous_regions, fault_in, new_region

MAPS = "".join(
    line + "\n"
    for line in (
        "55d0c0a00000-55d0c0a21000 rw-p 00000000 00:00 0                          [heap]",
        "7f0000000000-7f0010000000 rw-p 00000000 00:00 0 ",  # anonymous lines end in a space
        "7f0010000000-7f0010001000 ---p 00000000 00:00 0 ",
        "7f0020000000-7f0020400000 rw-s 00000000 00:05 1234                       /dev/zero (deleted)",
        "7f0030000000-7f0030001000 r--p 00000000 08:01 42                         /usr/lib/libc.so.6",
        "7f0040000000-7f0040200000 rw-p 00000000 08:01 43                         /usr/lib/libfoo.so",
    )
)


def test_only_private_writable_mappings_without_a_file_are_candidates():
    assert anonymous_regions(MAPS) == {(0x7F0000000000, 0x7F0010000000)}


def test_the_segment_is_the_one_new_mapping_at_least_its_size():
    segment = "7f1000000000-7f1040000000 rw-p 00000000 00:00 0 \n"
    stack = "7f2000000000-7f2000800000 rw-p 00000000 00:00 0 \n"  # a thread's stack: too small
    assert new_region(MAPS, MAPS + segment + stack, 1 << 30) == (0x7F1000000000, 0x7F1040000000)


def test_no_mapping_or_two_candidates_find_nothing():
    one = "7f1000000000-7f1040000000 rw-p 00000000 00:00 0 \n"
    two = "7f3000000000-7f3040000000 rw-p 00000000 00:00 0 \n"
    assert new_region(MAPS, MAPS, 1 << 20) is None
    assert new_region(MAPS, MAPS + one + two, 1 << 30) is None  # which one is the segment cannot be told
    assert new_region("", "not a maps file", 1) is None


def test_only_the_new_part_of_a_mapping_that_grew_into_a_neighbour_counts():
    # The kernel merges an adjacent mapping of the same kind: the older part is someone else's memory.
    grown = MAPS.replace("7f0000000000-7f0010000000", "7f0000000000-7f0050000000")
    assert new_region(MAPS, grown, 1 << 30) == (0x7F0010000000, 0x7F0050000000)
    before = grown.replace("7f0000000000-7f0050000000", "7f0040000000-7f0050000000")
    assert new_region(before, grown, 1 << 30) == (0x7F0000000000, 0x7F0040000000)  # grown downwards


@given(
    st.lists(st.tuples(st.integers(0, 63), st.integers(1, 16)), max_size=6),
    st.lists(st.tuples(st.integers(0, 63), st.integers(1, 16)), max_size=6),
)
def test_the_region_found_is_new_memory_and_every_new_stretch_is_seen(old, new):
    """Pages (of 1 MiB here) mapped before are never in the region found; with one stretch of new
    pages at least the asked size, it is found whole."""

    def maps(spans):
        return "".join(f"{s << 20:x}-{(s + n) << 20:x} rw-p 00000000 00:00 0 \n" for s, n in spans)

    def pages(regions):
        return {page for start, end in regions for page in range(start >> 20, end >> 20)}

    # The kernel's view: overlapping or adjacent mappings of one kind are one line.
    def merged(spans):
        covered = sorted(pages((s << 20, (s + n) << 20) for s, n in spans))
        runs, start = [], None
        for i, page in enumerate(covered):
            start = page if start is None else start
            if i + 1 == len(covered) or covered[i + 1] != page + 1:
                runs.append((start, page + 1 - start))
                start = None
        return runs

    before, after = merged(old), merged(old + new)
    fresh = pages(anonymous_regions(maps(after))) - pages(anonymous_regions(maps(before)))
    found = new_region(maps(before), maps(after), 4 << 20)
    if found is not None:
        assert pages([found]) <= fresh
    stretches = [run for run in merged([(p, 1) for p in fresh]) if run[1] >= 4]
    if len(stretches) == 1:
        start, length = stretches[0]
        assert found == (start << 20, (start + length) << 20)


@given(st.lists(st.integers(min_value=1, max_value=5 * CHUNK_BYTES), min_size=1, max_size=3))
def test_every_byte_is_asked_for_once_in_chunks(sizes):
    for size in sizes:
        calls: list[tuple[int, int, int]] = []
        job = Prefault((4096, 4096 + size))
        fault_in(job, lambda *args, calls=calls: calls.append(args) or 0)
        assert [a for _, _, a in calls] == [MADV_POPULATE_WRITE] * len(calls)
        assert all(length <= CHUNK_BYTES for _, length, _ in calls)
        assert sum(length for _, length, _ in calls) == size == job.faulted_bytes
        assert [address for address, _, _ in calls] == [4096 + i * CHUNK_BYTES for i in range(len(calls))]
        assert job.complete


def test_a_refusal_stops_and_is_recorded():
    job = Prefault((0, 3 * CHUNK_BYTES))
    answers = iter([0, -1, 0])
    fault_in(job, lambda *_: next(answers))
    assert job.faulted_bytes == CHUNK_BYTES and job.error is not None and not job.complete and job.done.is_set()


def test_a_cancelled_fault_in_stops_between_chunks():
    job = Prefault((0, 3 * CHUNK_BYTES))
    calls = []
    job.cancelled.set()
    fault_in(job, lambda *args: calls.append(args) or 0)
    assert calls == [] and job.done.is_set() and not job.complete


def test_faulting_in_keeps_what_the_memory_holds():
    """MADV_POPULATE_WRITE on this kernel: pages written before keep their bytes, the rest read zero."""
    size = 4 * mmap.PAGESIZE
    memory = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    memory[: mmap.PAGESIZE] = b"\x5a" * mmap.PAGESIZE
    address = ctypes.addressof(ctypes.c_char.from_buffer(memory))
    job = Prefault((address, address + size))
    fault_in(job)
    assert job.complete, job.error
    assert memory[: mmap.PAGESIZE] == b"\x5a" * mmap.PAGESIZE and memory[mmap.PAGESIZE :] == bytes(size - mmap.PAGESIZE)
