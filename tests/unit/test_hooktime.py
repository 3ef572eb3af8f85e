"""The connector's time on the engine's thread is counted per hook call, slow calls apart."""

from __future__ import annotations

from connector.scheduler.hooktime import SLOW_CALL_S, HookClock, on_engine_thread


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


class Facade:
    def __init__(self, clock):
        self._hook_clock = HookClock(clock)
        self.clock = clock

    @on_engine_thread
    def hook(self, spent: float) -> str:
        self.clock.now += spent
        return "answer"

    @on_engine_thread
    def failing(self) -> None:
        self.clock.now += 2 * SLOW_CALL_S
        raise RuntimeError("boom")


def test_calls_their_time_and_slow_calls_are_counted_even_when_the_hook_raises():
    facade = Facade(Clock())
    assert facade.hook(0.001) == "answer"
    facade.hook(SLOW_CALL_S * 1.5)
    try:
        facade.failing()
    except RuntimeError:
        pass
    taken = facade._hook_clock.take()
    assert taken["engine_thread_calls"] == 3
    assert taken["engine_thread_slow_calls"] == 2
    assert abs(taken["engine_thread_us"] - int((0.001 + 3.5 * SLOW_CALL_S) * 1e6)) <= 3
    assert facade._hook_clock.take() == {}
