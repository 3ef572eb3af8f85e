"""Where a request's first step went: when the connector saw it, answered its lookup, sent its load, got
the load back, and when vLLM first computed it, in milliseconds and in scheduler steps since it was seen.

A hit that waits steps is a hit whose time to first token grows by those steps' forwards; the timeline
is how an operator (``kvtool inspect``, the request log) and the benchmarks see where that time went."""

from __future__ import annotations

from dataclasses import dataclass, field

# In the order a hit passes them; a miss has only "answered" and "computing". "arrived" (vLLM's
# arrival time: the API server took the request) is before "seen", so negative; "finished" is when the
# request ended, its answer whole.
MARKS = ("arrived", "answered", "load_sent", "load_done", "computing", "finished")


@dataclass
class Timeline:
    seen_s: float
    seen_step: int
    marks: dict[str, tuple[float, int]] = field(default_factory=dict)

    @classmethod
    def start(cls, now_s: float, step: int, arrived_ago_s: float | None) -> Timeline:
        timeline = cls(now_s, step)
        if arrived_ago_s is not None and arrived_ago_s >= 0:
            timeline.marks["arrived"] = (now_s - arrived_ago_s, step)
        return timeline

    def mark(self, name: str, now_s: float, step: int) -> None:
        """The first time the request passes ``name``; later passes (a resumed request) keep the first."""
        self.marks.setdefault(name, (now_s, step))

    def to_dict(self) -> dict[str, list[float]]:
        """``{mark: [ms since seen, steps since seen]}`` in pass order."""
        return {
            name: [round((self.marks[name][0] - self.seen_s) * 1000.0, 3), self.marks[name][1] - self.seen_step]
            for name in MARKS
            if name in self.marks
        }
