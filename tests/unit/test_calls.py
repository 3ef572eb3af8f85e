"""``connector.calls``: store calls on a bounded set of daemon threads."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest

from connector.calls import BoundedCalls, StoreError

STUCK_AT_EXIT = """
import threading
from connector.calls import BoundedCalls
calls = BoundedCalls("stuck", limit=2)
started = threading.Event()
calls.submit(lambda: (started.set(), threading.Event().wait()), "a call the store never answers")
started.wait()
print("submitted", flush=True)
"""


def test_a_call_stuck_in_the_store_does_not_hold_the_process_exit():
    """A frozen store's call never returns; the engine must still be able to exit (the threads of a
    ``ThreadPoolExecutor`` are joined at interpreter exit, which waited for it forever)."""
    done = subprocess.run([sys.executable, "-c", STUCK_AT_EXIT], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "submitted"


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


def test_a_call_never_waits_behind_a_stuck_one_and_threads_stay_within_the_limit():
    release = threading.Event()
    calls = BoundedCalls("bounded", limit=3)
    try:
        stuck = [calls.submit(release.wait, "stuck") for _ in range(2)]
        # Many quick calls one after another: each runs on the one thread the stuck calls leave.
        for value in range(200):
            assert calls.call(lambda v=value: v, 5.0, "quick") == value
        names = {t.name for t in threading.enumerate() if t.name.startswith("bounded_")}
        assert len(names) == 3 and all(t.daemon for t in threading.enumerate() if t.name in names)
        release.set()
        assert all(future.result(timeout=5.0) for future in stuck)
    finally:
        release.set()
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


def test_shutdown_refuses_new_calls_and_ends_idle_threads():
    calls = BoundedCalls("closing", limit=2)
    assert calls.call(lambda: 1, 5.0, "a call") == 1
    calls.shutdown()
    with pytest.raises(StoreError, match="not started"):
        calls.submit(lambda: 2, "after shutdown")
    for _ in range(200):  # the idle thread takes its stop and ends (polled, no time asserted)
        if not any(t.name.startswith("closing_") for t in threading.enumerate()):
            break
        time.sleep(0.01)
    assert not any(t.name.startswith("closing_") for t in threading.enumerate())


def test_a_call_whose_thread_cannot_start_is_refused_and_never_runs_later(monkeypatch):
    """The host refuses a thread (its thread limit, no memory): the call is a ``StoreError`` and nothing
    is left queued, since its caller gives the call's staging slots to another load at once."""
    release = threading.Event()
    calls = BoundedCalls("refused", limit=3)
    ran: list[str] = []
    try:
        stuck = calls.submit(release.wait, "holds the first thread")
        start = threading.Thread.start

        def refuse(self):
            if self.name.startswith("refused_"):
                raise RuntimeError("can't start new thread")
            start(self)

        monkeypatch.setattr(threading.Thread, "start", refuse)
        with pytest.raises(StoreError, match="not started"):
            calls.submit(lambda: ran.append("refused"), "a call with no thread")
        assert calls.in_flight == 1
        monkeypatch.setattr(threading.Thread, "start", start)
        # Later calls get threads of their own and run; the refused one never does.
        assert calls.call(lambda: ran.append("later") or 5, 5.0, "a later call") == 5
        release.set()
        assert stuck.result(timeout=5.0)
        assert calls.call(lambda: 6, 5.0, "one more") == 6
        assert ran == ["later"]
    finally:
        release.set()
        calls.shutdown()


def _submit_some(calls: BoundedCalls, futures: list, count: int = 20) -> None:
    for _ in range(count):
        try:
            futures.append(calls.submit(lambda: 1, "a call"))
        except StoreError:  # refused (every slot taken, or shut down)
            pass


def test_no_call_is_lost_to_a_shutdown_racing_its_submit():
    """``shutdown`` while callers submit: each call either is refused or runs; none waits forever."""
    for _ in range(50):
        calls, futures = BoundedCalls("racing", limit=2), []
        thread = threading.Thread(target=_submit_some, args=(calls, futures))
        thread.start()
        calls.shutdown()
        thread.join()
        assert all(future.result(timeout=5.0) == 1 for future in futures)


def test_a_dropped_pool_ends_its_idle_threads():
    """A client whose set-up failed drops its calls without shutting them down: a try every minute must
    not leave a thread each."""
    import gc

    calls = BoundedCalls("dropped", limit=2)
    assert calls.call(lambda: 1, 5.0, "a call") == 1
    del calls
    gc.collect()
    for _ in range(200):  # polled, no time asserted
        if not any(t.name.startswith("dropped_") for t in threading.enumerate()):
            break
        time.sleep(0.01)
    assert not any(t.name.startswith("dropped_") for t in threading.enumerate())
