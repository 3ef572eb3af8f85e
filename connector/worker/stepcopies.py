"""A step's save copies off the engine thread, finished before vLLM can touch a block again.

A save copies its blocks out of the KV cache in the step that computed them: a later step may free
and reuse them (a finished request's, a preempted one's). On the CPU that copy was made on the engine's
thread, before the step's output went back to the scheduler, so it sat in every saved request's
latency (a 1k-token prompt of the bench model: 25 MB). vLLM 0.32 calls the connector's
``handle_preemptions`` at the very start of every ``execute_model``, before it applies the next
scheduler output (copy-on-write block copies included), runs a forward or lets the connector start a
load; nothing writes a block between a step's ``wait_for_save`` and that hook. So the copies run on a
thread of their own while the step's output goes back, and ``settle`` (called from that hook) waits
for them: an idle engine answers sooner, a busy one waits at the next step for what it would have
waited for at the end of this one.

Until the hook has been seen once (another vLLM version might not call it), copies are made on the
engine's thread as before: never a copy that a later step could race. Nor under vLLM's V2 model runner
(``deferrable=False``; vLLM picks it wherever Triton runs, triton-cpu included): it calls the hook inside
``pre_forward``, after ``update_requests`` has zeroed newly allocated blocks and applied copy-on-write
block copies, so a block freed in one step could be written in the next before its copy read it.
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Callable

logger = logging.getLogger("vllm.kvtool")


class StepCopies:
    def __init__(self, deferrable: bool = True) -> None:
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._pending: concurrent.futures.Future[None] | None = None
        self.hooked = False  # the engine called ``settle`` at a step's start: copies may be deferred
        self._deferrable = deferrable  # the hook comes before anything writes a block (vLLM's V1 runner)
        self._closed = False

    def run(self, copies: Callable[[], None]) -> bool:
        """Make the step's copies: on the copy thread when the next step's hook will wait for them,
        else now. Call from the engine's thread. Returns whether they were deferred."""
        if not self.hooked or not self._deferrable or self._closed:
            copies()
            return False
        self.settle()  # one step's copies at a time
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvtool-copy")
        self._pending = self._executor.submit(copies)
        return True

    def settle(self) -> None:
        """Wait for the last step's copies (the next step's first hook, before vLLM touches a block)."""
        self.hooked = True
        pending, self._pending = self._pending, None
        if pending is None:
            return
        try:
            pending.result()
        except Exception:  # noqa: BLE001 - ``copies`` gives back what it took; a bug costs its saves only
            logger.exception("kvtool: a step's save copies failed; those saves are dropped")

    def shutdown(self) -> None:
        self._closed = True  # a save after this is copied on the caller's thread
        self.settle()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
