"""How long the scheduler waits for lookups: never longer than a hit could save.

A lookup is answered on a background thread; until it answers, its request is not scheduled. Three
bounds keep that wait worth it:

- each request's own bound (``request_wait_s``): the prefill its best possible hit would save, as the
  engine's cost model predicts it (a 100-token prompt is not worth a second's wait; a 30k-token one
  may be), never below ``WAIT_FLOOR_S`` (a healthy lookup with the steps around it) nor past
  ``lookup_timeout_s``. A lookup past its bound is a miss (``lookups.LookupAbandoned``), reported to
  the breaker as a slow store;
- while the breaker is open (the store failed, or answered slowly: ``breaker``), no lookup is made at
  all: the request is a miss at once (``bypassed``);
- each step's synchronous wait (``settle``): a lookup answered within the step saves its request a
  step; the step waits at most ``SYNC_LOOKUP_BUDGET_S`` for it in all (``IDLE_LOOKUP_BUDGET_S`` after an
  idle spell, when no stream is running to be delayed).

Thread-safety: the engine thread only (the scheduler side's hooks).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from .breaker import CircuitBreaker
from .lookups import LookupBatcher, Outcome
from .profit import CostModel

# How long one scheduling step may wait for lookups, in all: a lookup answered within the step saves
# its request a step (benchmarks/compare-peers: the steps a hit waited made kvtool's TTFT the slowest).
SYNC_LOOKUP_BUDGET_S = 0.002
# The same after a step that computed nothing, or after the engine sat idle: no stream is running to be
# delayed, and the engine would only spin empty steps, each holding the GIL the lookup's thread needs.
IDLE_LOOKUP_BUDGET_S = 0.010
IDLE_AFTER_S = 0.050  # no step built for this long: the engine waited for requests
# A request's bound is never shorter. An idle loopback store answers an existence query in 0.1-2 ms, but
# a lookup is up to five calls (existence queries, pointer reads, their targets' check) and its hashing,
# handed between threads that wait for the GIL behind a busy engine's steps: on the 2-core CI machine
# healthy lookups took 20-25 ms, and on a hybrid pair prefilling in 64-token chunks over 150 ms. A
# slow store is caught per call (``slow_call_ms``) well before this; the bound is for long waits only.
# An answer that arrived is always taken, however late the scheduler polls.
WAIT_FLOOR_S = 1.0


class LookupPacing:
    """The scheduler side's waits for lookups (see the module's doc)."""

    def __init__(
        self,
        model: CostModel,
        breaker: CircuitBreaker | None,
        timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
    ):
        self._model = model
        self._breaker = breaker
        self._timeout_s = timeout_s
        self._clock = clock
        self._step_wait_left = SYNC_LOOKUP_BUDGET_S
        self._last_build_s = 0.0

    def request_wait_s(self, gain_tokens: int) -> float:
        """How long a request that could gain at most ``gain_tokens`` may wait for its lookup."""
        if not self._model.ready:
            return self._timeout_s  # nothing measured yet: the time-out (the breaker still counts slow calls)
        return min(self._timeout_s, max(WAIT_FLOOR_S, self._model.prefill_s(gain_tokens)))

    def bypassed(self) -> bool:
        """The store is failing or slow (the breaker is open): a request is a miss with no lookup."""
        return self._breaker is not None and self._breaker.is_open

    def settle(self, lookups: LookupBatcher, req_id: str) -> Outcome | None:
        """Wait for a lookup within what is left of this step's budget: on a healthy store it answers
        in about a millisecond, and the request is scheduled in this step instead of the next."""
        now = self._clock()
        if now - self._last_build_s > IDLE_AFTER_S:
            self._step_wait_left = max(self._step_wait_left, IDLE_LOOKUP_BUDGET_S)
            self._last_build_s = now  # once per idle spell
        if self._step_wait_left <= 0 or self.bypassed():
            return None
        self._step_wait_left -= lookups.settle(self._step_wait_left)
        return lookups.poll(req_id)

    def step_built(self, step_tokens: int) -> None:
        """A step was built: the next one's budget (a step that computed nothing is an idle one)."""
        self._step_wait_left = IDLE_LOOKUP_BUDGET_S if step_tokens == 0 else SYNC_LOOKUP_BUDGET_S
        self._last_build_s = self._clock()
