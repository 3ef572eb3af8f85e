"""Why the store refused a put for space: it is full, or it is not ready.

Mooncake answers "no space" (-200) both when its segments are full and when it has no segment at all:
a master that restarted has lost every key and every mounted segment, and refuses every put until the
engines' clients mount their segments on it again (about a second to a few seconds after it answers,
docs/operators-guide.md). Those refusals are not a full store: they are counted as ``not_ready``, and
logged as such. The telling sign is that the store no longer holds the last object this process
stored (a full store evicts its least recently used objects first, and the newest last); the check is one
existence query, made at most once a ``recheck_s`` while puts are refused, on the put thread.

Thread-safety: one ``Refusals`` per saver, used from its put thread only.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from .backend import PutOutcome
from ..calls import StoreError

logger = logging.getLogger("vllm.kvtool")

RECHECK_S = 1.0  # a verdict holds this long while puts keep being refused
LOG_EVERY_S = 60.0  # an episode of refusals is logged at most this often, per kind


class Refusals:
    """Judges puts refused for space (``judge``) from what the store still holds, and logs each
    episode of refusals once: when it starts, and when a put is taken again (``stored``)."""

    def __init__(
        self,
        exists: Callable[[list[str]], list[bool]],
        clock: Callable[[], float] = time.monotonic,
        recheck_s: float = RECHECK_S,
    ):
        self._exists = exists
        self._clock = clock
        self._recheck_s = recheck_s
        self._last_stored: str | None = None  # the newest key this process stored
        self._verdict: tuple[float, PutOutcome] | None = None  # (when judged, the verdict)
        self._episode: tuple[float, PutOutcome] | None = None  # (when it began, its kind)
        self._refused = 0  # puts refused in this episode
        self._logged_at: dict[PutOutcome, float] = {}

    def stored(self, key: str) -> None:
        """A put was taken: the episode of refusals, if any, ends."""
        self._last_stored = key
        self._verdict = None
        if self._episode is not None:
            began, kind = self._episode
            self._episode = None
            if kind is PutOutcome.NOT_READY:
                logger.warning(
                    "kvtool: the store takes puts again after %.1f s not ready (%d puts refused meanwhile)",
                    self._clock() - began,
                    self._refused,
                )
            self._refused = 0

    def judge(self, refused: int = 1) -> PutOutcome:
        """``NO_SPACE`` (the store is full) or ``NOT_READY`` (it lost what it held: restarted, its
        segments not mounted yet) for ``refused`` puts just refused for space."""
        now = self._clock()
        if self._verdict is None or now - self._verdict[0] > self._recheck_s:
            self._verdict = (now, self._check())
        kind = self._verdict[1]
        if self._episode is None or self._episode[1] is not kind:
            self._episode = (now, kind)
            self._say(kind, now)
        self._refused += refused
        return kind

    def _check(self) -> PutOutcome:
        if self._last_stored is None:
            return PutOutcome.NO_SPACE  # nothing stored yet to tell by
        try:
            (held,) = self._exists([self._last_stored])
        except StoreError:
            return PutOutcome.NOT_READY  # it does not even answer
        return PutOutcome.NO_SPACE if held else PutOutcome.NOT_READY

    def _say(self, kind: PutOutcome, now: float) -> None:
        said = self._logged_at.get(kind)
        if said is not None and now - said < LOG_EVERY_S:
            return
        self._logged_at[kind] = now
        if kind is PutOutcome.NOT_READY:
            logger.warning(
                "kvtool: the store refuses puts and no longer holds what this engine stored: a restarted "
                "master whose segments are not mounted yet; puts are dropped (counted not_ready) until it "
                "takes them"
            )
        else:
            logger.warning("kvtool: the store is full; puts are dropped until it evicts")
