"""``connector.calls``: store calls on a bounded set of threads."""

from __future__ import annotations

import threading

import pytest

from connector.calls import BoundedCalls, StoreError


def test_results_and_exceptions_reach_the_caller():
    calls = BoundedCalls("test", limit=2)
    try:
        assert calls.call(lambda: 42, 5.0, "a call") == 42

        def fails():
            raise ValueError("the client library's error")

        with pytest.raises(StoreError, match="the client library's error"):
            calls.call(fails, 5.0, "a failing call")
        assert calls.submit(lambda: None, "one more").result(timeout=5.0) is None
    finally:
        calls.shutdown()


def test_concurrent_callers_each_get_their_own_answer():
    calls = BoundedCalls("many", limit=4)
    answers: dict[int, int] = {}

    def caller(number: int) -> None:
        for step in range(50):
            try:
                answers[number * 1000 + step] = calls.call(lambda s=step: number * s, 5.0, "a call")
            except StoreError:  # refused while the four slots are taken: a miss, never a wrong answer
                pass

    try:
        threads = [threading.Thread(target=caller, args=(n,)) for n in range(6)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert answers and all(value == (key // 1000) * (key % 1000) for key, value in answers.items())
    finally:
        calls.shutdown()
