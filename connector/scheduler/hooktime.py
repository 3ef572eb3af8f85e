"""Time the connector spends on the engine's own thread, per hook: what a store problem must never
raise (DESIGN.md invariant 6). Every hook vLLM calls between forward passes is wrapped; the totals
are connector stats (``engine_thread_us``, ``engine_thread_calls``, and ``engine_thread_slow_calls``
for calls over SLOW_CALL_S), so a benchmark reads them from the engine's /metrics beside its
inter-token latency."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any, TypeVar

from ..counters import Counters

F = TypeVar("F", bound=Callable[..., Any])

SLOW_CALL_S = 0.02  # a fifth of a 100 ms decode step: a call this long shows in a stream's pace


class HookClock:
    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self._clock = clock
        self.stats = Counters()

    def take(self) -> dict[str, int]:
        return self.stats.take()


def on_engine_thread(method: F) -> F:
    """Count the wrapped connector method's time against its instance's ``_hook_clock``."""

    @functools.wraps(method)
    def timed(self, *args: Any, **kwargs: Any) -> Any:
        clock: HookClock = self._hook_clock
        started = clock._clock()
        try:
            return method(self, *args, **kwargs)
        finally:
            spent = clock._clock() - started
            clock.stats.add("engine_thread_us", int(spent * 1e6))
            clock.stats.add("engine_thread_calls")
            if spent > SLOW_CALL_S:
                clock.stats.add("engine_thread_slow_calls")

    return timed  # type: ignore[return-value]
