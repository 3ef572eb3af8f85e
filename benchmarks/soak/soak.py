"""Soak run: mixed requests on real pairs, with store faults drawn at random and the master killed and frozen.

One invocation launches, one after another, a producer/consumer pair (`serve-pair --roles pd`) and
a pair of two `kv_both` engines (`--roles both`), and on each runs ``--iterations`` iterations:

- the producer publishes a prompt (max_tokens=1; half of them extend an earlier prompt), the soak
  waits (bounded) for the save's final watermark record, then the consumer answers a continuation
  (4 tokens, top-5 logprobs), compared with a full recomputation (a request with prompt_logprobs,
  which skips every cache);
- on the `both` pair the producer's own answer is verified too (it loads what the consumer
  published), the consumer's continuations join the pool of prompts later ones extend, and half the
  iterations also send the producer a prompt sharing a prefix with the continuation the consumer just
  published (its kv_both load), verified likewise;
- a fault plan drawn at random (connector/faults.py) is active for part of the iterations;
- the master is SIGKILLed (serve-pair restarts it and rewrites the ready file) and frozen with
  SIGSTOP for a few seconds (then SIGCONT; serve-pair may replace it first) at spread iterations,
  while the requests go on; requests in flight while the master was down or frozen are counted.

It reports per pair: requests, faults by kind, master kills and freezes, mismatches (an answer that
differs from its recomputation) and hangs (a request not answered within its time-out, or a save
pipeline that never again ends a save). Expected: 0 mismatches, 0 hangs, 0 errors.

    scripts/run python benchmarks/soak/soak.py --iterations 300 --seed 1 --out benchmarks/soak/results.json

Not part of CI: it runs for about a quarter of an hour.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from connector.hits import HitDetails  # noqa: E402
from kvtool.client import complete  # noqa: E402
from kvtool.errors import ServerError  # noqa: E402
from kvtool.procs import find_free_port, log_tail  # noqa: E402
from kvtool.verify import DEFAULT_LOGPROB_TOLERANCE, choice_logprobs, compare_answers  # noqa: E402

# Fault kinds and their plans (connector/faults.py). Put faults spare watermark records ("w"), so a
# save always ends visibly; a full store for the tail alone is the partial-tail case.
FAULTS: dict[str, dict] = {
    "corrupt_flip": {"corrupt_get": "flip"},
    "corrupt_truncate": {"corrupt_get": "truncate"},
    "corrupt_namespace": {"corrupt_get": "namespace"},
    "load_finds_nothing": {"fail_get": True},
    "lookup_fails": {"fail_exists": True},
    "store_full_tail": {"put_outcome": "no_space", "put_kinds": ["t"]},
    "puts_fail": {"put_outcome": "failed", "put_kinds": ["b", "t"]},
    "save_in_flight": {"put_delay_s": 0.05},
    "slow_store": {"delay_s": 2.5},  # past the 2 s lookup time-out
}
FAULT_WEIGHTS = {"slow_store": 0.2}  # slow faults cost seconds each; draw them less often
REQUEST_TIMEOUT_S = 60.0
SAVE_WAIT_S = 3.0  # a save normally ends in milliseconds; one the breaker skipped never writes its record
SLOW_SAVE_WAIT_S = 30.0  # under slow_store / save_in_flight
PIPELINE_CHECK_S = 60.0  # a clean save must end within this once faults are off (breaker back-off <= 10 s)
MASTER_BACK_TIMEOUT_S = 90.0
STARTUP_TIMEOUT_S = 400.0
EXTRA = {"return_tokens_as_token_ids": True}
TOKEN_LOW, TOKEN_HIGH = 10, 900
MAX_PROMPT_TOKENS = 1500  # chains of extensions stay well inside max_model_len (2048)


def tokens(rng: random.Random, low: int, high: int) -> list[int]:
    return [rng.randrange(TOKEN_LOW, TOKEN_HIGH) for _ in range(rng.randrange(low, high))]


# ---- the pair -------------------------------------------------------------------------------------


class Pair:
    """A serve-pair process this script started, its ready file and its fault plan file."""

    def __init__(self, workdir: Path, roles: str) -> None:
        self.workdir = workdir
        self.roles = roles
        self.ready_file = workdir / "ready.json"
        self.fault_file = workdir / "faults.json"
        self.log = workdir / "serve-pair.log"
        self.argv = [
            sys.executable,
            "-m",
            "kvtool.cli",
            "serve-pair",
            "--roles",
            roles,
            "--ready-file",
            str(self.ready_file),
            "--log-dir",
            str(workdir / "logs"),
            "--startup-timeout",
            str(STARTUP_TIMEOUT_S - 20),
        ]
        for flag in ("producer", "consumer", "master", "admin"):
            self.argv += [f"--{flag}-port", str(find_free_port())]
        self.process: subprocess.Popen | None = None
        self.info: dict[str, Any] = {}

    def start(self) -> dict[str, Any]:
        env = {**os.environ, "KVTOOL_FAULT_CONTROL_FILE": str(self.fault_file)}
        self.process = subprocess.Popen(
            self.argv,
            cwd=REPO,
            env=env,
            start_new_session=True,
            stdout=open(self.log, "wb"),
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not self.ready_file.exists():
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(
                    f"serve-pair --roles {self.roles} did not start; see {self.log}:\n{log_tail(self.log)}"
                )
            time.sleep(0.5)
        self.info = self.ready()
        return self.info

    def ready(self) -> dict[str, Any]:
        for _ in range(50):
            try:
                return json.loads(self.ready_file.read_text())
            except (OSError, ValueError):
                time.sleep(0.1)  # written atomically, but removed on exit
        raise RuntimeError(f"cannot read {self.ready_file}")

    def master_healthy(self) -> bool:
        try:
            return httpx.get(f"{self.info['admin']}/health", timeout=1.0).status_code == 200
        except httpx.HTTPError:
            return False

    def key_exists(self, key: str) -> bool | None:
        """None when the admin port does not answer (the master is down or frozen)."""
        try:
            answer = httpx.get(f"{self.info['admin']}/query_key?key={key}", timeout=1.0)
        except httpx.HTTPError:
            return None
        try:
            return answer.status_code == 200 and bool(answer.json().get("success"))
        except ValueError:
            return None

    def set_faults(self, plan: dict | None) -> None:
        if plan is None:
            self.fault_file.unlink(missing_ok=True)
            return
        staging = self.fault_file.with_suffix(".tmp")
        staging.write_text(json.dumps(plan))
        os.replace(staging, self.fault_file)

    def engine_log(self, engine: str) -> Path:
        return Path(self.info["log_dir"]) / f"{engine}.log"

    def stop(self) -> int | None:
        self.set_faults(None)
        if self.process is None or self.process.poll() is not None:
            return None if self.process is None else self.process.returncode
        self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)  # its own session: only what this script started
            return self.process.wait(timeout=30)


# ---- master kills and freezes ---------------------------------------------------------------------


@dataclass
class MasterEvent:
    kind: str  # "kill" or "freeze"
    iteration: int
    freeze_s: float = 0.0
    old_pid: int | None = None
    new_pid: int | None = None
    down_at: float | None = None  # monotonic
    back_at: float | None = None
    replaced: bool = False
    note: str = ""

    def covers(self, start: float, end: float) -> bool:
        """Did a request spanning [start, end] run while this master was down or frozen?"""
        if self.down_at is None:
            return False
        back = self.back_at if self.back_at is not None else float("inf")
        return start < back and end > self.down_at


class MasterAction(threading.Thread):
    """Kill or freeze the master a moment after an iteration starts, then wait until one is healthy."""

    def __init__(self, pair: Pair, event: MasterEvent, delay_s: float) -> None:
        super().__init__(name=f"master-{event.kind}", daemon=True)
        self.pair, self.event, self.delay_s = pair, event, delay_s
        self.stopped_pid: int | None = None  # SIGSTOPped and not yet SIGCONTinued

    def run(self) -> None:
        try:
            self._act()
        except Exception as exc:  # noqa: BLE001 - reported in the results, never silently lost
            self.event.note += f" the soak's {self.event.kind} thread failed: {exc!r}"
            if self.event.down_at is not None and self.event.back_at is None:
                self.event.back_at = time.monotonic()

    def _act(self) -> None:
        event, pair = self.event, self.pair
        time.sleep(self.delay_s)
        pid = pair.ready()["master_pid"]
        event.old_pid = pid
        try:
            if event.kind == "kill":
                os.kill(pid, signal.SIGKILL)
                event.down_at = time.monotonic()
            else:
                os.kill(pid, signal.SIGSTOP)
                self.stopped_pid = pid
                event.down_at = time.monotonic()
                until = event.down_at + event.freeze_s
                while time.monotonic() < until and is_running_master(pid):
                    time.sleep(0.1)
                if is_running_master(pid):
                    os.kill(pid, signal.SIGCONT)
                else:
                    event.replaced = True  # serve-pair SIGKILLed it (a stopped process dies of SIGKILL too)
        except ProcessLookupError:
            event.note = f"master {pid} was already gone"
        finally:
            self.stopped_pid = None
        expect_new = event.kind == "kill" or event.replaced
        deadline = time.monotonic() + MASTER_BACK_TIMEOUT_S
        while time.monotonic() < deadline:
            current = pair.ready()["master_pid"]
            if (current != pid or not expect_new) and pair.master_healthy():
                event.new_pid = current
                event.replaced = event.replaced or current != pid
                event.back_at = time.monotonic()
                return
            time.sleep(0.1)
        event.note += f" no healthy master {MASTER_BACK_TIMEOUT_S:.0f} s after the {event.kind}"

    def release(self) -> None:
        """Never leave a stopped master behind (on an early exit)."""
        if self.stopped_pid is not None:
            try:
                os.kill(self.stopped_pid, signal.SIGCONT)
            except ProcessLookupError:
                pass


def is_running_master(pid: int) -> bool:
    try:
        return b"mooncake_master" in Path(f"/proc/{pid}/cmdline").read_bytes()  # empty for a zombie
    except OSError:
        return False


def plan_events(iterations: int, kills: int, freezes: int, freeze_seconds: list[float]) -> dict[int, MasterEvent]:
    """Kills and freezes alternating at evenly spread iterations (none in the first or last stretch)."""
    kinds = []
    for index in range(max(kills, freezes)):
        if index < kills:
            kinds.append("kill")
        if index < freezes:
            kinds.append("freeze")
    events: dict[int, MasterEvent] = {}
    freezes_planned = 0
    for index, kind in enumerate(kinds):
        iteration = round((index + 1) * iterations / (len(kinds) + 1))
        seconds = 0.0
        if kind == "freeze":
            seconds = freeze_seconds[freezes_planned % len(freeze_seconds)]
            freezes_planned += 1
        events[iteration] = MasterEvent(kind, iteration, seconds)
    return events


# ---- one pair's soak ------------------------------------------------------------------------------


class RequestFailed(Exception):
    def __init__(self, record: dict[str, Any]) -> None:
        super().__init__(record["what"])
        self.record = record


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
    final_ready: dict[str, Any] = field(default_factory=dict)

    @property
    def model(self) -> str:
        return self.pair.info["model"]

    def now_s(self) -> float:
        return round(time.monotonic() - self.started, 2)

    def active_event(self, start: float, end: float) -> str | None:
        hit = [e for e in self.events if e.covers(start, end)]
        return f"master {hit[-1].kind} at iteration {hit[-1].iteration}" if hit else None

    def send(self, engine: str, purpose: str, prompt: list[int], max_tokens: int, reference: bool = False) -> dict:
        began = time.monotonic()
        try:
            answer = complete(
                self.pair.info[engine],
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
                    "log_excerpt": self.log_excerpt(engine),
                    "timed_out": timed_out,
                }
            ) from None
        ended = time.monotonic()
        self.timeline.append((began, ended, engine, purpose))
        self.requests[purpose] += 1
        answer["soak_span"] = (began, ended)
        return answer

    def log_excerpt(self, engine: str) -> dict[str, str]:
        excerpt = {engine: log_tail(self.pair.engine_log(engine), 40)}
        supervisor = Path(self.pair.info["log_dir"]) / "supervisor.log"
        if supervisor.exists():
            excerpt["supervisor"] = log_tail(supervisor, 10)
        return excerpt

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
                "log_excerpt": self.log_excerpt(engine),
            }
        )
        print(
            f"MISMATCH {self.pair.roles} iteration {self.iteration} {engine} {purpose}: {comparison.reason}", flush=True
        )

    def master_event_since(self, since: float) -> bool:
        """Was the master down or frozen at any time after ``since`` (or is it now)?"""
        return any(e.down_at is not None and (e.back_at is None or e.back_at > since) for e in self.events)

    def wait_save(self, engine: str, details: HitDetails | None, began: float) -> None:
        """Wait (bounded) for a save's final watermark record, so the next request can load it.

        A save the circuit breaker skipped writes no record at all, and one whose final put failed
        writes only its pending record (seq 0): neither is waited for. Not a hang either way (the
        request was answered); check_save_pipelines proves the put threads still end saves."""
        if details is None or not details.watermark_key:
            self.saves[f"{engine}_nothing_to_save"] += 1
            return
        final = details.watermark_key
        pending = final.rsplit("/", 1)[0] + "/0"
        slow = self.fault in ("slow_store", "save_in_flight")
        start_grace = 6.0 if slow else 0.5  # under slow_store the pending record's own put takes 2.5 s
        limit = SLOW_SAVE_WAIT_S if slow else SAVE_WAIT_S
        waited_from = time.monotonic()
        started = False
        while True:
            if self.pair.key_exists(final):
                self.saves[f"{engine}_ended"] += 1
                return
            # Reconnection and the breaker's back-off follow a master outage by several seconds.
            if self.master_event_since(began - 15.0) and time.monotonic() - waited_from > 0.5:
                self.saves[f"{engine}_not_seen_master_event"] += 1  # lost with the master, or never written
                return
            started = started or bool(self.pair.key_exists(pending))
            elapsed = time.monotonic() - waited_from
            if not started and elapsed > start_grace:
                self.saves[f"{engine}_not_started_{self.fault or 'no_fault'}"] += 1  # skipped by the breaker
                return
            if elapsed > limit:
                self.saves[f"{engine}_not_ended_{self.fault or 'no_fault'}"] += 1
                return
            time.sleep(0.05)

    def draw_fault(self) -> str | None:
        if self.rng.random() >= self.args.fault_rate:
            return None
        kinds = list(FAULTS)
        return self.rng.choices(kinds, weights=[FAULT_WEIGHTS.get(k, 1.0) for k in kinds])[0]

    def check_save_pipelines(self, when: str) -> None:
        """With faults off, every saving engine must end a fresh save within PIPELINE_CHECK_S.

        A put thread stuck on a hung store would never end one again: that is a stall (a hang)."""
        self.pair.set_faults(None)
        engines = ["producer", "consumer"] if self.pair.roles == "both" else ["producer"]
        for engine in engines:
            deadline = time.monotonic() + PIPELINE_CHECK_S
            tries = 0
            while True:
                tries += 1
                prompt = tokens(self.rng, 40, 120)
                try:
                    answer = self.send(engine, "pipeline_check", prompt, 1)
                except RequestFailed as failed:
                    self.record_failure(failed.record)
                    break
                details = HitDetails.from_response(answer)
                key = details.watermark_key if details else None
                ended = False
                wait_until = min(deadline, time.monotonic() + 5)
                while key and time.monotonic() < wait_until:
                    if self.pair.key_exists(key):
                        ended = True
                        break
                    time.sleep(0.1)
                if ended:
                    break
                if time.monotonic() > deadline:
                    self.hangs.append(
                        {
                            "iteration": self.iteration,
                            "at_s": self.now_s(),
                            "engine": engine,
                            "what": f"{when}: no save ended within {PIPELINE_CHECK_S:.0f} s with faults off "
                            f"({tries} tries)",
                            "log_excerpt": self.log_excerpt(engine),
                        }
                    )
                    break
                time.sleep(1.0)

    def record_failure(self, record: dict[str, Any]) -> None:
        (self.hangs if record.pop("timed_out") else self.errors).append(record)
        print(f"FAILED {self.pair.roles} iteration {self.iteration}: {record['what']}", flush=True)

    # -- one iteration --------------------------------------------------------------------------

    def one_iteration(self, published: list[list[int]]) -> None:
        both = self.pair.roles == "both"
        rng = self.rng
        # Half the prompts extend one published before (hits across blocks and tails).
        if published and rng.random() < 0.5:
            base = list(rng.choice(published)) + tokens(rng, 0, 40)
            if len(base) > MAX_PROMPT_TOKENS:
                base = tokens(rng, 2, 140)
        else:
            base = tokens(rng, 2, 140)
        continuation = base + tokens(rng, 1, 20)
        shared = None
        if both and rng.random() < self.args.shared_prefix_rate:
            # The consumer publishes the continuation; the producer then asks for a prompt sharing
            # all of it (a tail hit) or a part of it that reaches past its own base (block hits).
            if rng.random() < 0.7:
                cut = len(continuation)
            else:
                cut = rng.randrange(len(base), len(continuation) + 1)
            shared = continuation[:cut] + tokens(rng, 1, 20)
        plan = FAULTS[self.fault] if self.fault else None

        began = time.monotonic()
        self.pair.set_faults(plan)
        answer = self.send("producer", "producer", base, 1)
        details = self.note_hit("producer", answer)
        self.wait_save("producer", details, began)
        published.append(base)
        if both:
            self.verify("producer", "producer", base, answer, 1)
            self.pair.set_faults(plan)

        began = time.monotonic()
        reused = self.send("consumer", "consumer", continuation, 4)
        consumer_details = self.note_hit("consumer", reused)
        if both:
            self.wait_save("consumer", consumer_details, began)
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
                self.fault = self.draw_fault()
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
            self.check_save_pipelines("after the run")
            self.final_ready = self.pair.ready()  # serve-pair removes it when it stops
        finally:
            for action in actions:
                action.release()
            self.pair.set_faults(None)

    # -- report ---------------------------------------------------------------------------------

    def event_report(self, event: MasterEvent) -> dict[str, Any]:
        during = [(s, e, engine, purpose) for s, e, engine, purpose in self.timeline if event.covers(s, e)]
        answered_inside = [
            1
            for s, e, *_ in during
            if event.down_at is not None and event.back_at is not None and event.down_at <= e <= event.back_at
        ]
        return {
            "kind": event.kind,
            "iteration": event.iteration,
            "freeze_s": event.freeze_s if event.kind == "freeze" else None,
            "old_pid": event.old_pid,
            "new_pid": event.new_pid,
            "replaced": event.replaced,
            "at_s": round(event.down_at - self.started, 2) if event.down_at else None,
            "down_s": round(event.back_at - event.down_at, 2) if event.down_at and event.back_at else None,
            "requests_in_flight_while_down": len(during),
            "requests_answered_while_down": len(answered_inside),
            "slowest_request_while_down_s": round(max((e - s for s, e, *_ in during), default=0.0), 2),
            "note": event.note.strip(),
        }

    def report(self, wall_s: float) -> dict[str, Any]:
        events = [self.event_report(e) for e in self.events]
        latencies = sorted(e - s for s, e, *_ in self.timeline)
        final = self.final_ready
        return {
            "roles": self.pair.roles,
            "kv_roles": {"producer": "kv_both", "consumer": "kv_both"}
            if self.pair.roles == "both"
            else {"producer": "kv_producer", "consumer": "kv_consumer"},
            "command": " ".join(["kvtool", *self.pair.argv[3:]]),
            "iterations": self.args.iterations,
            "requests_served": dict(self.requests),
            "requests_total": sum(self.requests.values()),
            "answers_verified": self.verified,
            "faults_injected": dict(self.faults),
            "master_kills": sum(e.kind == "kill" for e in self.events),
            "master_freezes": sum(e.kind == "freeze" for e in self.events),
            "master_replaced_while_frozen": sum(e.kind == "freeze" and e.replaced for e in self.events),
            "master_restarts_by_serve_pair": (final.get("restarts") or {}).get("master"),
            "requests_in_flight_while_master_down": sum(e["requests_in_flight_while_down"] for e in events),
            "requests_answered_while_master_down": sum(e["requests_answered_while_down"] for e in events),
            "master_events": events,
            "outcomes": dict(sorted(self.outcomes.items())),
            "saves": dict(sorted(self.saves.items())),
            "mismatches": len(self.mismatches),
            "hangs": len(self.hangs),
            "errors": len(self.errors),
            "worst_logprob_diff_of_matches": self.worst_logprob_diff,
            "latency_s": {
                "p50": round(latencies[len(latencies) // 2], 3) if latencies else None,
                "p99": round(latencies[int(len(latencies) * 0.99)], 3) if latencies else None,
                "max": round(latencies[-1], 3) if latencies else None,
            },
            "mismatch_list": self.mismatches,
            "hang_list": self.hangs,
            "error_list": self.errors,
            "log_dir": self.pair.info.get("log_dir"),
            "wall_s": round(wall_s, 1),
        }


# ---- main -----------------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=300, help="iterations per pair")
    parser.add_argument("--roles", default="pd,both", help="pairs to run, one after another")
    parser.add_argument("--fault-rate", type=float, default=0.4, help="share of iterations run under a fault")
    parser.add_argument(
        "--shared-prefix-rate",
        type=float,
        default=0.5,
        help="both: share of iterations that send the producer a prompt sharing the consumer's just-published prefix",
    )
    parser.add_argument("--kills", type=int, default=2, help="master SIGKILLs per pair")
    parser.add_argument("--freezes", type=int, default=2, help="master SIGSTOPs per pair")
    parser.add_argument("--freeze-seconds", default="3,8", help="how long each freeze lasts, cycled")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "soak" / "results.json")
    args = parser.parse_args()
    args.roles_list = [r.strip() for r in args.roles.split(",") if r.strip()]
    if not args.roles_list or any(r not in ("pd", "both") for r in args.roles_list):
        parser.error("--roles: a comma-separated list of pd and both")
    args.freeze_list = [float(s) for s in args.freeze_seconds.split(",")]
    return args


def main() -> int:
    args = parse_args()
    began = time.monotonic()
    reports: dict[str, dict] = {}
    pair_info: dict[str, Any] = {}
    for roles in args.roles_list:
        workdir = Path(tempfile.mkdtemp(prefix=f"kvtool-soak-{roles}-"))
        pair = Pair(workdir, roles)
        print(f"starting serve-pair --roles {roles} (logs in {workdir})", flush=True)
        soak = None
        try:
            info = pair.start()
            pair_info = info
            print(f"pair ready: {info['producer']} {info['consumer']} master {info['master']}", flush=True)
            soak = PairSoak(pair, args, random.Random(f"{args.seed}:{roles}"))
            events = plan_events(args.iterations, args.kills, args.freezes, args.freeze_list)
            soak.run(events, roles)
        finally:
            code = pair.stop()
            print(f"serve-pair --roles {roles} stopped (exit {code})", flush=True)
        reports[roles] = soak.report(time.monotonic() - soak.started)
        brief = {k: reports[roles][k] for k in ("requests_total", "mismatches", "hangs", "errors", "wall_s")}
        print(f"{roles}: {json.dumps(brief)}", flush=True)

    result = {
        "command": " ".join(["python", "benchmarks/soak/soak.py", *sys.argv[1:]]),
        "config": {
            "iterations_per_pair": args.iterations,
            "pairs": args.roles_list,
            "fault_rate": args.fault_rate,
            "shared_prefix_rate": args.shared_prefix_rate,
            "master_kills_per_pair": args.kills,
            "master_freezes_per_pair": args.freezes,
            "freeze_seconds": args.freeze_list,
            "seed": args.seed,
            "model": pair_info.get("model"),
            "block_size": pair_info.get("block_size"),
            "hash_unit": pair_info.get("hash_unit"),
            "logprob_tolerance": DEFAULT_LOGPROB_TOLERANCE,
            "request_timeout_s": REQUEST_TIMEOUT_S,
            "save_wait_s": {"default": SAVE_WAIT_S, "slow_store_or_save_in_flight": SLOW_SAVE_WAIT_S},
            "pipeline_check_s": PIPELINE_CHECK_S,
            "fault_plans": FAULTS,
            "fault_weights": FAULT_WEIGHTS,
        },
        "requests_total": sum(r["requests_total"] for r in reports.values()),
        "faults_injected": dict(sum((Counter(r["faults_injected"]) for r in reports.values()), Counter())),
        "master_kills": sum(r["master_kills"] for r in reports.values()),
        "master_freezes": sum(r["master_freezes"] for r in reports.values()),
        "mismatches": sum(r["mismatches"] for r in reports.values()),
        "hangs": sum(r["hangs"] for r in reports.values()),
        "errors": sum(r["errors"] for r in reports.values()),
        "pairs": reports,
        "wall_s": round(time.monotonic() - began, 1),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    summary = {
        k: result[k]
        for k in ("requests_total", "master_kills", "master_freezes", "mismatches", "hangs", "errors", "wall_s")
    }
    print(json.dumps(summary))
    return 1 if result["mismatches"] or result["hangs"] or result["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
