"""Whether a hit pays for itself: a load's predicted time against the prefill it saves (pure).

A hit is loaded asynchronously: its request waits while the load runs, then is scheduled. Taking it is
worth it when that wait is shorter than the prefill of the tokens it saves. Both sides are fitted from
the engine's own measurements, sent by the worker with each step's metadata: every load's bytes, its
transfer time, and its request's whole wait (from the step that started it to the step that reported
it: the transfer plus the steps it spans), and every forward pass's scheduled tokens and duration. A
load is predicted as the wait beyond its transfer (an average) plus a transfer fitted against bytes.
A model that has not seen enough of either yet takes every hit.

The choice is between the whole hit, the hit trimmed to its last full block (the partial block's
object dropped: loading a whole block to save a few tokens can cost more than it saves), and no load
at all; the one that saves the most time wins, and none is taken that saves nothing.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from .keys import KeyKind
from .objects import HEADER_SIZE
from .prefix import PromptKeys, plan_load
from .refs import LoadPlan, ObjectRef, StoredPrefix

if TYPE_CHECKING:
    from .timeline import Timeline

DESCRIBE_EVERY_S = 300.0
EXPLORE_EVERY = 16  # one declined hit in this many is taken anyway, so that loads keep being measured
MIN_SAMPLES = 4  # of each kind, before the model judges anything
DECAY = 0.95  # weight of the older samples at each new one: the fit follows the engine's load
RECENT_DELAYS = 32  # loaded requests' delays the median is taken over
# A store's transfer rate when every load seen had one size (so a per-call latency and a rate cannot be
# told apart): Mooncake over TCP loopback, zero-copy (ENVIRONMENT.md: about 1.2 GB/s). The rest of
# those loads' time is taken as a per-call latency.
PRIOR_SECONDS_PER_BYTE = 1 / 1.2e9


class LinearFit:
    """``y = intercept + slope * x``, least squares over the samples with exponential forgetting."""

    def __init__(self, decay: float = DECAY):
        self._decay = decay
        self._n = self._x = self._y = self._xx = self._xy = 0.0
        self.samples = 0

    def add(self, x: float, y: float) -> None:
        d = self._decay
        self._n = self._n * d + 1.0
        self._x = self._x * d + x
        self._y = self._y * d + y
        self._xx = self._xx * d + x * x
        self._xy = self._xy * d + x * y
        self.samples += 1

    @property
    def ready(self) -> bool:
        return self.samples >= MIN_SAMPLES

    def mean(self) -> tuple[float, float]:
        return (self._x / self._n, self._y / self._n) if self._n else (0.0, 0.0)

    def fit(self) -> tuple[float, float] | None:
        """(intercept, slope), or None where the samples do not determine them: their x hardly vary,
        or the slope comes out negative (noise). A negative intercept is clamped to 0."""
        if self._n == 0:
            return None
        mean_x, mean_y = self.mean()
        var_x = self._xx / self._n - mean_x * mean_x
        if var_x <= 0.01 * mean_x * mean_x or var_x <= 0:
            return None
        slope = (self._xy / self._n - mean_x * mean_y) / var_x
        if slope < 0:
            return None
        intercept = mean_y - slope * mean_x
        if intercept < 0:
            return 0.0, self._xy / self._xx
        return intercept, slope

    def line(self) -> tuple[float, float]:
        """(intercept, slope) where determined; else the mean as a constant."""
        return self.fit() or (self.mean()[1], 0.0)


class RecentMedian:
    """The median of the last ``size`` samples: one request delayed by a long step (a warm-up, a burst)
    must not make every load look dear for the dozens of samples a fading mean takes to forget it."""

    def __init__(self, size: int = RECENT_DELAYS):
        self._samples: deque[float] = deque(maxlen=size)
        self.samples = 0

    def add(self, value: float) -> None:
        self._samples.append(value)
        self.samples += 1

    @property
    def ready(self) -> bool:
        return self.samples >= MIN_SAMPLES

    def value(self) -> float:
        return statistics.median(self._samples) if self._samples else 0.0


class CostModel:
    """The engine's load and prefill costs, as measured."""

    def __init__(self) -> None:
        self.load = LinearFit()  # seconds a load's transfer takes for x bytes
        self.overhead = LinearFit()  # seconds a request waits beyond its load's transfer (x: 0), by the worker
        self.delay = RecentMedian()  # the same, by the scheduler: a request's whole delay (``observe_delay``)
        self.prefill = LinearFit()  # seconds a forward pass takes for x scheduled tokens

    def observe(self, loads: Iterable[tuple[int, float, float]], steps: Iterable[tuple[int, float]]) -> None:
        for nbytes, transfer_s, wait_s in loads:
            self.load.add(float(nbytes), transfer_s)
            self.overhead.add(0.0, max(0.0, wait_s - transfer_s))
        for tokens, seconds in steps:
            if tokens > 0:
                self.prefill.add(float(tokens), seconds)

    def observe_delay(self, nbytes: int, delay_s: float) -> None:
        """A loaded request's whole delay as the scheduler saw it: from its lookup's answer (when a miss
        would have been scheduled) to the step that computes it. The worker's wait runs from the step
        that starts the load to the one that reports it, and misses the scheduling around them: 3-5 ms
        of an idle CPU engine's 6-8 ms (the request timelines), the prefill of a few tokens there."""
        per_call, per_byte = self.transfer()
        self.delay.add(max(0.0, delay_s - per_call - per_byte * nbytes))

    def fixed_wait_s(self) -> float:
        """What a load costs beyond its transfer: the scheduler's measure once it has enough of them."""
        return self.delay.value() if self.delay.ready else self.overhead.mean()[1]

    @classmethod
    def given(cls, load_fixed_ms: float, load_mb_per_s: float, prefill_us_per_token: float) -> CostModel:
        """A model with these figures (an engine's, from its log line), for ``kvtool inspect``."""
        model = cls()
        per_byte = 1e-6 / load_mb_per_s if load_mb_per_s > 0 else 0.0
        for n in range(1, MIN_SAMPLES + 1):
            model.load.add(n * 1e6, n * 1e6 * per_byte)
            model.overhead.add(0.0, load_fixed_ms * 1e-3)
            model.prefill.add(n * 100.0, n * 100 * prefill_us_per_token * 1e-6)
        return model

    @property
    def ready(self) -> bool:
        """Enough loads seen, and forward passes of enough different sizes to price a token."""
        return self.load.ready and self.prefill.ready and self.prefill.fit() is not None

    def transfer(self) -> tuple[float, float]:
        """(seconds per call, seconds per byte) of a load's transfer."""
        fitted = self.load.fit()
        if fitted is not None:
            return fitted
        mean_bytes, mean_s = self.load.mean()
        return max(0.0, mean_s - mean_bytes * PRIOR_SECONDS_PER_BYTE), PRIOR_SECONDS_PER_BYTE

    def load_s(self, nbytes: int) -> float:
        per_call, per_byte = self.transfer()
        return self.fixed_wait_s() + per_call + per_byte * nbytes

    def prefill_s(self, tokens: int) -> float:
        """What ``tokens`` more tokens add to a forward pass (the slope: the pass runs anyway)."""
        fitted = self.prefill.fit()
        return fitted[1] * tokens if fitted is not None else 0.0

    def describe(self) -> dict[str, float]:
        load_fixed, load_per_byte = self.transfer()
        load_fixed += self.fixed_wait_s()
        fitted = self.prefill.fit()
        per_token = fitted[1] if fitted is not None else 0.0
        return {
            "load_fixed_ms": round(load_fixed * 1e3, 3),
            "load_mb_per_s": round(1e-6 / load_per_byte, 1) if load_per_byte > 0 else 0.0,
            "prefill_us_per_token": round(per_token * 1e6, 2),
        }


@dataclass(frozen=True)
class Verdict:
    plan: LoadPlan  # what to load (external_tokens 0: nothing)
    skipped: str | None = None  # "unprofitable" (nothing taken) or "trimmed" (the partial block dropped)
    detail: str = ""


def judge(
    plan: LoadPlan, trimmed: LoadPlan | None, object_bytes: Callable[[ObjectRef], int], model: CostModel
) -> Verdict:
    """The plan that saves the most time: ``plan``, ``trimmed`` (the hit cut at its last full block),
    or nothing. Every hit is taken while the model is not ready."""
    if plan.external_tokens == 0 or not model.ready:
        return Verdict(plan)

    def gain(candidate: LoadPlan) -> tuple[float, float, float]:
        load = model.load_s(sum(object_bytes(ref) for ref in candidate.objects))
        saved = model.prefill_s(candidate.external_tokens)
        return saved - load, load, saved

    whole = gain(plan)
    best, best_gain = plan, whole
    if trimmed is not None and 0 < trimmed.external_tokens < plan.external_tokens:
        cut = gain(trimmed)
        if cut[0] > whole[0]:
            best, best_gain = trimmed, cut
    if best_gain[0] <= 0:
        detail = f"a load of {whole[1] * 1e3:.1f} ms would save {whole[2] * 1e3:.1f} ms of prefill"
        return Verdict(LoadPlan(plan.local_tokens, 0, 0, 0, ()), "unprofitable", detail)
    if best is trimmed:
        detail = (
            f"the last {plan.external_tokens - trimmed.external_tokens} tokens' block costs more to load than "
            f"to compute ({whole[0] * 1e3:.1f} ms gained with it, {best_gain[0] * 1e3:.1f} ms without)"
        )
        return Verdict(trimmed, "trimmed", detail)
    return Verdict(plan)


NO_HIT_COULD_PAY = "no hit could pay"  # why a request was not looked up (its hit details' lookup says it)


@dataclass(frozen=True)
class LookupVerdict:
    skipped: str | None = None  # why no lookup is made (None: one is)
    explore: bool = False  # looked up though no hit could pay: its hit is taken, so that loads stay measured


class HitJudge:
    """The scheduler side's judge: the engine's cost model, and what each group's object weighs."""

    def __init__(self, block_bytes: tuple[int, ...], enabled: bool = True, token_bytes: tuple[int, ...] = ()):
        self.model = CostModel()
        self._block_bytes = block_bytes
        self._token_bytes = token_bytes  # per group, where tails hold their valid tokens only (else 0)
        self.enabled = enabled and bool(block_bytes)
        self._described_at: float | None = None
        self._declined = 0  # hits not taken since the last one taken anyway (EXPLORE_EVERY)
        self._not_worth = 0  # requests not looked up since the last one looked up anyway

    def object_bytes(self, ref: ObjectRef) -> int:
        group = ref.group
        per_token = self._token_bytes[group] if ref.kind is KeyKind.TAIL and group < len(self._token_bytes) else 0
        return HEADER_SIZE + (per_token * (ref.token_end - ref.token_start) if per_token else self._block_bytes[group])

    def observe(
        self, loads: Iterable[tuple[int, float, float]], steps: Iterable[tuple[int, float]], now: float
    ) -> str | None:
        """Fit the worker's measurements in; a line for the engine's log when the model is first ready,
        then every ``DESCRIBE_EVERY_S`` (what ``kvtool inspect prompt --cost`` takes)."""
        self.model.observe(loads, steps)
        if not self.enabled or not self.model.ready:
            return None
        if self._described_at is not None and now - self._described_at < DESCRIBE_EVERY_S:
            return None
        self._described_at = now
        d = self.model.describe()
        return (
            f"kvtool: cost model: a load waits {d['load_fixed_ms']} ms + {d['load_mb_per_s']} MB/s, prefill costs "
            f"{d['prefill_us_per_token']} us a token (--cost {d['load_fixed_ms']},{d['load_mb_per_s']},"
            f"{d['prefill_us_per_token']})"
        )

    def lookup_verdict(self, tokens: int) -> LookupVerdict:
        """Whether to look up a request that could gain at most ``tokens`` tokens (its prompt less one,
        less what the engine holds): not where there is none to gain, nor where (the model ready) even a
        load of no bytes would cost more than their prefill, so that any hit found would be declined and
        the lookup's round trip (1-2 ms on an idle CPU engine) be all it cost. One such request in
        ``EXPLORE_EVERY`` is looked up anyway and its hit taken (``explore``), so loads stay measured."""
        if tokens <= 0:
            return LookupVerdict("the engine holds every token a hit could claim")
        if not self.enabled or not self.model.ready:
            return LookupVerdict()
        cheapest, saved = self.model.load_s(0), self.model.prefill_s(tokens)
        if saved > cheapest:
            return LookupVerdict()
        self._not_worth += 1
        if self._not_worth >= EXPLORE_EVERY:
            self._not_worth = 0
            return LookupVerdict(explore=True)
        cost = f"a load costs {cheapest * 1e3:.1f} ms, the {tokens} tokens' prefill {saved * 1e3:.1f} ms"
        return LookupVerdict(f"{NO_HIT_COULD_PAY}: {cost}")

    def request_computed(self, timeline: Timeline, plan: LoadPlan | None, now_s: float) -> None:
        """The first step that computes a request: when its load was sent (and did not fail: the caller
        passes no failed one), its whole delay since its lookup answered goes to the model."""
        marks = timeline.marks
        measured = "load_sent" in marks and "answered" in marks and "computing" not in marks  # once, a load's
        if not self.enabled or plan is None or not plan.objects or not measured:
            return
        nbytes = sum(self.object_bytes(ref) for ref in plan.objects)
        self.model.observe_delay(nbytes, now_s - marks["answered"][0])

    def __call__(
        self, keys: PromptKeys, stored: StoredPrefix, local_tokens: int, plan: LoadPlan, explore: bool = False
    ) -> Verdict:
        """The hit to take; ``explore``: a request looked up to explore (``lookup_verdict``) takes it whole."""
        if not self.enabled or plan.external_tokens == 0:
            return Verdict(plan)
        cut = stored.hit_tokens // keys.block_size * keys.block_size
        trimmed = None
        if local_tokens < cut < stored.hit_tokens:
            trimmed = plan_load(keys, replace(stored, hit_tokens=cut, extended={}), local_tokens)
        verdict = judge(plan, trimmed, self.object_bytes, self.model)
        if verdict.skipped is None:
            return verdict
        if explore:
            return Verdict(plan, None, "explored")
        self._declined += 1
        if self._declined >= EXPLORE_EVERY:
            # Taken anyway: a model that declines every load would never see a load again, and a slow
            # start (cold pages, a burst of queueing) would turn loads off for good.
            self._declined = 0
            return Verdict(plan, None, "explored")
        return verdict
