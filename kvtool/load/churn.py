"""An engine killed while a load test runs on a fleet, and TTFT while it is down and after it rejoins.

``--kill-engine-after S`` SIGKILLs one engine of the fleet (by its pid in the ready file: the engine and
its engine core at once) S seconds into the load. ``RotationWatch`` polls the router's worker list
(``/list_workers``) from the load's start, so the phases are the router's own view: ``before`` (every
engine serving), ``down`` (from the kill until the engine is back in the rotation: serve-pair took it
out, started it again and warmed it up, ``kvtool.pair.members``) and ``rejoined``. Each phase's
requests, by when they were sent, get their own TTFT percentiles (``phase_summaries``, pure).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from kvtool.errors import UserError
from kvtool.pair.ready import ReadyFile
from kvtool.pair.router import RouterWorkers

from .metrics import RequestRecord, summarize

POLL_S = 0.5


@dataclass(frozen=True)
class Churn:
    """What happened to the engine killed, in seconds from the load's start (None: not seen)."""

    engine: str
    url: str
    killed_s: float | None = None
    out_s: float | None = None  # first seen out of the router's list
    back_s: float | None = None  # first seen back in it after that

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


def victim(info: ReadyFile) -> tuple[str, str, int]:
    """The engine ``--kill-engine-after`` kills: the fleet's last one serving (name, URL, pid); a
    UserError where the pair is not a fleet of two engines or more."""
    serving = sorted(name for name in info.engines if name in info.pids)
    if info.router is None or len(serving) < 2:
        raise UserError(
            "--kill-engine-after needs a fleet of 2 engines or more serving (serve-pair --engines N, or --launch "
            "with --engines N): one is killed and the others serve on"
        )
    name = serving[-1]
    return name, info.engines[name], info.pids[name]


class ListWatch:
    """Polls the router's worker list on a thread from the load's start (``start``) until ``halt``;
    a subclass's ``observe`` is its rule (what to do when, what the list shows), tested without a thread."""

    def __init__(self, router: RouterWorkers, clock: Callable[[], float]) -> None:
        self.router = router
        self.clock = clock
        self._stop = threading.Event()
        self._began = clock()
        self._thread = threading.Thread(target=self._run, name=f"kvtool-{type(self).__name__}", daemon=True)

    def start(self) -> ListWatch:
        """From now on: the load's start."""
        self._began = self.clock()
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            self.observe(self.clock() - self._began, self.router.urls())

    def observe(self, now_s: float, urls: set[str] | None) -> None:
        raise NotImplementedError

    def halt(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(10)


class RotationWatch(ListWatch):
    """Kills the victim at ``kill_after_s`` and sees it leave the router's list and come back."""

    def __init__(
        self,
        router: RouterWorkers,
        engine: str,
        url: str,
        pid: int,
        kill_after_s: float,
        clock: Callable[[], float] = time.monotonic,
        kill: Callable[[int], None] = lambda pid: os.killpg(pid, signal.SIGKILL),
    ) -> None:
        super().__init__(router, clock)
        self.url = url
        self.pid = pid
        self.kill_after_s = kill_after_s
        self.kill = kill
        self._churn = Churn(engine, url)

    def observe(self, now_s: float, urls: set[str] | None) -> None:
        """One poll at ``now_s`` (the kill when due, then the victim's place in the list)."""
        churn, at = self._churn, round(now_s, 3)
        if churn.killed_s is None and now_s >= self.kill_after_s:
            try:
                self.kill(self.pid)
            except ProcessLookupError:
                pass  # it ended already: its phase starts now all the same
            self._churn = replace(churn, killed_s=at)
        elif churn.killed_s is not None and urls is not None:
            if churn.out_s is None and self.url not in urls:
                self._churn = replace(churn, out_s=at)
            elif churn.out_s is not None and churn.back_s is None and self.url in urls:
                self._churn = replace(churn, back_s=at)

    @property
    def churn(self) -> Churn:
        return self._churn

    def stop(self) -> Churn:
        self.halt()
        return self._churn


def phase_summaries(records: Sequence[RequestRecord], churn: Churn, slo_ttft_ms: float | None) -> list[dict[str, Any]]:
    """The requests of each phase (``before``, ``down``, ``rejoined``) by when they were sent, with
    their count, failures and TTFT percentiles; a phase with no request is left out."""
    return three_phases(records, ("before", "down", "rejoined"), churn.killed_s, churn.back_s, slo_ttft_ms)


def three_phases(
    records: Sequence[RequestRecord],
    names: tuple[str, str, str],
    first_s: float | None,
    second_s: float | None,
    slo_ttft_ms: float | None,
) -> list[dict[str, Any]]:
    """The requests sent before ``first_s``, between it and ``second_s``, and after (seconds into the
    load; None: not seen, so the phase before it runs to the end), each phase summarized."""
    first = first_s if first_s is not None else float("inf")
    second = second_s if second_s is not None else float("inf")
    bounds = [(names[0], 0.0, first), (names[1], first, second), (names[2], second, float("inf"))]
    phases = []
    for name, start, end in bounds:
        chosen = [record for record in records if start <= record.sent_s < end]
        if not chosen:
            continue
        summary = summarize(chosen, slo_ttft_ms)
        phases.append(
            {
                "phase": name,
                "from_s": round(start, 3),
                "to_s": None if end == float("inf") else round(end, 3),
                "requests": summary.requests,
                "failed": summary.failed,
                "ttft_ms": summary.ttft_ms,
                "hit_tokens": summary.hit_tokens,
                "ideal_tokens": summary.ideal_tokens,
            }
        )
    return phases
