"""A batch that names a key twice, through the store stack, against a real mooncake_master: the client
(0.3.13.post1) answers all but one slot of a repeated key with other bytes, reported as read in full;
the stack (``uniquekeys.UniqueKeysStore``) asks it each key once."""

import os

import pytest

from connector.store.staging import StagingArea

pytestmark = pytest.mark.integration


def test_a_batch_naming_a_key_twice_answers_every_slot_with_its_bytes(store):
    first, second = (f"kvtool-test/repeat/{name}/{os.urandom(8).hex()}" for name in ("a", "b"))
    values = {first: os.urandom(5000), second: os.urandom(3000)}
    for key, value in values.items():
        store.put(key, value)
    keys = [first, second, first, first]
    assert store.exists(keys) == [True] * 4
    assert store.get(keys) == [values[key] for key in keys]
    area = StagingArea("load", 8192, len(keys))
    store.register(area.address, area.nbytes)
    lease = area.take(len(keys))
    regions = [lease.region(index) for index in range(len(keys))]
    for region in regions:
        region.view[:] = b"\x07" * len(region.view)  # what the client leaves in a slot it skips
    counts = store.get_into(keys, regions, lease)
    assert counts == [len(values[key]) for key in keys]
    read = [bytes(region.view[:count]) for region, count in zip(regions, counts, strict=True)]
    assert read == [values[key] for key in keys]
