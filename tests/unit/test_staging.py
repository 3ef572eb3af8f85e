"""Staging areas: slots handed out in leases, back only when every holder has released them."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from connector.store.staging import SLOT_ALIGN, StagingArea


def test_slots_are_aligned_disjoint_and_come_back_on_release():
    area = StagingArea("t", 100, 3)
    assert area.slot_bytes % SLOT_ALIGN == 0 and area.slot_bytes >= 100
    lease = area.take(2)
    first, second = lease.region(0), lease.region(1)
    assert abs(first.address - second.address) >= area.slot_bytes
    assert (first.address - area.address) % SLOT_ALIGN == 0
    assert area.take(2) is None  # one slot is free, two are asked
    assert len(area.take(2, partial=True)) == 1  # a save keeps what fits
    assert area.take(1) is None and area.take(1, partial=True) is None
    lease.release()
    lease.release()  # a second release by the same holder changes nothing
    assert area.free_slots == 2


def test_a_held_lease_stays_out_until_its_last_holder_releases_it():
    area = StagingArea("t", 64, 1)
    lease = area.take(1)
    lease.hold()  # a store call that may outlive its caller
    lease.release()  # the caller gave up
    assert area.free_slots == 0 and not lease.released
    lease.release()  # the call returned
    assert area.free_slots == 1 and lease.released
    with pytest.raises(RuntimeError):
        lease.hold()


def test_a_region_never_reaches_past_its_slot():
    area = StagingArea("t", 64, 2)
    lease = area.take(1)
    assert len(lease.region(0, 10).view) == 10
    with pytest.raises(ValueError):
        lease.region(0, area.slot_bytes + 1)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(min_value=1, max_value=4), min_size=1, max_size=20))
def test_leases_never_share_a_slot_and_all_come_back(counts):
    area = StagingArea("t", 64, 8)
    held, addresses = [], set()

    def give_back_oldest():
        old = held.pop(0)
        addresses.difference_update(old.region(i).address for i in range(len(old)))
        old.release()

    for count in counts:
        lease = area.take(count)
        if lease is None:
            assert area.free_slots < count
            if held:
                give_back_oldest()
            continue
        mine = {lease.region(i).address for i in range(len(lease))}
        assert not mine & addresses and len(mine) == count
        addresses |= mine
        held.append(lease)
        assert area.free_slots == 8 - len(addresses)
        if len(held) > 2:
            give_back_oldest()
    while held:
        give_back_oldest()
    assert area.free_slots == 8
