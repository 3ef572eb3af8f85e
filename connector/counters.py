"""Named counts a component keeps for the metrics exporter, and warnings said once.

Every component that counts (scheduler side, worker, saver, breaker) holds one ``Counters``: ``add``
from any thread, ``take`` (the counts so far, then zero again) from the exporter (``metrics.py``).
"""

from __future__ import annotations

import logging
import threading
from collections import Counter


class Counters:
    """Thread-safe named counts; ``take`` returns them and starts again from zero."""

    def __init__(self) -> None:
        self._counts: Counter[str] = Counter()
        self._lock = threading.Lock()

    def add(self, name: str, amount: int = 1) -> None:
        with self._lock:
            self._counts[name] += amount

    def __getitem__(self, name: str) -> int:
        with self._lock:
            return self._counts[name]

    def get(self, name: str, default: int = 0) -> int:
        with self._lock:
            return self._counts.get(name, default)

    def take(self) -> dict[str, int]:
        with self._lock:
            taken, self._counts = dict(self._counts), Counter()
        return taken


class WarnOnce:
    """``warn(topic, message)`` logs a warning the first time a topic comes up, never again: a store that
    fails every call says so once, not once a step."""

    def __init__(self, logger: logging.Logger) -> None:
        self._logger = logger
        self._said: set[str] = set()

    def __call__(self, topic: str, message: str) -> None:
        if topic not in self._said:
            self._said.add(topic)
            self._logger.warning(message)
