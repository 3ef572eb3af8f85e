"""The request log: one JSON line per finished request, written off the engine's thread.

Each line is a request's hit details (``HitDetails.to_dict()``), its vLLM request id, and the
``kvtool_tag`` the client put in the request's ``kv_transfer_params`` (streamed responses carry no
``kv_transfer_params``, so a client attributes hits through this file).

The engine's thread only queues a record: a line's encoding, the file's checks and its write ran on that
thread before (0.13 ms of every finishing request's step, measured in a bench-model consumer), and a log
on a slow or hung disk would have held every step. A thread of its own writes the lines, in order. At
most ``MAX_QUEUED`` records wait: past that (a disk that stopped answering) records are dropped, counted
as ``request_log_dropped`` and said once. The file stays open between lines and is opened again when the
path no longer names it (rotated or removed); a write that fails stops the log, never a request.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
from typing import TYPE_CHECKING, Any, TextIO

from ..counters import Counters, WarnOnce

if TYPE_CHECKING:
    from vllm.v1.request import Request

logger = logging.getLogger("vllm.kvtool")

MAX_QUEUED = 10_000  # records waiting for the writer; a few MB at most
CLOSE_WAIT_S = 2.0  # how long ``close`` lets the writer finish the lines queued before it


class RequestLog:
    def __init__(self, path: str, stats: Counters | None = None):
        self._path = path
        self._stats = stats if stats is not None else Counters()
        self._warn_once = WarnOnce(logger)
        self._failed = False
        self._closed = False
        self._file: TextIO | None = None
        self._queue: queue.Queue[dict[str, Any] | None] = queue.Queue(MAX_QUEUED)
        self._idle = threading.Condition()
        self._unwritten = 0  # records queued and not yet written (or given up)
        self._thread = threading.Thread(target=self._loop, name="kvtool-request-log", daemon=True)
        self._thread.start()

    def write(self, request: Request, details: dict[str, Any]) -> None:
        """Queue one line: ``details`` with the request's id and tag (never blocks)."""
        if self._failed or self._closed:
            return
        params = getattr(request, "kv_transfer_params", None) or {}
        record = {**details, "request_id": request.request_id, "tag": params.get("kvtool_tag")}
        with self._idle:
            self._unwritten += 1
        try:
            self._queue.put_nowait(record)
        except queue.Full:
            self._written(1)
            self._stats.add("request_log_dropped")
            self._warn_once("full", f"kvtool: the request log {self._path} is not keeping up; dropping lines")

    def drain(self, timeout_s: float = CLOSE_WAIT_S) -> bool:
        """Wait until every line queued so far is written (or given up); whether they were in time."""
        with self._idle:
            return self._idle.wait_for(lambda: self._unwritten == 0, timeout_s)

    def close(self, timeout_s: float = CLOSE_WAIT_S) -> None:
        """Write what is queued (for at most ``timeout_s``), then stop the writer and close the file."""
        self._closed = True  # a line after this is not queued: nobody would write it
        self.drain(timeout_s)
        try:
            self._queue.put_nowait(None)
        except queue.Full:
            pass  # the writer is stuck on the disk: it is a daemon thread, and the file closes with the process
        self._thread.join(timeout=0.5)
        if not self._thread.is_alive():
            self._close_file()

    # -- the writer thread --------------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            batch = [self._queue.get()]
            while batch[-1] is not None and not self._queue.empty():
                batch.append(self._queue.get_nowait())  # everything queued: one flush for all of it
            records = [record for record in batch if record is not None]
            try:
                self._write_lines(records)
            except Exception:  # noqa: BLE001 - a bug stops the log (said), never leaves lines to pile up
                self._failed = True
                logger.exception("kvtool: the request log %s failed; no longer writing it", self._path)
            finally:
                self._written(len(records))
            if batch[-1] is None:
                return

    def _write_lines(self, records: list[dict[str, Any]]) -> None:
        if self._failed or not records:
            return
        try:
            log = self._open()
            log.write("".join(json.dumps(record, separators=(",", ":")) + "\n" for record in records))
            log.flush()
        except (OSError, TypeError, ValueError) as exc:
            self._failed = True
            self._close_file()
            logger.warning("kvtool: cannot write the request log %s (%s); no longer writing it", self._path, exc)

    def _written(self, count: int) -> None:
        with self._idle:
            self._unwritten -= count
            if self._unwritten == 0:
                self._idle.notify_all()

    def _open(self) -> TextIO:
        log = self._file
        if log is not None:
            try:
                named, held = os.stat(self._path), os.fstat(log.fileno())
                if (named.st_dev, named.st_ino) == (held.st_dev, held.st_ino):
                    return log
            except FileNotFoundError:
                pass
            self._close_file()
        log = self._file = open(self._path, "a", encoding="utf-8")  # noqa: SIM115 - kept open between lines
        return log

    def _close_file(self) -> None:
        log, self._file = self._file, None
        if log is not None:
            try:
                log.close()
            except OSError:
                pass
