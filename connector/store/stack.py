"""The one place a store stack is built: what the engine's two sides, ``kvtool inspect`` and the
benchmarks use, from the backend up.

From the bottom: the backend (``backends.BACKENDS``, one client per process and configuration for the
engine's sides), fault injection where a test asks for it, each key once per batch, time-outs
(``store.open_store``); then, for an engine's side, the breaker (``breaker.GuardedStore``: a failing or
slow store is skipped, its calls answered as misses) and the counters (``instrumented``). A backend
that cannot be reached at start-up is, for an engine, a ``LateStore`` that keeps trying in the
background while the engine serves without it; for a reader (``kvtool inspect``), one sentence.

The roles: ``scheduler`` (lookups: lends no memory, its calls judged slow past ``slow_call_ms``),
``worker`` (loads and saves: lends the segment, more calls at once, sized by its objects so not judged
slow) and ``reader`` (a tool's one-off reads: lends nothing, no breaker).
"""

from __future__ import annotations

import logging
from functools import partial
from typing import Literal

from .breaker import BreakerPolicy, CircuitBreaker, GuardedStore
from ..config import KVToolConfig
from .instrumented import InstrumentedStore
from .latestore import LateStore
from .backends import BACKENDS
from .store import CALL_THREADS, KVStore, StoreError, TimedStore, open_store

logger = logging.getLogger("vllm.kvtool")

StoreRole = Literal["scheduler", "worker", "reader"]
# The worker's store calls at once: each of the loader's fetch threads (``loader.LOAD_THREADS``, 4), the
# put thread's, and a spare for a call abandoned at its time-out. With fewer, a busy but healthy store
# refused the put thread's call while four loads transferred, and that refusal opened the breaker
# (``store.CALL_THREADS``). A test holds it to the loader's count.
WORKER_STORE_CALLS = 4 + 2


def breaker_policy(config: KVToolConfig) -> BreakerPolicy:
    return BreakerPolicy(config.breaker_failures, config.breaker_backoff_s, config.breaker_max_backoff_s)


def probe(config: KVToolConfig) -> str | None:
    """The backend's own check that its client can be set up (``Backend.probe``): None, or why not."""
    check = BACKENDS[config.store_backend].probe
    return check(config) if check is not None else None


def lending_nothing(config: KVToolConfig) -> KVToolConfig:
    """``config`` for a client that lends the store no memory (a scheduler side, a tool)."""
    return config.model_copy(update={"backend": BACKENDS[config.store_backend].lending_nothing(config.backend)})


def open_reader(config: KVToolConfig) -> TimedStore:
    """A tool's store: probed first (a client's setup can stall its caller), lending nothing; a
    ``StoreError`` saying why when it cannot be reached."""
    config = lending_nothing(config)
    why = probe(config)
    if why is not None:
        raise StoreError(why)
    return open_store(config)


def open_store_stack(
    config: KVToolConfig, role: StoreRole, breaker: CircuitBreaker | None = None
) -> InstrumentedStore | TimedStore:
    """The store stack of ``role`` (the module's docstring); an engine side's breaker is ``breaker``,
    which both sides of one connector share, or a new one. Never raises for an engine's side: a store
    that cannot be reached is tried again in the background."""
    if role == "reader":
        return open_reader(config)
    worker = role == "worker"
    config = config if worker else lending_nothing(config)  # only the worker lends
    calls = WORKER_STORE_CALLS if worker else CALL_THREADS
    opener = partial(open_store, config, shared=True, call_threads=calls)
    checked = partial(probe, config)
    backend: KVStore
    try:
        why = checked()
        if why is not None:
            raise StoreError(why)
        backend = opener()
    except StoreError as exc:
        what = BACKENDS[config.store_backend].describe(config.backend)
        logger.warning(
            "kvtool: %s is unavailable (%s); serving without the connector's help until it answers (tried "
            "again in the background)",
            what,
            exc,
        )
        backend = LateStore(opener, checked, what=what)
    # A lookup answered slowly costs every request its latency: the scheduler side's calls count as
    # failed past slow_call_ms (the worker's loads and puts are sized by their objects, not judged so).
    slow_s = None if worker else config.slow_call_ms / 1000
    guarded = GuardedStore(backend, breaker or CircuitBreaker(breaker_policy(config)), role, slow_call_s=slow_s)
    return InstrumentedStore(guarded)  # counted outside the breaker: a call's time is what its caller waited
