"""The segment an engine lends the store is faulted in at start-up, and what it holds is kept."""

from __future__ import annotations

import os

from connector.store.mooncake import MooncakeStore


def resident_bytes(region: tuple[int, int]) -> int:
    """Bytes of the region this process has in memory (/proc/self/smaps, the mappings inside it)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                start, end = (int(part, 16) for part in head.split("-"))
                inside = region[0] <= start and end <= region[1]
            elif inside and head == "Rss:":
                total += int(line.split()[1]) * 1024
    return total


def test_the_lent_segment_is_faulted_in_and_keeps_what_is_stored(store_config):
    store = MooncakeStore(store_config)
    try:
        job = store.prefault
        assert job is not None, "the segment's mapping was not found"
        start, end = job.region
        assert end - start >= store_config.backend.global_segment_size
        values = {f"prefault/{i}": os.urandom(300_000) for i in range(8)}  # put while it may still run
        for key, value in values.items():
            assert store.put(key, value).value == "stored"
        assert job.done.wait(60) and job.complete, job.error
        assert resident_bytes(job.region) >= store_config.backend.global_segment_size
        assert store.get(list(values)) == list(values.values())
    finally:
        store.close()


def test_nothing_is_faulted_in_when_turned_off_or_nothing_is_lent(store_config):
    for changes in ({"prefault_segment": False}, {"global_segment_size": 0}):
        store = MooncakeStore(store_config.with_backend(**changes))
        try:
            assert store.prefault is None
        finally:
            store.close()
