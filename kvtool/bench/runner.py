"""Sends a workload's requests to a pair, waits for durability, measures hits and TTFT, verifies.

All I/O of the bench lives here; what it produces is plain data for report.py.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from connector.core.hits import HitDetails
from connector.core.profit import NO_HIT_COULD_PAY
from kvtool import web
from kvtool.pair.profiles import profile
from kvtool.pair.ready import ReadyFile
from kvtool.client import complete
from kvtool.prometheus import total
from kvtool.errors import ServerError, UserError
from kvtool.procs import http_ok
from kvtool.verify import compare_answers

from .config import TOP_LOGPROBS, BenchConfig
from .durability import Durability
from .oracle import run_ideals
from .workloads.base import FIRST_TOKEN_ID, Step, Target, Transcript

REQUEST_LOG_WAIT_S = 5.0


# The bench reads serve-pair's ready file through its one contract (kvtool/pair/ready.py).


def check_reachable(pair: ReadyFile) -> None:
    for role, url in (("producer", pair.producer), ("consumer", pair.consumer)):
        if not http_ok(url.rstrip("/") + "/health"):
            raise UserError(f"the pair's {role} at {url} is not reachable; is serve-pair still running?", exit_code=1)
    if profile(pair.connector).uses_store and (pair.admin is None or not http_ok(pair.admin.rstrip("/") + "/health")):
        raise UserError(
            f"the pair's Mooncake master admin ({pair.admin}) is not reachable; the bench needs it to know "
            "when saves are durable (serve-pair without --master provides it)",
            exit_code=1,
        )


@dataclass(frozen=True)
class ConsumerResult:
    """A request whose reuse is measured: a consumer request, or, in a workload measured on both
    engines (chat), a producer request too (``engine``; its TTFT is its latency, ``max_tokens=1``)."""

    workload: str
    step: int
    label: str
    prompt_tokens: int
    ideal_tokens: int
    hit_tokens: int
    block_hit_tokens: int
    tail_hit_tokens: int
    ttft_ms: float
    verified: bool
    matched: bool | None
    max_logprob_diff: float | None
    mismatch: str = ""
    lookup: str | None = None
    engine: Target = "consumer"
    # vLLM's own TTFT (from the API server taking the request to its first token, /metrics): the
    # client's less HTTP and request parsing, which vary by tens of ms on a busy machine.
    engine_ttft_ms: float | None = None
    declined_tokens: int = 0  # found stored, not loaded: the kvtool connector's cost model said they do not pay


@dataclass(frozen=True)
class ProducerResult:
    workload: str
    step: int
    prompt_tokens: int
    latency_ms: float
    saved_objects: int | None
    engine_latency_ms: float | None = None  # vLLM's own (vllm:e2e_request_latency_seconds): no HTTP


@dataclass
class WorkloadRun:
    workload: str
    consumers: list[ConsumerResult] = field(default_factory=list)
    producers: list[ProducerResult] = field(default_factory=list)
    durability_waits_ms: list[float] = field(default_factory=list)
    durability_timeouts: int = 0
    measured_producers: list[ConsumerResult] = field(default_factory=list)  # chat: the producer's hits

    @property
    def measured(self) -> list[ConsumerResult]:
        """Every request whose reuse was measured, on either engine, in the order they ran."""
        return sorted([*self.consumers, *self.measured_producers], key=lambda result: result.step)


# ---- hit attribution ------------------------------------------------------------------------


class RequestLogReader:
    """Reads the kvtool connector's per-request JSON lines by the tag the bench put in each request."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._offset = path.stat().st_size if path.exists() else 0
        self._by_tag: dict[str, HitDetails] = {}

    def _read_new(self) -> None:
        if not self._path.exists():
            return
        with open(self._path, "rb") as log:
            log.seek(self._offset)
            chunk = log.read()
        complete_part = chunk[: chunk.rfind(b"\n") + 1]  # a line still being written waits for the next read
        self._offset += len(complete_part)
        for line in complete_part.splitlines():
            try:
                record = HitDetails.from_dict(json.loads(line))
            except ValueError:
                continue
            if record.tag:
                self._by_tag[record.tag] = record

    def record(self, tag: str, timeout_s: float = REQUEST_LOG_WAIT_S) -> HitDetails | None:
        deadline = time.monotonic() + timeout_s
        while True:
            self._read_new()
            if tag in self._by_tag:
                return self._by_tag.pop(tag)
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.02)


@dataclass(frozen=True)
class Hit:
    tokens: int
    block_tokens: int
    tail_tokens: int
    lookup: str | None = None
    declined_tokens: int = 0  # found stored, not loaded: the cost model judged they cost more than they save


def kvtool_hit(details: HitDetails, ideal_tokens: int | None = None) -> Hit:
    """The kvtool connector's hit: vLLM's local hit plus what the connector loaded, split into block
    and tail (vLLM's own prefix cache hits whole blocks only, so everything but the tail is blocks),
    and what its cost model declined of what the lookup found (at most all but the prompt's last token,
    which vLLM always computes), or of ``ideal_tokens`` where it judged no hit could pay and made no
    lookup."""
    total, tail = details.reused_tokens, details.tail_hit_tokens
    declined, found = 0, None
    if details.load_skipped is not None:
        found = details.stored_prefix_tokens
    elif details.lookup.startswith(f"not looked up: {NO_HIT_COULD_PAY}") and ideal_tokens is not None:
        found = ideal_tokens
    if found is not None:
        declined = max(0, min(found, details.prompt_tokens - 1) - total)
    return Hit(total, total - tail, tail, details.lookup, declined)


def cached_tokens_hit(response: dict[str, Any]) -> Hit:
    """The hit any connector reports through usage (vLLM's local plus external reuse, whole blocks)."""
    details = (response.get("usage") or {}).get("prompt_tokens_details") or {}
    cached = int(details.get("cached_tokens") or 0)
    return Hit(cached, cached, 0)


def answer_token_ids(response: dict[str, Any]) -> tuple[int, ...] | None:
    """The token ids choice 0 generated: its ``token_ids`` (``return_token_ids``; a streamed response
    has them per chunk, merged by kvtool.client into ``chunks``), else its logprob tokens when written
    as ``token_id:N`` (``return_tokens_as_token_ids``); None when the response has neither."""
    choices = [c for part in response.get("chunks") or [response] for c in part.get("choices") or []]
    choices = [c for c in choices if c.get("index", 0) == 0]
    if any(c.get("token_ids") is not None for c in choices):
        return tuple(token for c in choices for token in c.get("token_ids") or ())
    tokens = ((response.get("choices") or [{}])[0].get("logprobs") or {}).get("tokens") or []
    if tokens and all(str(token).startswith("token_id:") for token in tokens):
        return tuple(int(str(token)[len("token_id:") :]) for token in tokens)
    return None


# ---- running --------------------------------------------------------------------------------

Advance = Callable[[str], None]


class QuietClock:
    """When the last request ended: each request starts ``quiet_s`` after it (BenchConfig.quiet_s), one
    clock per bench run, shared by every pair an interleaved run alternates. Every request the bench
    sends counts (``PairRunner._request``), the warm-up's and the recomputation that verifies an answer
    too: interleaved, the pair that went second
    otherwise started the moment the first pair's recomputation of a long prompt ended, and computed
    its own 1,190-token misses 15-40% slower in every run."""

    def __init__(self, quiet_s: float) -> None:
        self.quiet_s = quiet_s
        self._last_done = 0.0

    def wait(self) -> None:
        time.sleep(max(0.0, self._last_done + self.quiet_s - time.monotonic()))

    def done(self) -> None:
        self._last_done = time.monotonic()


@dataclass(frozen=True)
class Exchange:
    """One request as sent and answered, with the kvtool connector's log line for it when read."""

    prompt: tuple[int, ...]
    response: dict[str, Any]
    record: HitDetails | None
    answer: tuple[int, ...] | None  # the generated token ids, when the response gave them
    engine_ms: float | None = None  # vLLM's own figure for it: a consumer's TTFT, a producer's latency


TTFT_METRIC = "vllm:time_to_first_token_seconds"  # from the API server taking a request to its first token
LATENCY_METRIC = "vllm:e2e_request_latency_seconds"


def engine_totals(url: str, metric: str) -> tuple[float, float] | None:
    """(sum, count) of one of vLLM's histograms, or None when /metrics does not answer with it."""
    try:
        text = web.get(url.rstrip("/") + "/metrics", timeout=5.0).text
    except httpx.HTTPError:
        return None
    total_s, count = total(text, metric + "_sum"), total(text, metric + "_count")
    return None if total_s is None or count is None else (total_s, count)


def engine_ms(before: tuple[float, float] | None, after: tuple[float, float] | None) -> float | None:
    """The one request's figure between two readings (requests run one at a time), else None."""
    if before is None or after is None or after[1] - before[1] != 1:
        return None
    return (after[0] - before[0]) * 1000.0


def request_log_readers(pair: ReadyFile) -> dict[str, RequestLogReader]:
    """Each engine's kvtool request log, by role: where a measured request's hits are read."""
    if profile(pair.connector).hits_from != "request_log" or not pair.request_logs:
        return {}
    return {role: RequestLogReader(Path(path)) for role, path in pair.request_logs.items()}


def reused_steps(steps: list[Step]) -> set[int]:
    """The steps some later step means to reuse the saves of (``depends_on``)."""
    return {earlier for step in steps for earlier in step.depends_on}


class PairRunner:
    """Runs workloads against one pair, one request at a time."""

    def __init__(self, pair: ReadyFile, config: BenchConfig, quiet: QuietClock | None = None) -> None:
        self.pair = pair
        self.config = config
        # A per-run salt keeps this run's prompts apart from an earlier run's on the same pair.
        self.run_id = uuid.uuid4().hex[:12]
        # When the last request ended, quiet_s counts from it: shared by the pairs of an interleaved run.
        self.quiet = quiet if quiet is not None else QuietClock(config.quiet_s)
        self.salt = f"kvtool-bench-{self.run_id}"
        self.request_logs = request_log_readers(pair)

    def warm_up(self) -> None:
        """Untimed requests to each engine, so that the first measured one pays no warm-up: plain, then
        streamed with top logprobs as the measured requests are (on a connector that shares the
        producer's saves, the consumer's are hits)."""
        warm_prompt = list(range(FIRST_TOKEN_ID, FIRST_TOKEN_ID + 8))
        extra = {"cache_salt": f"{self.salt}-warm-up"}
        timeout_s = self.config.request_timeout_s
        for url in (self.pair.producer, self.pair.consumer):
            self._request(url, warm_prompt, 2, extra=extra, timeout_s=timeout_s)
            self._request(url, warm_prompt, 2, logprobs=TOP_LOGPROBS, stream=True, extra=extra, timeout_s=timeout_s)

    def _request(self, url: str, prompt: list[int], max_tokens: int, **options: Any) -> dict[str, Any]:
        """Every request the bench sends (``complete``'s arguments): the quiet clock counts from its end,
        answered or failed, whatever it was (a warm-up, a measured step, a verifying recomputation)."""
        try:
            return complete(url, self.pair.model, prompt, max_tokens, **options)
        finally:
            self.quiet.done()

    def run(self, name: str, steps: list[Step], ideal: dict[int, int] | None, advance: Advance) -> WorkloadRun:
        """Send the steps in order. ``ideal``: the planned ideals of the consumer steps (the steps
        measured), or None for a workload whose prompts continue answers: every step is measured,
        against an oracle fed with what each request sent and generated."""
        run = WorkloadRun(name)
        for target in self.stepper(run, steps, ideal):
            advance(target)
        return run

    def stepper(self, run: WorkloadRun, steps: list[Step], ideal: dict[int, int] | None) -> Iterator[Target]:
        """``run``'s steps one at a time: each ``next()`` sends one step (and records it in ``run``) and
        yields its target, so that an interleaved bench can alternate the pairs step by step."""
        name = run.workload
        ideals = run_ideals(ideal, self.pair.block_size, self.pair.hash_unit)
        durability = Durability(self.pair, self.config.durability_timeout_s)
        transcript = Transcript()
        reused = reused_steps(steps)
        for index, step in enumerate(steps):
            prompt = transcript.resolve(index, step)
            if step.waits_for_saves:
                self._wait(durability, run)
            # Every request, on every connector, starts quiet_s after the last one ended (BenchConfig).
            self.quiet.wait()
            ideal_tokens = ideals.of(index, prompt)
            exchange = self._send(name, index, step, prompt, ideal_tokens is not None, needs_answer=ideal is None)
            if exchange.answer is not None:
                transcript.answered(index, exchange.answer)
            self._record(run, name, index, step, exchange, ideal_tokens, durability)
            ideals.ran(prompt, exchange.answer or ())
            if step.target == "consumer" and index in reused:
                durability.answered(exchange.record)
            yield step.target

    def _wait(self, durability: Durability, run: WorkloadRun) -> None:
        waited = durability.wait()
        if waited is not None:
            run.durability_waits_ms.append(waited[0])
            run.durability_timeouts += waited[1]

    def _extra(self) -> dict[str, Any]:
        return {"cache_salt": self.salt, "return_tokens_as_token_ids": True}

    def _send(
        self, name: str, index: int, step: Step, prompt: tuple[int, ...], measured: bool, needs_answer: bool
    ) -> Exchange:
        """The step's request: a consumer's streamed (TTFT), tagged when its hits are read from a request
        log, with the generated token ids asked for when a later prompt or the oracle needs them."""
        consumer = step.target == "consumer"
        url = self.pair.consumer if consumer else self.pair.producer
        reader = self.request_logs.get(step.target) if measured else None
        tag = f"{self.run_id}-{name}-{index}"
        metric = TTFT_METRIC if consumer else LATENCY_METRIC
        before = engine_totals(url, metric) if measured or not consumer else None
        response = self._request(
            url,
            list(prompt),
            step.max_tokens,
            logprobs=TOP_LOGPROBS if consumer and self.config.verify else None,
            stream=consumer,
            kv_transfer_params={"kvtool_tag": tag} if reader is not None else None,
            extra={**self._extra(), "return_token_ids": True} if needs_answer else self._extra(),
            timeout_s=self.config.request_timeout_s,
        )
        record = self._log_record(step.target, reader, tag) if reader is not None else None
        answer = answer_token_ids(response)
        if answer is None and needs_answer:
            raise ServerError(
                f"the {step.target} at {url} returned no generated token ids (return_token_ids); "
                f"workload {name} continues answers and needs them"
            )
        figure = engine_ms(before, engine_totals(url, metric)) if before is not None else None
        return Exchange(prompt, response, record, answer, figure)

    def _log_record(self, engine: Target, reader: RequestLogReader, tag: str) -> HitDetails:
        record = reader.record(tag)
        if record is None:
            log = (self.pair.request_logs or {}).get(engine)
            raise ServerError(
                f"the {engine}'s request log {log} has no line for request {tag}; "
                f"is the {engine} running the kvtool connector?"
            )
        return record

    def _record(
        self,
        run: WorkloadRun,
        name: str,
        index: int,
        step: Step,
        exchange: Exchange,
        ideal_tokens: int | None,
        durability: Durability,
    ) -> None:
        """What the step's request adds to the run: a producer's latency and save, a measured hit."""
        if step.target == "producer":
            saved = durability.published(exchange.response)
            latency_ms = exchange.response["kvtool_timing"]["total_s"] * 1000.0
            run.producers.append(
                ProducerResult(name, index, len(exchange.prompt), latency_ms, saved, exchange.engine_ms)
            )
        if ideal_tokens is not None:
            measured = self._measure(name, index, step, exchange, ideal_tokens)
            (run.consumers if step.target == "consumer" else run.measured_producers).append(measured)

    def _measure(self, name: str, index: int, step: Step, exchange: Exchange, ideal_tokens: int) -> ConsumerResult:
        hit = (
            kvtool_hit(exchange.record, ideal_tokens)
            if exchange.record is not None
            else cached_tokens_hit(exchange.response)
        )
        verified = step.target == "consumer" and self.config.verify
        matched, diff, reason = self._verify(step, exchange) if verified else (None, None, "")
        return ConsumerResult(
            workload=name,
            step=index,
            label=step.label,
            prompt_tokens=len(exchange.prompt),
            ideal_tokens=ideal_tokens,
            hit_tokens=hit.tokens,
            block_hit_tokens=hit.block_tokens,
            tail_hit_tokens=hit.tail_tokens,
            ttft_ms=exchange.response["kvtool_timing"]["ttft_s"] * 1000.0,
            engine_ttft_ms=exchange.engine_ms if step.target == "consumer" else None,
            verified=verified,
            matched=matched,
            max_logprob_diff=diff if diff is None or diff != float("inf") else None,
            mismatch=reason,
            lookup=hit.lookup,
            engine=step.target,
            declined_tokens=hit.declined_tokens,
        )

    def _verify(self, step: Step, exchange: Exchange) -> tuple[bool, float, str]:
        """The answer compared with a recomputation (prompt_logprobs makes vLLM skip every cache)."""
        reference = self._request(  # the recomputation is a request too: the next one waits quiet_s after it
            self.pair.consumer,
            list(exchange.prompt),
            step.max_tokens,
            logprobs=TOP_LOGPROBS,
            prompt_logprobs=1,
            extra=self._extra(),
            timeout_s=self.config.request_timeout_s,
        )
        comparison = compare_answers(exchange.response, reference, self.config.tolerance)
        return comparison.matches, comparison.max_logprob_diff, comparison.reason
