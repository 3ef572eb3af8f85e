"""What a scheduling step waits for lookups is set from the engine's measured step length (issue 38):
waiting costs the step's running streams a share of one step, not waiting costs each new request a
whole step. A GPU engine's short steps keep the 2 ms floor; a CPU engine's long prefill steps wait long
enough for a burst of new requests to be answered in the step that first sees them."""

from __future__ import annotations

from connector.scheduler.lookupwait import (
    IDLE_LOOKUP_BUDGET_S,
    IDLE_SPELL_BUDGET_S,
    MAX_STEP_WAIT_S,
    STEP_WAIT_SHARE,
    SYNC_LOOKUP_BUDGET_S,
    LookupPacing,
)
from connector.core.profit import CostModel

from .test_slow_store import Clock


class Lookups:
    """Records what each ``settle`` was allowed to wait, and spends ``spend_s`` of it."""

    def __init__(self, clock: Clock, spend_s: float = 0.0):
        self.clock, self.spend_s, self.budgets = clock, spend_s, []

    def settle(self, budget_s: float) -> float:
        self.budgets.append(budget_s)
        took = min(budget_s, self.spend_s)
        self.clock.now += took
        return took

    def poll(self, req_id: str):
        return None


def busy_steps(pacing: LookupPacing, clock: Clock, lengths: list[float]) -> None:
    for length in lengths:
        pacing.step_built(512)
        clock.now += length
    pacing.step_built(512)


def test_a_fresh_engine_waits_the_floor():
    assert LookupPacing(CostModel(), None, 2.0).step_budget_s() == SYNC_LOOKUP_BUDGET_S


def test_the_budget_is_a_share_of_the_measured_step_between_the_floor_and_the_cap():
    for step_s, budget_s in ((0.03, SYNC_LOOKUP_BUDGET_S), (2.0, STEP_WAIT_SHARE * 2.0), (10.0, MAX_STEP_WAIT_S)):
        clock = Clock()
        pacing = LookupPacing(CostModel(), None, 2.0, clock=clock)
        busy_steps(pacing, clock, [step_s] * 5)
        assert abs(pacing.step_budget_s() - budget_s) < 1e-9, step_s


def test_an_idle_gap_between_two_builds_is_not_taken_for_a_step():
    clock = Clock()
    pacing = LookupPacing(CostModel(), None, 2.0, clock=clock)
    busy_steps(pacing, clock, [0.03] * 6 + [30.0] + [0.03] * 2)  # every request ended, then 30 s idle
    assert pacing.step_budget_s() == SYNC_LOOKUP_BUDGET_S


def test_a_long_forward_pass_gets_the_step_budget_and_an_idle_engine_at_least_the_idle_one():
    clock = Clock()
    pacing = LookupPacing(CostModel(), None, 2.0, clock=clock)
    busy_steps(pacing, clock, [2.0] * 3)  # a CPU engine's prefill steps
    lookups = Lookups(clock, spend_s=0.001)
    clock.now += 2.0  # the step just built runs: the scheduler is called again after it
    pacing.settle(lookups, "a")
    pacing.settle(lookups, "b")
    assert abs(lookups.budgets[0] - STEP_WAIT_SHARE * 2.0) < 1e-9
    assert abs(lookups.budgets[1] - (STEP_WAIT_SHARE * 2.0 - 0.001)) < 1e-9  # one budget for the step, in all

    pacing.step_built(0)  # a step that computed nothing: nothing runs to be delayed
    pacing.settle(lookups, "c")
    assert lookups.budgets[2] == max(IDLE_LOOKUP_BUDGET_S, STEP_WAIT_SHARE * 2.0)

    clock.now += 5.0  # the engine sat idle; then a burst of new requests
    pacing.settle(lookups, "d")
    assert lookups.budgets[3] == IDLE_SPELL_BUDGET_S


def test_a_burst_after_an_idle_spell_waits_for_all_of_its_lookups_in_one_step():
    """16 new requests at an idle engine, each lookup a 2 ms round trip after the one before: all of
    them are answered within the first step's wait."""
    clock = Clock()
    pacing = LookupPacing(CostModel(), None, 2.0, clock=clock)
    busy_steps(pacing, clock, [0.3] * 3)
    clock.now += 10.0
    lookups = Lookups(clock, spend_s=0.002)
    for number in range(16):
        pacing.settle(lookups, str(number))
    assert len(lookups.budgets) == 16 and lookups.budgets[-1] > 0


def test_a_short_step_keeps_streams_almost_undelayed():
    """A GPU-like engine: 30 ms steps, so a step waits 2 ms for lookups, and no more once it is spent."""
    clock = Clock()
    pacing = LookupPacing(CostModel(), None, 2.0, clock=clock)
    busy_steps(pacing, clock, [0.03] * 4)
    lookups = Lookups(clock, spend_s=0.01)  # a lookup that would take 10 ms
    clock.now += 0.03
    pacing.settle(lookups, "a")
    pacing.settle(lookups, "b")
    assert lookups.budgets == [SYNC_LOOKUP_BUDGET_S]  # spent: the second request does not wait
