"""The connector's request log: one JSON line per finished request, the file kept open between lines
and opened again when the path stops naming it (rotated or removed); a write that fails stops the log,
never the request."""

import json
import os
from types import SimpleNamespace

from connector.tracking import RequestLog


def request(req_id: str, tag: str | None = None) -> SimpleNamespace:
    return SimpleNamespace(request_id=req_id, kv_transfer_params={"kvtool_tag": tag} if tag else None)


def lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_lines_carry_the_details_the_request_id_and_the_tag(tmp_path):
    path = tmp_path / "requests.jsonl"
    log = RequestLog(str(path))
    log.write(request("a", "t1"), {"hit_tokens": 5})
    log.write(request("b"), {"hit_tokens": 0})
    assert lines(path) == [
        {"hit_tokens": 5, "request_id": "a", "tag": "t1"},
        {"hit_tokens": 0, "request_id": "b", "tag": None},
    ]
    log.close()


def test_a_rotated_or_removed_file_is_opened_again(tmp_path):
    path = tmp_path / "requests.jsonl"
    log = RequestLog(str(path))
    log.write(request("a"), {})
    os.rename(path, tmp_path / "requests.jsonl.1")  # rotated
    log.write(request("b"), {})
    assert [line["request_id"] for line in lines(path)] == ["b"]
    assert [line["request_id"] for line in lines(tmp_path / "requests.jsonl.1")] == ["a"]
    path.unlink()  # removed
    log.write(request("c"), {})
    assert [line["request_id"] for line in lines(path)] == ["c"]
    log.close()


def test_a_log_that_cannot_be_written_stops_without_failing_the_request(tmp_path):
    log = RequestLog(str(tmp_path / "missing-dir" / "requests.jsonl"))
    log.write(request("a"), {})  # no exception
    (tmp_path / "missing-dir").mkdir()
    log.write(request("b"), {})
    assert not (tmp_path / "missing-dir" / "requests.jsonl").exists()  # stopped after the first failure
