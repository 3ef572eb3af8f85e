"""One pair's soak: its iterations, the checked requests they send, and what they counted."""

from __future__ import annotations

import argparse
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from connector.core.hits import HitDetails
from kvtool.client import complete
from kvtool.errors import ServerError
from kvtool.pair.ready import ReadyFile
from kvtool.verify import DEFAULT_LOGPROB_TOLERANCE, choice_logprobs, compare_answers

from master import MASTER_BACK_TIMEOUT_S, MasterAction, MasterEvent
from pair import Pair, RequestFailed
from plan import FAULTS, draw_fault, draw_prompts
from saves import check_save_pipelines, wait_save

REQUEST_TIMEOUT_S = 60.0
EXTRA = {"return_tokens_as_token_ids": True}


@dataclass
class PairSoak:
    pair: Pair
    args: argparse.Namespace
    rng: random.Random
    started: float = field(default_factory=time.monotonic)
    requests: Counter = field(default_factory=Counter)
    faults: Counter = field(default_factory=Counter)
    outcomes: Counter = field(default_factory=Counter)  # per engine: hit / miss / load failure cause
    saves: Counter = field(default_factory=Counter)
    timeline: list[tuple[float, float, str, str]] = field(default_factory=list)  # start, end, engine, purpose
    mismatches: list[dict] = field(default_factory=list)
    hangs: list[dict] = field(default_factory=list)
    errors: list[dict] = field(default_factory=list)
    events: list[MasterEvent] = field(default_factory=list)
    verified: int = 0
    worst_logprob_diff: float = 0.0
    iteration: int = 0
    fault: str | None = None
    final_ready: ReadyFile | None = None

    @property
    def model(self) -> str:
        return self.pair.info.model

    def now_s(self) -> float:
        return round(time.monotonic() - self.started, 2)

    def active_event(self, start: float, end: float) -> str | None:
        hit = [e for e in self.events if e.covers(start, end)]
        return f"master {hit[-1].kind} at iteration {hit[-1].iteration}" if hit else None

    def send(self, engine: str, purpose: str, prompt: list[int], max_tokens: int, reference: bool = False) -> dict:
        began = time.monotonic()
        try:
            answer = complete(
                getattr(self.pair.info, engine),
                self.model,
                prompt,
                max_tokens=max_tokens,
                logprobs=5,
                prompt_logprobs=1 if reference else None,
                extra=EXTRA,
                timeout_s=REQUEST_TIMEOUT_S,
            )
        except ServerError as exc:
            ended = time.monotonic()
            self.timeline.append((began, ended, engine, purpose))
            timed_out = ended - began >= REQUEST_TIMEOUT_S - 1 or "timed out" in str(exc).lower()
            raise RequestFailed(
                {
                    "iteration": self.iteration,
                    "at_s": round(began - self.started, 2),
                    "engine": engine,
                    "purpose": purpose,
                    "fault": self.fault,
                    "master_event": self.active_event(began, ended),
                    "what": ("timed out: " if timed_out else "failed: ") + str(exc),
                    "seconds": round(ended - began, 2),
                    "prompt": prompt,
                    "log_excerpt": self.pair.log_excerpt(engine),
                    "timed_out": timed_out,
                }
            ) from None
        ended = time.monotonic()
        self.timeline.append((began, ended, engine, purpose))
        self.requests[purpose] += 1
        answer["soak_span"] = (began, ended)
        return answer

    def note_hit(self, engine: str, answer: dict) -> HitDetails | None:
        details = HitDetails.from_response(answer)
        if details is None:
            self.outcomes[f"{engine}_no_details"] += 1
            return None
        self.outcomes[f"{engine}_{'hit' if details.external_hit_tokens else 'miss'}"] += 1
        if details.load_failure:
            self.outcomes[f"{engine}_load_failed_{details.load_failure}"] += 1
        if details.tail_hit_tokens:
            self.outcomes[f"{engine}_tail_hit"] += 1
        return details

    def verify(self, engine: str, purpose: str, prompt: list[int], answer: dict, max_tokens: int) -> None:
        """Compare ``answer`` with a recomputation on the same engine (faults off)."""
        self.pair.set_faults(None)
        reference = self.send(engine, f"{purpose}_reference", prompt, max_tokens, reference=True)
        self.verified += 1
        comparison = compare_answers(answer, reference, DEFAULT_LOGPROB_TOLERANCE)
        if comparison.matches:
            self.worst_logprob_diff = max(self.worst_logprob_diff, comparison.max_logprob_diff)
            return
        details = HitDetails.from_response(answer)
        got_tokens, got_top = choice_logprobs(answer)
        ref_tokens, ref_top = choice_logprobs(reference)
        self.mismatches.append(
            {
                "iteration": self.iteration,
                "at_s": self.now_s(),
                "engine": engine,
                "purpose": purpose,
                "fault": self.fault,
                "master_event": self.active_event(*answer["soak_span"]),
                "seconds": round(answer["soak_span"][1] - answer["soak_span"][0], 2),
                "reason": comparison.reason,
                "prompt_len": len(prompt),
                "prompt": prompt,
                "hit": details.to_dict() if details else None,
                "answer": {"tokens": got_tokens, "top_logprobs": got_top},
                "reference": {"tokens": ref_tokens, "top_logprobs": ref_top},
                "log_excerpt": self.pair.log_excerpt(engine),
            }
        )
        print(
            f"MISMATCH {self.pair.roles} iteration {self.iteration} {engine} {purpose}: {comparison.reason}", flush=True
        )

    def master_event_since(self, since: float) -> bool:
        """Was the master down or frozen at any time after ``since`` (or is it now)?"""
        return any(e.down_at is not None and (e.back_at is None or e.back_at > since) for e in self.events)

    def record_failure(self, record: dict[str, Any]) -> None:
        (self.hangs if record.pop("timed_out") else self.errors).append(record)
        print(f"FAILED {self.pair.roles} iteration {self.iteration}: {record['what']}", flush=True)

    # -- one iteration --------------------------------------------------------------------------

    def one_iteration(self, published: list[list[int]]) -> None:
        both = self.pair.roles == "both"
        base, continuation, shared = draw_prompts(self.rng, published, both, self.args.shared_prefix_rate)
        plan = FAULTS[self.fault] if self.fault else None

        began = time.monotonic()
        self.pair.set_faults(plan)
        answer = self.send("producer", "producer", base, 1)
        details = self.note_hit("producer", answer)
        wait_save(self, "producer", details, began)
        published.append(base)
        if both:
            self.verify("producer", "producer", base, answer, 1)
            self.pair.set_faults(plan)

        began = time.monotonic()
        reused = self.send("consumer", "consumer", continuation, 4)
        consumer_details = self.note_hit("consumer", reused)
        if both:
            wait_save(self, "consumer", consumer_details, began)
            published.append(continuation)
        self.verify("consumer", "consumer", continuation, reused, 4)

        if shared is not None:
            self.pair.set_faults(plan)
            answer = self.send("producer", "producer_shared_prefix", shared, 4)
            self.note_hit("producer_shared_prefix", answer)
            self.verify("producer", "producer_shared_prefix", shared, answer, 4)
        self.pair.set_faults(None)

    def run(self, events: dict[int, MasterEvent], label: str) -> None:
        published: list[list[int]] = []
        actions: list[MasterAction] = []
        try:
            for iteration in range(self.args.iterations):
                self.iteration = iteration
                if iteration in events:
                    if actions and actions[-1].is_alive():
                        actions[-1].join(MASTER_BACK_TIMEOUT_S + 30)
                    event = events[iteration]
                    self.events.append(event)
                    action = MasterAction(self.pair, event, self.rng.uniform(0.0, 0.4))
                    actions.append(action)
                    action.start()
                self.fault = draw_fault(self.rng, self.args.fault_rate)
                if self.fault:
                    self.faults[self.fault] += 1
                try:
                    self.one_iteration(published)
                except RequestFailed as failed:
                    self.pair.set_faults(None)
                    self.record_failure(failed.record)
                if iteration % 50 == 0:
                    print(
                        f"{label}: {iteration}/{self.args.iterations} requests={sum(self.requests.values())} "
                        f"mismatches={len(self.mismatches)} hangs={len(self.hangs)} errors={len(self.errors)} "
                        f"t={self.now_s():.0f}s",
                        flush=True,
                    )
            self.fault = None
            for action in actions:
                action.join(MASTER_BACK_TIMEOUT_S + 30)
            self.iteration = self.args.iterations
            check_save_pipelines(self, "after the run")
            self.final_ready = self.pair.ready()  # serve-pair removes it when it stops
        finally:
            for action in actions:
                action.release()
            self.pair.set_faults(None)
