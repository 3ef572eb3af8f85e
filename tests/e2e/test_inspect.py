"""`kvtool inspect` on the real pair: after a producer request it lists the request's keys decoded and
its watermark durable at the prompt length, predicts exactly the hit the consumer then reports, and,
once an object is removed, names the miss (and predicts the smaller hit)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from connector.core.hashing import RequestIdentity
from connector.core.keys import decode_key
from connector.core.prefix import PromptKeys

from .pairtools import consume, produce, prompt, remove

pytestmark = pytest.mark.e2e

REPO_ROOT = Path(__file__).resolve().parents[2]
LENGTH = 77  # two full blocks of 32 and a 13-token tail; a length the other e2e tests do not use


@pytest.fixture(scope="module")
def ready_file(pair, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("inspect") / "ready.json"
    path.write_text(json.dumps(pair.to_json()))
    return path


def inspect(*args: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-m", "kvtool.cli", "inspect", *map(str, args), "--json"],
        cwd=REPO_ROOT,
        env={**os.environ, "MC_TCP_BIND_ADDRESS": "127.0.0.1"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def predicted(ready_file: Path, tokens: list[int], namespace: str, *args: str) -> tuple[dict, dict]:
    ids = ",".join(map(str, tokens))
    report = inspect("prompt", "--pair", ready_file, "--tokens", ids, "--namespace", namespace, *args)
    return report, {(b["kind"], b["end_token"]): b for b in report["boundaries"]}


def test_inspect_follows_a_producer_request_and_predicts_the_consumer(pair, ready_file):
    kept, removed = prompt(401, LENGTH), prompt(402, LENGTH)
    kept_details, removed_details = produce(pair, kept), produce(pair, removed)
    namespace = kept_details.namespace
    keys = PromptKeys.build(kept, pair.block_size, pair.hash_unit, namespace, RequestIdentity().root_hash())

    # keys: the request's block and tail keys, decoded.
    listing = inspect("keys", "--pair", ready_file, "--namespace", namespace, "--limit", 100000, "--no-sizes")
    by_key = {entry["key"]: entry for entry in listing["keys"]}
    for index, end in ((0, 32), (1, 64)):
        entry = by_key[keys.block_key(index)]
        assert (entry["kind"], entry["end_token"], entry["tokens"]) == ("block", end, 32)
    tail = by_key[keys.tail_key(LENGTH)]
    # The save puts its pointers last (one batch): the last one is inside the tail, on the 8-token grid.
    last = by_key[kept_details.save_last_key]
    assert (last["kind"], last["end_token"]) == ("pointer", LENGTH // 8 * 8)
    assert (tail["kind"], tail["namespace"], tail["end_token"], tail["tokens"]) == ("tail", namespace, LENGTH, 13)

    # watermarks: the request is durable at its prompt length.
    rows = inspect("watermarks", "--pair", ready_file, "--namespace", namespace)["watermarks"]
    by_request = {row["request_hash"]: row for row in rows}
    kept_row = by_request[decode_key(kept_details.watermark_key).request_hash]
    assert (kept_row["state"], kept_row["prompt_tokens"], kept_row["durable_offset"]) == ("durable", LENGTH, LENGTH)
    assert (kept_row["tail_boundary"], kept_row["tail_durable"]) == (LENGTH, True)

    # prompt: the prediction is what the consumer then reports.
    query = kept + prompt(403, 10)
    report, boundaries = predicted(ready_file, query, namespace)
    assert report["hit_tokens"] == LENGTH and boundaries[("tail", LENGTH)]["in_hit"]
    details, _ = consume(pair, query)
    assert details.reused_tokens == report["hit_tokens"]

    # After the tail object is removed: the miss is named, and the smaller hit predicted.
    removed_keys = PromptKeys.build(removed, pair.block_size, pair.hash_unit, namespace, RequestIdentity().root_hash())
    remove(pair, removed_keys.tail_key(LENGTH))  # its pointers stay: a lookup finds them naming nothing
    removed_row = by_request[decode_key(removed_details.watermark_key).request_hash]
    query = removed + prompt(404, 10)
    report, boundaries = predicted(ready_file, query, namespace, "--request-id", removed_row["request_id"])
    assert boundaries[("tail", LENGTH)]["miss_reason"].startswith("evicted or expired"), boundaries
    assert report["hit_tokens"] == 64
    details, _ = consume(pair, query)
    assert details.reused_tokens == report["hit_tokens"]


def test_inspect_prompt_tokenizes_text_with_the_served_models_tokenizer(pair, ready_file):
    from transformers import AutoTokenizer

    text = "the quick brown fox jumps over the lazy dog"
    expected = AutoTokenizer.from_pretrained(pair.model, local_files_only=True)(text)["input_ids"]
    assert len(expected) % pair.block_size, "pick a text whose token count leaves a tail"
    namespace = produce(pair, prompt(405, 40)).namespace
    report = inspect("prompt", "--pair", ready_file, "--text", text, "--namespace", namespace, "--no-verify")
    keys = PromptKeys.build(expected, pair.block_size, pair.hash_unit, namespace, RequestIdentity().root_hash())
    assert report["prompt_tokens"] == len(expected)
    assert keys.tail_key(len(expected)) in {b["key"] for b in report["boundaries"]}
