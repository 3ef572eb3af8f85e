"""Store calls are counted by wrapping the store interface, and the wrapped store's counts come along."""

from connector.store.instrumented import InstrumentedStore
from connector.store.store import PutOutcome


class Backend:
    def __init__(self):
        self.stats_taken = 0

    def exists(self, keys):
        return [False] * len(keys)

    def put_many(self, items, replace=False):
        return PutOutcome.STORED

    def get(self, keys, object_bytes=0):
        raise RuntimeError("down")

    def take_stats(self):
        self.stats_taken += 1
        return {"breaker_opened": 1}


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        self.now += 0.001  # each reading a millisecond later
        return self.now


def test_every_call_is_counted_with_its_items_and_time_even_when_it_fails():
    backend = Backend()
    store = InstrumentedStore(backend, clock=Clock())
    assert store.exists(["a", "b", "c"]) == [False] * 3
    assert store.put_many([("k", b"v"), ("l", b"w")]) is PutOutcome.STORED
    try:
        store.get(["x"])
    except RuntimeError:
        pass
    assert store.take_stats() == {
        "store_calls_exists": 1,
        "store_items_exists": 3,
        "store_call_us_exists": 1000,
        "store_calls_put": 1,
        "store_items_put": 2,
        "store_call_us_put": 1000,
        "store_calls_get": 1,
        "store_items_get": 1,
        "store_call_us_get": 1000,
        "breaker_opened": 1,
    }
    assert store.take_stats() == {"breaker_opened": 1} and backend.stats_taken == 2
