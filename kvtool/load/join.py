"""An engine added to a fleet while a load test runs on it, and TTFT while it joins and after.

``--add-engine-after S`` asks the fleet for one engine more S seconds into the load, as ``kvtool scale``
does (``kvtool.pair.scale``: the request in the fleet's log directory). ``JoinWatch`` polls the router's
worker list from the load's start, so the phases are the router's own view: ``before`` (the fleet as
started), ``joining`` (from the request until a new engine is in the rotation: started, healthy and
warm with the store) and ``joined``. Each phase's requests, by when they were sent, get their own TTFT
percentiles (``join_phases``, pure).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from kvtool.errors import UserError
from kvtool.pair.ready import ReadyFile
from kvtool.pair.router import RouterWorkers
from kvtool.pair.scale import write_scale_request

from .churn import ListWatch, three_phases
from .metrics import RequestRecord


@dataclass(frozen=True)
class Join:
    """What happened to the engine asked for, in seconds from the load's start (None: not seen)."""

    engines_before: int
    asked_s: float | None = None
    joined_s: float | None = None  # first seen in the router's list
    url: str | None = None  # the engine that joined

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


def fleet_to_grow(info: ReadyFile) -> tuple[Path, int]:
    """Where ``--add-engine-after`` asks (the fleet's log directory) and the engines serving; a
    UserError where the pair is no fleet."""
    if info.router is None or info.log_dir is None:
        raise UserError(
            "--add-engine-after needs a fleet (serve-pair --engines N, or --launch with --engines N): one engine is "
            "added to it while the load runs"
        )
    return Path(info.log_dir), len(info.engines)


class JoinWatch(ListWatch):
    """Asks for the engine at ``add_after_s`` and sees a new one in the router's list."""

    def __init__(
        self,
        router: RouterWorkers,
        log_dir: Path,
        engines_before: int,
        add_after_s: float,
        clock: Callable[[], float] = time.monotonic,
        ask: Callable[[Path, int], object] = write_scale_request,
    ) -> None:
        super().__init__(router, clock)
        self.log_dir = log_dir
        self.add_after_s = add_after_s
        self.ask = ask
        self._join = Join(engines_before)
        self._known: set[str] | None = None  # the router's list at the load's start

    def start(self) -> JoinWatch:
        """From now on: the load's start (the router's list now is what a new engine is new to)."""
        self._known = self.router.urls()
        super().start()
        return self

    def observe(self, now_s: float, urls: set[str] | None) -> None:
        """One poll at ``now_s``: the request when due, then whether a new engine is in the list."""
        join, at = self._join, round(now_s, 3)
        if self._known is None:
            self._known = urls
        elif join.asked_s is None and now_s >= self.add_after_s:
            self.ask(self.log_dir, join.engines_before + 1)
            self._join = replace(join, asked_s=at)
        elif join.asked_s is not None and join.joined_s is None and urls is not None:
            new = sorted(urls - self._known)
            if new:
                self._join = replace(join, joined_s=at, url=new[0])

    @property
    def join(self) -> Join:
        return self._join

    def stop(self) -> Join:
        self.halt()
        return self._join


def join_phases(records: Sequence[RequestRecord], join: Join, slo_ttft_ms: float | None) -> list[dict[str, Any]]:
    """The requests of each phase (``before``, ``joining``, ``joined``) by when they were sent, with
    their count, failures and TTFT percentiles; a phase with no request is left out."""
    return three_phases(records, ("before", "joining", "joined"), join.asked_s, join.joined_s, slo_ttft_ms)


def join_note(join: Join) -> str:
    """When the engine was asked for and when it joined, in seconds into the load."""
    if join.asked_s is None:
        return "no engine was added: the load ended first (give a smaller --add-engine-after)"
    joined = (
        "not in the router's list before the load ended"
        if join.joined_s is None
        else (f"{join.url} in the router's list at {join.joined_s:g} s")
    )
    return f"engine {join.engines_before + 1} of the fleet asked for at {join.asked_s:g} s, {joined}"
