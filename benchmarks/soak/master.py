"""Master kills and freezes: when they happen, the thread that does them, and how long the master is down."""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from pair import Pair

MASTER_BACK_TIMEOUT_S = 90.0


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
        pid = pair.ready().master_pid
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
            current = pair.ready().master_pid
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
