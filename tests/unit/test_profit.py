"""The cost model: fitted from the engine's measurements, it drops loads that cost more than they save."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from connector.core.keys import KeyKind
from connector.core.refs import LoadPlan, ObjectRef
from connector.core.profit import MIN_SAMPLES, PRIOR_SECONDS_PER_BYTE, CostModel, LinearFit, judge

BLOCK_BYTES = 1_000_000


def ref(block: int, kind: KeyKind = KeyKind.BLOCK, end: int | None = None) -> ObjectRef:
    return ObjectRef(f"k{block}{kind.value}", 0, kind, block, block * 32, end or (block + 1) * 32, bytes(16))


def plan(local: int, external: int, refs: list[ObjectRef]) -> LoadPlan:
    return LoadPlan(local, external, 0, 0, tuple(refs))


def model(load_fixed_s: float, mb_per_s: float, prefill_s_per_token: float) -> CostModel:
    m = CostModel()
    transfer = [(n * BLOCK_BYTES, n * BLOCK_BYTES / (mb_per_s * 1e6)) for n in range(1, MIN_SAMPLES + 2)]
    loads = [(nbytes, seconds, seconds + load_fixed_s) for nbytes, seconds in transfer]
    steps = [(t, 0.002 + t * prefill_s_per_token) for t in (1, 8, 64, 256, 512)]
    m.observe(loads, steps)
    return m


def size(_ref: ObjectRef) -> int:
    return BLOCK_BYTES


@settings(max_examples=60, deadline=None)
@given(
    st.floats(min_value=0, max_value=0.1),
    st.floats(min_value=1e-9, max_value=1e-3),
    st.lists(st.integers(min_value=1, max_value=1 << 30), min_size=2, max_size=12, unique=True),
)
def test_a_fit_recovers_the_line_it_was_fed(intercept, slope, xs):
    fit = LinearFit()
    for x in xs:
        fit.add(x, intercept + slope * x)
    if fit.fit() is None:
        # Samples whose x hardly vary (weighted spread within a tenth of their mean, as the fit
        # defines it) do not determine a slope: the line is their mean, flat.
        assert fit.line() == (fit.mean()[1], 0.0)
        return
    got_intercept, got_slope = fit.line()
    assert abs(got_slope - slope) <= 1e-6 * slope + 1e-12
    assert abs(got_intercept - intercept) <= 1e-6 + 1e-6 * intercept + slope * max(xs) * 1e-6


@pytest.mark.parametrize("xs", [[1, 2], [100, 150, 400], [14075696, 28151392], list(range(1, 13))])
def test_samples_that_vary_are_fitted(xs):
    fit = LinearFit()
    for x in xs:
        fit.add(x, 0.5 + 2e-4 * x)
    intercept, slope = fit.fit()
    assert abs(slope - 2e-4) < 1e-10 and abs(intercept - 0.5) < 1e-6


def test_the_case_hypothesis_found_is_flat_not_a_wrong_slope():
    """Two samples 22% apart, the older one decayed: their weighted spread is right at the fit's floor."""
    fit = LinearFit()
    for x in (14075696, 17213695):
        fit.add(x, 0.0002738852103605755 * x)
    assert fit.fit() is None and fit.line() == (fit.mean()[1], 0.0)


def test_every_hit_is_taken_until_the_model_has_seen_enough():
    m = CostModel()
    m.observe([(BLOCK_BYTES, 10.0, 12.0)] * (MIN_SAMPLES - 1), [(64, 0.001)] * 10)
    whole = plan(0, 5, [ref(0, KeyKind.TAIL, 5)])
    assert judge(whole, None, size, m).plan is whole


def test_a_load_that_costs_more_than_its_prefill_is_not_taken():
    m = model(load_fixed_s=0.020, mb_per_s=1000, prefill_s_per_token=1e-5)  # GPU-like prefill
    verdict = judge(plan(0, 40, [ref(0), ref(1, KeyKind.TAIL, 40)]), None, size, m)
    assert verdict.skipped == "unprofitable" and verdict.plan.external_tokens == 0 and not verdict.plan.objects
    assert "ms" in verdict.detail


def test_a_partial_block_that_costs_more_than_its_tokens_is_trimmed_and_the_blocks_are_kept():
    m = model(load_fixed_s=0.001, mb_per_s=1000, prefill_s_per_token=2e-4)  # a block's load ~1 ms
    blocks = [ref(i) for i in range(4)]
    whole = plan(0, 130, [*blocks, ref(4, KeyKind.TAIL, 130)])  # 2 tokens of a 5th block cost 1 ms to load
    trimmed = plan(0, 128, blocks)
    verdict = judge(whole, trimmed, size, m)
    assert verdict.skipped == "trimmed" and verdict.plan is trimmed


def test_a_profitable_hit_is_taken_whole():
    m = model(load_fixed_s=0.001, mb_per_s=1000, prefill_s_per_token=2e-3)  # CPU-like prefill
    whole = plan(0, 130, [*(ref(i) for i in range(4)), ref(4, KeyKind.TAIL, 130)])
    verdict = judge(whole, plan(0, 128, [ref(i) for i in range(4)]), size, m)
    assert verdict.skipped is None and verdict.plan is whole


def test_the_model_describes_what_it_measured():
    described = model(load_fixed_s=0.004, mb_per_s=500, prefill_s_per_token=3e-4).describe()
    assert abs(described["load_fixed_ms"] - 4.0) < 0.01
    assert abs(described["load_mb_per_s"] - 500) < 1
    assert abs(described["prefill_us_per_token"] - 300) < 0.1


def test_loads_of_one_size_still_tell_the_wait_from_the_transfer():
    """A tiny model's loads are all one object: the wait beyond the transfer is a constant, not bytes."""
    m = CostModel()
    m.observe([(16_000, 0.0002, 0.004)] * 8, [(t, 0.001 + t * 6e-5) for t in (1, 8, 64, 256)])
    assert abs(m.load_s(16_000) - 0.004) < 1e-9
    # Ten times the bytes: one call's latency and one wait, ten objects' bytes at the prior rate.
    assert abs(m.load_s(160_000) - (0.004 + 144_000 * PRIOR_SECONDS_PER_BYTE)) < 1e-9


def test_forward_passes_of_one_size_cannot_price_a_token_so_every_hit_is_taken():
    m = CostModel()
    m.observe([(16_000, 0.0002, 0.004)] * 8, [(1, 0.003)] * 20)  # decode steps only
    assert not m.ready
    whole = plan(0, 5, [ref(0, KeyKind.TAIL, 5)])
    assert judge(whole, None, size, m).plan is whole


def test_the_schedulers_whole_delay_replaces_the_workers_wait_once_it_has_enough():
    """The worker's wait (step that starts a load to step that reports it) misses the scheduling around
    it; the scheduler's delay (lookup answered to request computed) is what a hit really costs."""
    m = model(load_fixed_s=0.0025, mb_per_s=1000, prefill_s_per_token=1e-3)
    small = 50_000  # a tail of a few tokens
    worker_view = m.load_s(small)
    assert abs(worker_view - (0.0025 + small / 1e9)) < 1e-6
    for _ in range(MIN_SAMPLES - 1):
        m.observe_delay(small, 0.007)
        assert m.load_s(small) == worker_view  # too few of the scheduler's to judge by
    m.observe_delay(small, 0.007)
    assert abs(m.load_s(small) - 0.007) < 1e-6
    assert abs(m.describe()["load_fixed_ms"] - (7.0 - small / 1e6)) < 0.01  # its transfer apart


def test_a_tail_of_a_few_tokens_is_declined_once_the_whole_delay_is_known():
    m = model(load_fixed_s=0.0025, mb_per_s=1000, prefill_s_per_token=1e-3)  # a CPU engine: 1 ms a token
    tail = plan(64, 3, [ref(2, KeyKind.TAIL, 67)])

    def tail_size(_ref: ObjectRef) -> int:
        return 40_000

    assert judge(tail, None, tail_size, m).skipped is None  # the worker's 2.5 ms: 3 tokens seem to pay
    for _ in range(MIN_SAMPLES):
        m.observe_delay(40_000, 0.007)
    assert judge(tail, None, tail_size, m).skipped == "unprofitable"
    eleven = plan(0, 11, [ref(0, KeyKind.TAIL, 11)])  # a sub-block prompt's 11 tokens still pay
    assert judge(eleven, None, tail_size, m).skipped is None


def test_only_a_request_whose_load_was_sent_tells_its_delay_once():
    from connector.core.profit import HitJudge
    from connector.core.timeline import Timeline

    judge_ = HitJudge((1000,))
    loaded = plan(0, 32, [ref(0)])
    miss = Timeline.start(10.0, 0, None)
    miss.mark("answered", 10.001, 0)
    judge_.request_computed(miss, None, 10.002)
    judge_.request_computed(miss, loaded, 10.002)  # no load went out for it
    assert judge_.model.delay.samples == 0
    hit = Timeline.start(20.0, 3, None)
    hit.mark("answered", 20.001, 3)
    hit.mark("load_sent", 20.002, 3)
    judge_.request_computed(hit, loaded, 20.009)
    assert judge_.model.delay.samples == 1 and abs(judge_.model.delay.value() - 0.008) < 1e-3
    hit.mark("computing", 20.009, 4)
    judge_.request_computed(hit, loaded, 20.500)  # scheduled again later (preempted): its first counts
    assert judge_.model.delay.samples == 1


def test_one_long_delay_does_not_make_every_load_look_dear():
    """A warm-up request that waited behind an 86 ms step (seen on this machine) among 6 ms ones."""
    m = model(load_fixed_s=0.0025, mb_per_s=1000, prefill_s_per_token=1e-3)
    for delay in (0.0065, 0.0864, 0.0049, 0.0053, 0.0049, 0.0057):
        m.observe_delay(40_000, delay)
    assert m.load_s(40_000) < 0.007
    eleven = plan(0, 11, [ref(0, KeyKind.TAIL, 11)])
    assert judge(eleven, None, lambda _ref: 40_000, m).skipped is None


def test_a_lookup_is_skipped_only_where_no_load_could_pay_and_one_in_explore_every_is_made():
    from connector.core.profit import EXPLORE_EVERY, HitJudge

    judge_ = HitJudge((1 << 20,))
    assert judge_.lookup_verdict(0).skipped == "the engine holds every token a hit could claim"
    assert judge_.lookup_verdict(3).skipped is None  # the model has seen nothing: every hit is taken
    judge_.model = model(0.005, 1000.0, 1e-4)  # a load costs at least 5 ms; a token's prefill 0.1 ms
    assert judge_.lookup_verdict(51).skipped is None  # 5.1 ms of prefill could pay
    for _ in range(2):  # the count starts again after each request looked up to explore
        verdicts = [judge_.lookup_verdict(49) for _ in range(EXPLORE_EVERY)]
        assert all(v.skipped.startswith("no hit could pay") and not v.explore for v in verdicts[:-1])
        assert verdicts[-1].skipped is None and verdicts[-1].explore
    assert HitJudge((1 << 20,), enabled=False).lookup_verdict(1).skipped is None


def test_a_request_looked_up_to_explore_takes_its_hit_and_leaves_the_declined_count_alone():
    from connector.core.profit import HitJudge
    from connector.core.prefix import PromptKeys, plan_load
    from connector.core.search import StoredPrefix

    judge_ = HitJudge((BLOCK_BYTES,))
    judge_.model = model(0.050, 1000.0, 1e-6)  # nothing pays
    keys = PromptKeys.build(list(range(40)), 32, 1, "ns", b"root")
    stored = StoredPrefix(32, 32, 32, frozenset({keys.block_ref(0).key}))
    whole = plan_load(keys, stored, 0)
    assert judge_(keys, stored, 0, whole).skipped == "unprofitable"
    assert judge_(keys, stored, 0, whole, explore=True).detail == "explored"
    assert judge_._declined == 1
