"""One counters type for every component, and warnings said once."""

import logging
import threading

from connector.counters import Counters, WarnOnce


def test_counts_add_up_across_threads_and_take_starts_again_from_zero():
    counters = Counters()

    def count() -> None:
        for _ in range(1000):
            counters.add("lookups")
            counters.add("bytes_saved", 3)

    threads = [threading.Thread(target=count) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert counters["lookups"] == 4000 and counters.get("missing") == 0
    assert counters.take() == {"lookups": 4000, "bytes_saved": 12000}
    assert counters.take() == {}


def test_a_warning_is_said_once_per_topic(caplog):
    warn = WarnOnce(logging.getLogger("kvtool-test"))
    with caplog.at_level(logging.WARNING, logger="kvtool-test"):
        for _ in range(3):
            warn("put", "put failed")
        warn("lookup", "lookup failed")
    assert [record.getMessage() for record in caplog.records] == ["put failed", "lookup failed"]
