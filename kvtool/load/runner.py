"""Running a load test: sessions in flight against one URL (a fleet's router, or a pair's engine).

Each session runs on a thread of its own, its turns one after another (a turn's prompt is the
previous prompt, the engine's real answer and the turn's message), each a streamed request. A
closed loop keeps ``concurrency`` sessions in flight; an open loop starts each at its arrival time
(``SessionPlan.start_s``), at most ``concurrency`` at once (a session arriving while all are busy
waits, and its TTFT says so). Bounded in count (the plans) and time (``deadline_s``: no turn starts
after it). A request that fails ends its session (counted, with its error), never the run.

Every request's ideal reuse is what anything computed before it was sent (any session, any engine)
made reusable (``kvtool.bench.oracle.ReuseOracle``: prompts and answers, less each answer's last
token). A sample of the answers is checked against a recomputation after the load has ended, so the
check's requests do not load the engines while they are measured.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from connector.core.hits import HitDetails
from kvtool.bench.oracle import ReuseOracle, computed_tokens
from kvtool.bench.runner import answer_token_ids, cached_tokens_hit
from kvtool.client import complete
from kvtool.errors import ServerError
from kvtool.verify import compare_answers

from .metrics import RequestRecord
from .sessions import SessionPlan

TOP_LOGPROBS = 5
EXTRA = {"return_token_ids": True, "return_tokens_as_token_ids": True, "ignore_eos": True}


@dataclass(frozen=True)
class LoadTarget:
    url: str  # where requests go: a fleet's router, or one engine
    model: str
    block_size: int
    hash_unit: int


@dataclass
class _Sample:
    prompt: tuple[int, ...]
    max_tokens: int
    response: dict[str, Any]


@dataclass
class LoadRun:
    records: list[RequestRecord] = field(default_factory=list)
    samples: list[_Sample] = field(default_factory=list)
    checked: dict[str, int] = field(default_factory=dict)  # "matched", "differed", "failed"
    differences: list[str] = field(default_factory=list)


class LoadRunner:
    def __init__(
        self,
        target: LoadTarget,
        concurrency: int,
        *,
        deadline_s: float,
        request_timeout_s: float = 600.0,
        check_every: int = 10,  # every n-th request's answer is checked against a recomputation (0: none)
        tolerance: float = 1e-3,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ):
        self._target = target
        self._concurrency = concurrency
        self._deadline_s = deadline_s
        self._timeout_s = request_timeout_s
        self._check_every = check_every
        self._tolerance = tolerance
        self._clock, self._sleep = clock, sleep
        self._oracle = ReuseOracle(target.block_size, target.hash_unit)
        self._lock = threading.Lock()  # the oracle, the run and the request count
        self._sent = 0
        self._stop = threading.Event()  # set on Ctrl-C (or any error of the run): no session sends again

    def run(self, plans: list[SessionPlan]) -> LoadRun:
        run, started = LoadRun(), self._clock()
        with ThreadPoolExecutor(self._concurrency, thread_name_prefix="kvtool-load") as pool:
            futures = []
            try:
                for plan in sorted(plans, key=lambda p: p.start_s):
                    wait = started + plan.start_s - self._clock()
                    if wait > 0:
                        self._sleep(wait)  # open loop: the next arrival
                    if self._clock() - started > self._deadline_s:
                        break
                    futures.append(pool.submit(self._session, plan, started, run))
                for future in futures:
                    future.result()
            except BaseException:
                # Ctrl-C: sessions not started never start, the others end before their next turn
                # (a request in flight finishes), so the pair is stopped in seconds, not after the load.
                self._stop.set()
                pool.shutdown(wait=False, cancel_futures=True)
                raise
        self._check(run)
        return run

    def _session(self, plan: SessionPlan, started: float, run: LoadRun) -> None:
        prompt: tuple[int, ...] = ()
        answer: tuple[int, ...] = ()
        for number, turn in enumerate(plan.turns):
            if number:
                self._sleep(turn.think_s)
                prompt = prompt + answer + turn.message
            else:
                prompt = turn.message
            if self._stop.is_set() or self._clock() - started > self._deadline_s:
                return
            with self._lock:
                ideal = self._oracle.ideal(prompt)
                self._sent += 1
                sample = self._check_every > 0 and self._sent % self._check_every == 0
            sent_s = self._clock() - started
            try:
                response = complete(
                    self._target.url,
                    self._target.model,
                    list(prompt),
                    turn.max_tokens,
                    logprobs=TOP_LOGPROBS,
                    stream=True,
                    extra=EXTRA,
                    timeout_s=self._timeout_s,
                )
                generated = answer_token_ids(response)
                if generated is None:
                    raise ServerError("the answer carried no token ids (return_token_ids)")
            except ServerError as exc:
                with self._lock:
                    run.records.append(_failed(plan, number, sent_s, len(prompt), exc.message))
                return  # the session cannot go on without its answer
            answer = generated
            record = _record(plan, number, sent_s, prompt, answer, response, ideal)
            with self._lock:
                self._oracle.note(computed_tokens(prompt, answer))
                run.records.append(record)
                if sample:
                    run.samples.append(_Sample(prompt, turn.max_tokens, response))

    def _check(self, run: LoadRun) -> None:
        """The sampled answers against a recomputation (prompt_logprobs: vLLM skips every cache)."""
        for sample in run.samples:
            try:
                reference = complete(
                    self._target.url,
                    self._target.model,
                    list(sample.prompt),
                    sample.max_tokens,
                    logprobs=TOP_LOGPROBS,
                    prompt_logprobs=1,
                    extra=EXTRA,
                    timeout_s=self._timeout_s,
                )
            except ServerError as exc:
                run.checked["failed"] = run.checked.get("failed", 0) + 1
                run.differences.append(f"recomputation failed: {exc.message}")
                continue
            comparison = compare_answers(sample.response, reference, self._tolerance)
            outcome = "matched" if comparison.matches else "differed"
            run.checked[outcome] = run.checked.get(outcome, 0) + 1
            if not comparison.matches:
                run.differences.append(comparison.reason)


def _hit_tokens(response: dict[str, Any]) -> int:
    """What the engine reused: the kvtool connector's hit details, else vLLM's cached tokens."""
    details = HitDetails.from_response(response)
    return details.reused_tokens if details is not None else cached_tokens_hit(response).tokens


def _record(
    plan: SessionPlan,
    turn: int,
    sent_s: float,
    prompt: tuple[int, ...],
    answer: tuple[int, ...],
    response: dict[str, Any],
    ideal: int,
) -> RequestRecord:
    timing = response["kvtool_timing"]
    chunks = timing.get("token_chunk_s") or []
    return RequestRecord(
        session=plan.index,
        turn=turn,
        sent_s=sent_s,
        prompt_tokens=len(prompt),
        output_tokens=len(answer),
        ttft_s=timing["ttft_s"],
        e2e_s=timing["total_s"],
        itl_s=tuple(later - earlier for earlier, later in itertools.pairwise(chunks)),
        hit_tokens=_hit_tokens(response),
        ideal_tokens=ideal,
    )


def _failed(plan: SessionPlan, turn: int, sent_s: float, prompt_tokens: int, error: str) -> RequestRecord:
    return RequestRecord(plan.index, turn, sent_s, prompt_tokens, 0, 0.0, 0.0, error=error)
