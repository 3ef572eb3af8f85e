"""Sends a workload's requests to a pair, waits for durability, measures hits and TTFT, verifies.

All I/O of the bench lives here; what it produces is plain data for report.py.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


from connector.hits import HitDetails
from kvtool.admin import MooncakeAdmin, wait_for_key
from kvtool.connectors import profile
from kvtool.ready import ReadyFile, parse_ready_file, read_ready_file
from kvtool.client import complete
from kvtool.errors import ServerError, UserError
from kvtool.procs import http_ok
from kvtool.verify import compare_answers

from .config import TOP_LOGPROBS, BenchConfig
from .oracle import run_ideals
from .workloads.base import FIRST_TOKEN_ID, Step, Target, Transcript

KEY_COUNT_QUIET_S = 0.5  # vllm-mooncake-store gives no durability signal: wait for the store to go quiet
SETTLE_S = 1.0  # LMCache gives none and has no master to ask: its saves get this long to land
KEY_COUNT_POLL_S = 0.1
REQUEST_LOG_WAIT_S = 5.0


# The bench reads serve-pair's ready file through its one contract (kvtool/ready.py).
PairInfo = ReadyFile
load_pair_info = read_ready_file
pair_info = parse_ready_file


def check_reachable(pair: PairInfo) -> None:
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


@dataclass(frozen=True)
class ProducerResult:
    workload: str
    step: int
    prompt_tokens: int
    latency_ms: float
    saved_objects: int | None


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


def kvtool_hit(details: HitDetails) -> Hit:
    """The kvtool connector's hit: vLLM's local hit plus what the connector loaded, split into block
    and tail (vLLM's own prefix cache hits whole blocks only, so everything but the tail is blocks)."""
    total, tail = details.reused_tokens, details.tail_hit_tokens
    return Hit(total, total - tail, tail, details.lookup)


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


# ---- durability -----------------------------------------------------------------------------


class Durability:
    """Waits, before a request that reuses earlier ones, until their saves are in the store: the
    producer's prompt saves, and (chat) the consumer's answer saves."""

    def __init__(self, pair: PairInfo, timeout_s: float) -> None:
        self._pair = pair
        self._timeout_s = timeout_s
        self._pending_keys: list[str] = []
        self._pending_unsignalled = False

    def published(self, response: dict[str, Any]) -> int | None:
        """Note a producer response; returns the number of objects it saves when the connector says."""
        details = (response.get("kv_transfer_params") or {}).get("kvtool")
        self._expect(details.get("save_last_key") if details else None, signalled=details is not None)
        return details.get("save_objects") if details else None

    def answered(self, record: HitDetails | None) -> None:
        """Note a consumer request a later request reuses: its answer save, by the kvtool connector's
        ``answer_last_key`` (none: it saved no answer), else by the fallback when the consumer saves
        at all (roles both; a kv_consumer never does)."""
        last_key = record.answer_last_key if record else None
        self._expect(last_key, signalled=record is not None, saves=self._pair.roles == "both")

    def _expect(self, last_key: str | None, signalled: bool, saves: bool = True) -> None:
        """A save to wait for: its last key when the connector gives one, else the key-count fallback."""
        if last_key:
            self._pending_keys.append(last_key)
        elif not signalled and saves and profile(self._pair.connector).durability in ("key_count", "settle"):
            self._pending_unsignalled = True

    def wait(self) -> tuple[float, bool] | None:
        """Block until pending saves are durable: (milliseconds waited, timed out), None when nothing was pending."""
        if not self._pending_keys and not self._pending_unsignalled:
            return None
        began = time.perf_counter()
        timed_out = False
        if self._pending_unsignalled and profile(self._pair.connector).durability == "settle":
            time.sleep(SETTLE_S)
            self._pending_unsignalled = False
            return (time.perf_counter() - began) * 1000.0, False
        assert self._pair.admin is not None
        for key in self._pending_keys:
            # Puts run in order, so the last key of a save covers the save.
            if not wait_for_key(self._pair.admin, key, self._timeout_s):
                timed_out = True
        if self._pending_unsignalled:
            timed_out = not self._wait_key_count_quiet()
        self._pending_keys.clear()
        self._pending_unsignalled = False
        return (time.perf_counter() - began) * 1000.0, timed_out

    def _wait_key_count_quiet(self) -> bool:
        """Fallback without a signal: the master's key count has not changed for KEY_COUNT_QUIET_S."""
        assert self._pair.admin is not None
        store = MooncakeAdmin(self._pair.admin)
        deadline = time.monotonic() + self._timeout_s
        last, quiet_since = None, time.monotonic()
        while time.monotonic() < deadline:
            count = store.key_count()
            now = time.monotonic()
            if count != last:
                last, quiet_since = count, now
            elif now - quiet_since >= KEY_COUNT_QUIET_S:
                return True
            time.sleep(KEY_COUNT_POLL_S)
        return False


# ---- running --------------------------------------------------------------------------------

Advance = Callable[[str], None]


@dataclass(frozen=True)
class Exchange:
    """One request as sent and answered, with the kvtool connector's log line for it when read."""

    prompt: tuple[int, ...]
    response: dict[str, Any]
    record: HitDetails | None
    answer: tuple[int, ...] | None  # the generated token ids, when the response gave them


def request_log_readers(pair: PairInfo) -> dict[str, RequestLogReader]:
    """Each engine's kvtool request log, by role: where a measured request's hits are read."""
    if profile(pair.connector).hits_from != "request_log" or not pair.request_logs:
        return {}
    return {role: RequestLogReader(Path(path)) for role, path in pair.request_logs.items()}


def reused_steps(steps: list[Step]) -> set[int]:
    """The steps some later step means to reuse the saves of (``depends_on``)."""
    return {earlier for step in steps for earlier in step.depends_on}


class PairRunner:
    """Runs workloads against one pair, one request at a time."""

    def __init__(self, pair: PairInfo, config: BenchConfig) -> None:
        self.pair = pair
        self.config = config
        # A per-run salt keeps this run's prompts apart from an earlier run's on the same pair.
        self.run_id = uuid.uuid4().hex[:12]
        self.salt = f"kvtool-bench-{self.run_id}"
        self.request_logs = request_log_readers(pair)

    def warm_up(self) -> None:
        """One untimed request to each engine, so that the first measured one pays no warm-up."""
        warm_prompt = list(range(FIRST_TOKEN_ID, FIRST_TOKEN_ID + 8))
        extra = {"cache_salt": f"{self.salt}-warm-up"}
        for url in (self.pair.producer, self.pair.consumer):
            complete(url, self.pair.model, warm_prompt, 2, extra=extra, timeout_s=self.config.request_timeout_s)
            complete(
                url, self.pair.model, warm_prompt, 2, stream=True, extra=extra, timeout_s=self.config.request_timeout_s
            )

    def run(self, name: str, steps: list[Step], ideal: dict[int, int] | None, advance: Advance) -> WorkloadRun:
        """Send the steps in order. ``ideal``: the planned ideals of the consumer steps (the steps
        measured), or None for a workload whose prompts continue answers: every step is measured,
        against an oracle fed with what each request sent and generated."""
        run = WorkloadRun(name)
        ideals = run_ideals(ideal, self.pair.block_size, self.pair.hash_unit)
        durability = Durability(self.pair, self.config.durability_timeout_s)
        transcript = Transcript()
        reused = reused_steps(steps)
        for index, step in enumerate(steps):
            prompt = transcript.resolve(index, step)
            if step.waits_for_saves:
                self._wait(durability, run)
            ideal_tokens = ideals.of(index, prompt)
            exchange = self._send(name, index, step, prompt, ideal_tokens is not None, needs_answer=ideal is None)
            if exchange.answer is not None:
                transcript.answered(index, exchange.answer)
            self._record(run, name, index, step, exchange, ideal_tokens, durability)
            ideals.ran(prompt, exchange.answer or ())
            if step.target == "consumer" and index in reused:
                durability.answered(exchange.record)
            advance(step.target)
        return run

    @staticmethod
    def _wait(durability: Durability, run: WorkloadRun) -> None:
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
        response = complete(
            url,
            self.pair.model,
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
        return Exchange(prompt, response, record, answer)

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
            run.producers.append(ProducerResult(name, index, len(exchange.prompt), latency_ms, saved))
        if ideal_tokens is not None:
            measured = self._measure(name, index, step, exchange, ideal_tokens)
            (run.consumers if step.target == "consumer" else run.measured_producers).append(measured)

    def _measure(self, name: str, index: int, step: Step, exchange: Exchange, ideal_tokens: int) -> ConsumerResult:
        hit = kvtool_hit(exchange.record) if exchange.record is not None else cached_tokens_hit(exchange.response)
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
            verified=verified,
            matched=matched,
            max_logprob_diff=diff if diff is None or diff != float("inf") else None,
            mismatch=reason,
            lookup=hit.lookup,
            engine=step.target,
        )

    def _verify(self, step: Step, exchange: Exchange) -> tuple[bool, float, str]:
        """The answer compared with a recomputation (prompt_logprobs makes vLLM skip every cache)."""
        reference = complete(
            self.pair.consumer,
            self.pair.model,
            list(exchange.prompt),
            step.max_tokens,
            logprobs=TOP_LOGPROBS,
            prompt_logprobs=1,
            extra=self._extra(),
            timeout_s=self.config.request_timeout_s,
        )
        comparison = compare_answers(exchange.response, reference, self.config.tolerance)
        return comparison.matches, comparison.max_logprob_diff, comparison.reason
