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
  step. What a step may wait for lookups in all is set from the engine's measured step length
  (``step_budget_s``): ``STEP_WAIT_SHARE`` of it, between ``SYNC_LOOKUP_BUDGET_S`` and
  ``MAX_STEP_WAIT_S``. Waiting costs the step's running streams that share of a step, once; not
  waiting costs each unanswered new request a whole step. So a GPU engine's 30 ms steps wait the 2 ms
  floor, and a CPU engine's two-second prefill steps wait long enough for a burst of new requests
  (each a store round trip) to be answered in the step that first sees them. A step after one that
  computed nothing waits at least ``IDLE_LOOKUP_BUDGET_S``, and the first after an idle spell (nothing
  running to be delayed but the burst of new requests itself) ``IDLE_SPELL_BUDGET_S``.

A lookup given up on is judged (``late``): the store is bypassed for it only when a store call was
what it waited on; a lookup late because the engine's threads were busy is a miss that keeps the store.

Thread-safety: the engine thread only (the scheduler side's hooks).
"""

from __future__ import annotations

import logging
import statistics
import time
from collections import deque
from collections.abc import Callable

from ..store.breaker import CircuitBreaker, report_slow
from ..counters import Counters, WarnOnce
from .lookups import LookupBatcher, Outcome
from ..core.profit import CostModel

logger = logging.getLogger("vllm.kvtool")

# How long one scheduling step may wait for lookups, in all: a lookup answered within the step saves
# its request a step (benchmarks/compare-peers: the steps a hit waited made kvtool's TTFT the slowest).
SYNC_LOOKUP_BUDGET_S = 0.002
# The same after a step that computed nothing: no stream is running to be delayed, and the engine would
# only spin empty steps, each holding the GIL the lookup's thread needs.
IDLE_LOOKUP_BUDGET_S = 0.010
# After the engine sat idle (it waited for requests): nothing runs to be delayed but the new requests
# themselves, and a burst of them (each a round trip, one after another) answered in this step is
# prefilled in it, not a whole step later. Spent only while lookups are out: a step goes on as soon as
# they have answered.
IDLE_SPELL_BUDGET_S = 0.050
IDLE_AFTER_S = 0.050  # no step built for this long (beyond the step running): the engine waited for requests
# A busy step waits for lookups at most this share of the engine's measured step length (the streams it
# runs are delayed by that, once), never past ``MAX_STEP_WAIT_S``.
STEP_WAIT_SHARE = 0.02
MAX_STEP_WAIT_S = 0.050
# The step length is the median of the last busy steps (build to build): robust to the odd gap where the
# engine finished every request in a step and sat idle before the next build.
STEP_SAMPLES = 15
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
        *,
        stats: Counters | None = None,
        slow_call_s: float = 0.15,
    ):
        self._stats = stats if stats is not None else Counters()
        self._slow_call_s = slow_call_s
        self._warn_once = WarnOnce(logger)
        self._model = model
        self._breaker = breaker
        self._timeout_s = timeout_s
        self._clock = clock
        self._step_wait_left = SYNC_LOOKUP_BUDGET_S
        self._last_build_s = 0.0
        self._busy_since: float | None = None  # when the last step that computed something was built
        self._steps: deque[float] = deque(maxlen=STEP_SAMPLES)  # busy steps' lengths, build to build
        self.step_s: float | None = None  # their median

    def request_wait_s(self, gain_tokens: int) -> float:
        """How long a request that could gain at most ``gain_tokens`` may wait for its lookup."""
        if not self._model.ready:
            return self._timeout_s  # nothing measured yet: the time-out (the breaker still counts slow calls)
        return min(self._timeout_s, max(WAIT_FLOOR_S, self._model.prefill_s(gain_tokens)))

    def bypassed(self) -> bool:
        """The store is failing or slow (the breaker is open): a request is a miss with no lookup."""
        return self._breaker is not None and self._breaker.is_open

    def late(self, why: str, store_s: float) -> None:
        """A lookup given up on (its bound or the time-out passed): a miss either way. The breaker hears
        of a slow store only when a store call has been out at least ``slow_call_s``; otherwise this
        engine's own threads were too busy to run the lookup (a CPU engine's forward pass holds the
        cores), and bypassing a healthy store would only cost the next requests their hits."""
        if store_s >= self._slow_call_s:
            if self._breaker is not None:
                report_slow(self._breaker, self._stats, "scheduler", "lookup", why)
            return
        self._stats.add("lookups_late_busy")
        self._warn_once(
            "late-busy",
            f"kvtool: a lookup was given up on ({why}) while no store call was slow: the engine's threads "
            "were too busy to run it; a miss, and the store stays in use",
        )

    def settle(self, lookups: LookupBatcher, req_id: str) -> Outcome | None:
        """Wait for a lookup within what is left of this step's budget: on a healthy store it answers
        in about a millisecond, and the request is scheduled in this step instead of the next."""
        now = self._clock()
        if now - self._last_build_s > IDLE_AFTER_S + self._running_step_s():
            self._step_wait_left = max(self._step_wait_left, IDLE_SPELL_BUDGET_S, self.step_budget_s())
            self._last_build_s = now  # once per idle spell
        if self._step_wait_left <= 0 or self.bypassed():
            return None
        self._step_wait_left -= lookups.settle(self._step_wait_left)
        return lookups.poll(req_id)

    def step_budget_s(self) -> float:
        """What a busy step may wait for lookups in all: a share of the measured step length."""
        if self.step_s is None:
            return SYNC_LOOKUP_BUDGET_S
        return min(MAX_STEP_WAIT_S, max(SYNC_LOOKUP_BUDGET_S, STEP_WAIT_SHARE * self.step_s))

    def _running_step_s(self) -> float:
        """How long the step built last is expected to run (0 when it computed nothing)."""
        return (self.step_s or 0.0) if self._busy_since is not None else 0.0

    def step_built(self, step_tokens: int) -> None:
        """A step was built: the last busy step's length is measured (from its build to this one's), and
        the next step's budget set (a step that computed nothing is an idle one)."""
        now = self._clock()
        if self._busy_since is not None:
            self._steps.append(now - self._busy_since)
            self.step_s = statistics.median(self._steps)
        self._busy_since = now if step_tokens > 0 else None
        budget = self.step_budget_s()
        self._step_wait_left = max(IDLE_LOOKUP_BUDGET_S, budget) if step_tokens == 0 else budget
        self._last_build_s = now
