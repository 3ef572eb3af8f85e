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
from .workloads.base import FIRST_TOKEN_ID, Step

KEY_COUNT_QUIET_S = 0.5  # vllm-mooncake-store gives no durability signal: wait for the store to go quiet
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


# ---- durability -----------------------------------------------------------------------------


class Durability:
    """Waits, before a consumer request, until the producer's earlier saves are in the store."""

    def __init__(self, pair: PairInfo, timeout_s: float) -> None:
        self._pair = pair
        self._timeout_s = timeout_s
        self._pending_keys: list[str] = []
        self._pending_unsignalled = False

    def published(self, response: dict[str, Any]) -> int | None:
        """Note a producer response; returns the number of objects it saves when the connector says."""
        details = (response.get("kv_transfer_params") or {}).get("kvtool")
        if details is not None:
            if details.get("save_last_key"):
                self._pending_keys.append(details["save_last_key"])
            return details.get("save_objects")
        if profile(self._pair.connector).durability == "key_count":
            self._pending_unsignalled = True
        return None

    def wait(self) -> tuple[float, bool] | None:
        """Block until pending saves are durable: (milliseconds waited, timed out), None when nothing was pending."""
        if not self._pending_keys and not self._pending_unsignalled:
            return None
        began = time.perf_counter()
        timed_out = False
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


class PairRunner:
    """Runs workloads against one pair, one request at a time."""

    def __init__(self, pair: PairInfo, config: BenchConfig) -> None:
        self.pair = pair
        self.config = config
        # A per-run salt keeps this run's prompts apart from an earlier run's on the same pair.
        self.run_id = uuid.uuid4().hex[:12]
        self.salt = f"kvtool-bench-{self.run_id}"
        self.request_log = (
            RequestLogReader(Path(pair.request_logs["consumer"]))
            if profile(pair.connector).hits_from == "request_log" and pair.request_logs
            else None
        )

    def warm_up(self) -> None:
        """One untimed request to each engine, so that the first measured one pays no warm-up."""
        warm_prompt = list(range(FIRST_TOKEN_ID, FIRST_TOKEN_ID + 8))
        extra = {"cache_salt": f"{self.salt}-warm-up"}
        for url in (self.pair.producer, self.pair.consumer):
            complete(url, self.pair.model, warm_prompt, 2, extra=extra, timeout_s=self.config.request_timeout_s)
            complete(
                url, self.pair.model, warm_prompt, 2, stream=True, extra=extra, timeout_s=self.config.request_timeout_s
            )

    def run(self, name: str, steps: list[Step], ideal: dict[int, int], advance: Advance) -> WorkloadRun:
        run = WorkloadRun(name)
        durability = Durability(self.pair, self.config.durability_timeout_s)
        for index, step in enumerate(steps):
            if step.target == "producer":
                run.producers.append(self._produce(name, index, step, durability))
            else:
                waited = durability.wait()
                if waited is not None:
                    run.durability_waits_ms.append(waited[0])
                    run.durability_timeouts += waited[1]
                run.consumers.append(self._consume(name, index, step, ideal[index]))
            advance(step.target)
        return run

    def _extra(self) -> dict[str, Any]:
        return {"cache_salt": self.salt, "return_tokens_as_token_ids": True}

    def _produce(self, name: str, index: int, step: Step, durability: Durability) -> ProducerResult:
        response = complete(
            self.pair.producer,
            self.pair.model,
            list(step.prompt),
            step.max_tokens,
            extra=self._extra(),
            timeout_s=self.config.request_timeout_s,
        )
        saved = durability.published(response)
        latency_ms = response["kvtool_timing"]["total_s"] * 1000.0
        return ProducerResult(name, index, len(step.prompt), latency_ms, saved)

    def _consume(self, name: str, index: int, step: Step, ideal_tokens: int) -> ConsumerResult:
        tag = f"{self.run_id}-{name}-{index}"
        logprobs = TOP_LOGPROBS if self.config.verify else None
        answer = complete(
            self.pair.consumer,
            self.pair.model,
            list(step.prompt),
            step.max_tokens,
            logprobs=logprobs,
            stream=True,
            kv_transfer_params={"kvtool_tag": tag} if self.request_log is not None else None,
            extra=self._extra(),
            timeout_s=self.config.request_timeout_s,
        )
        hit = cached_tokens_hit(answer)
        if self.request_log is not None:
            record = self.request_log.record(tag)
            if record is None:
                raise ServerError(
                    f"the consumer's request log {self.pair.request_logs and self.pair.request_logs['consumer']} "
                    f"has no line for request {tag}; is the consumer running the kvtool connector?"
                )
            hit = kvtool_hit(record)
        matched, diff, reason = None, None, ""
        if self.config.verify:
            # prompt_logprobs makes vLLM skip every cache: the reference is a full recomputation.
            reference = complete(
                self.pair.consumer,
                self.pair.model,
                list(step.prompt),
                step.max_tokens,
                logprobs=TOP_LOGPROBS,
                prompt_logprobs=1,
                extra=self._extra(),
                timeout_s=self.config.request_timeout_s,
            )
            comparison = compare_answers(answer, reference, self.config.tolerance)
            matched, diff, reason = comparison.matches, comparison.max_logprob_diff, comparison.reason
        return ConsumerResult(
            workload=name,
            step=index,
            label=step.label,
            prompt_tokens=len(step.prompt),
            ideal_tokens=ideal_tokens,
            hit_tokens=hit.tokens,
            block_hit_tokens=hit.block_tokens,
            tail_hit_tokens=hit.tail_tokens,
            ttft_ms=answer["kvtool_timing"]["ttft_s"] * 1000.0,
            verified=self.config.verify,
            matched=matched,
            max_logprob_diff=diff if diff is None or diff != float("inf") else None,
            mismatch=reason,
            lookup=hit.lookup,
        )
