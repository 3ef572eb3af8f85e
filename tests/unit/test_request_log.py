"""The connector's request log: one JSON line per finished request, written by a thread of its own (the
engine's thread only queues it), the file kept open between lines and opened again when the path stops
naming it (rotated or removed); a write that fails stops the log, never the request; a writer that falls
behind drops lines, counted."""

import json
import os
import threading
from types import SimpleNamespace

from connector.scheduler import requestlog
from connector.counters import Counters
from connector.scheduler.requestlog import RequestLog


def request(req_id: str, tag: str | None = None) -> SimpleNamespace:
    return SimpleNamespace(request_id=req_id, kv_transfer_params={"kvtool_tag": tag} if tag else None)


def lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_lines_carry_the_details_the_request_id_and_the_tag(tmp_path):
    path = tmp_path / "requests.jsonl"
    log = RequestLog(str(path))
    log.write(request("a", "t1"), {"hit_tokens": 5})
    log.write(request("b"), {"hit_tokens": 0})
    assert log.drain()
    assert lines(path) == [
        {"hit_tokens": 5, "request_id": "a", "tag": "t1"},
        {"hit_tokens": 0, "request_id": "b", "tag": None},
    ]
    log.close()


def test_lines_keep_the_order_requests_finished_in(tmp_path):
    path = tmp_path / "requests.jsonl"
    log = RequestLog(str(path))
    for number in range(500):
        log.write(request(str(number)), {})
    log.close()  # writes what was queued before it
    assert [line["request_id"] for line in lines(path)] == [str(number) for number in range(500)]


def test_a_rotated_or_removed_file_is_opened_again(tmp_path):
    path = tmp_path / "requests.jsonl"
    log = RequestLog(str(path))
    log.write(request("a"), {})
    assert log.drain()
    os.rename(path, tmp_path / "requests.jsonl.1")  # rotated
    log.write(request("b"), {})
    assert log.drain()
    assert [line["request_id"] for line in lines(path)] == ["b"]
    assert [line["request_id"] for line in lines(tmp_path / "requests.jsonl.1")] == ["a"]
    path.unlink()  # removed
    log.write(request("c"), {})
    assert log.drain()
    assert [line["request_id"] for line in lines(path)] == ["c"]
    log.close()


def test_a_log_that_cannot_be_written_stops_without_failing_the_request(tmp_path):
    log = RequestLog(str(tmp_path / "missing-dir" / "requests.jsonl"))
    log.write(request("a"), {})  # no exception
    assert log.drain()
    (tmp_path / "missing-dir").mkdir()
    log.write(request("b"), {})
    assert log.drain()
    assert not (tmp_path / "missing-dir" / "requests.jsonl").exists()  # stopped after the first failure
    log.close()


def test_a_writer_held_by_its_disk_never_holds_the_caller_and_drops_what_does_not_fit(tmp_path, monkeypatch):
    """The disk stops answering: writes still return at once; past the queue's room lines are dropped and
    counted; once the disk answers, what was queued is written."""
    monkeypatch.setattr(requestlog, "MAX_QUEUED", 3)
    held, entered = threading.Event(), threading.Event()
    real_open = requestlog.RequestLog._open

    def stuck_open(self):
        entered.set()
        held.wait(timeout=30)
        return real_open(self)

    monkeypatch.setattr(requestlog.RequestLog, "_open", stuck_open)
    stats = Counters()
    path = tmp_path / "requests.jsonl"
    log = RequestLog(str(path), stats)
    log.write(request("first"), {})
    assert entered.wait(timeout=30)  # the writer took "first" and is stuck on the disk
    for number in range(5):
        log.write(request(str(number)), {})  # 3 fit the queue, 2 do not
    assert stats["request_log_dropped"] == 2
    assert not log.drain(timeout_s=0.05)  # still held
    held.set()
    assert log.drain(timeout_s=30)
    assert [line["request_id"] for line in lines(path)] == ["first", "0", "1", "2"]
    log.close()


def test_a_writer_that_fails_unexpectedly_stops_the_log_and_a_line_after_close_is_not_queued(tmp_path, monkeypatch):
    path = tmp_path / "requests.jsonl"
    log = RequestLog(str(path))
    monkeypatch.setattr(log, "_open", lambda: 1 / 0)  # a bug, not an OSError
    log.write(request("a"), {})
    assert log.drain()  # given up, not pending forever
    log.write(request("b"), {})  # stopped: not queued
    assert log.drain(timeout_s=0.5)
    log.close()
    log.write(request("c"), {})
    assert log.drain(timeout_s=0.5) and not path.exists()
