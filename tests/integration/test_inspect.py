"""`kvtool inspect` against a real mooncake_master, with objects written the way a producer writes them.

The CLI runs as a subprocess (as a user runs it), with its own store client; a module-scoped client
here plays the producer and keeps its segment (and so the objects) alive for the module.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from connector.config import load_config
from connector.core.hashing import RequestIdentity
from connector.core.keys import KeyKind, Namespace, watermark_key
from connector.core.objects import ObjectHeader, encode_object
from connector.core.prefix import PromptKeys, plan_load, plan_save
from connector.core.search import find_stored_prefix
from kvtool.pair.ready import ReadyFile
from connector.store.store import KVStore, PutOutcome, open_store
from connector.core.watermarks import SEQ_FINAL, SEQ_PENDING, ObjectProgress, WatermarkRecord, watermark

pytestmark = pytest.mark.integration

REPO_ROOT = Path(__file__).resolve().parents[2]
BLOCK = 32
NS = Namespace(
    model="m", dtype="float32", kv_layout="cpu", block_size=BLOCK, num_layers=2, num_kv_heads=2, head_size=64
)
OTHER = Namespace(
    model="other", dtype="float32", kv_layout="cpu", block_size=BLOCK, num_layers=2, num_kv_heads=2, head_size=64
)
PAYLOAD = 2 * 2 * BLOCK * 64 * 4  # layers x (K, V) x block x head size x float32, the shape does not matter here
REQUEST = "cmpl-inspect-1"


def tokens(seed: int, length: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 900 + 10 for i in range(length)]


def prompt_keys(prompt: list[int], namespace: Namespace = NS) -> PromptKeys:
    return PromptKeys.build(prompt, BLOCK, 1, namespace.key_component(), RequestIdentity().root_hash())


def produce(store: KVStore, prompt: list[int], namespace: Namespace = NS, request_id: str | None = None):
    """Publish a prompt as a producer does: a pending watermark, every full block, the tail, the final one."""
    keys = prompt_keys(prompt, namespace)
    saves = plan_save(keys)
    progress = [ObjectProgress(s.kind, s.token_start, s.token_end, "pending") for s in saves]
    if request_id is not None:
        put_record(store, namespace, SEQ_PENDING, watermark(request_id, "test", len(prompt), progress, time.time()))
    for save in saves:
        header = ObjectHeader(
            namespace.fingerprint(), save.chain_hash, save.kind, "float32", 2, save.token_start, save.token_end, 0
        )
        assert store.put(save.key, encode_object(header, os.urandom(PAYLOAD))) is PutOutcome.STORED
    if request_id is not None:
        stored = [ObjectProgress(p.kind, p.token_start, p.token_end, "stored") for p in progress]
        put_record(store, namespace, SEQ_FINAL, watermark(request_id, "test", len(prompt), stored, time.time()))
    return keys, saves


def put_record(store: KVStore, namespace: Namespace, seq: int, record: WatermarkRecord) -> None:
    key = watermark_key(namespace.key_component(), record.request_id, seq)
    assert store.put(key, record.encode()) is PutOutcome.STORED


@pytest.fixture(scope="module")
def producer(master):
    store = open_store(
        load_config(
            {"master_server_address": master.address, "global_segment_size": 64 << 20, "local_buffer_size": 16 << 20}
        )
    )
    yield store
    store.close()


@pytest.fixture(scope="module")
def pair_file(master, tmp_path_factory):
    """A ready file like serve-pair's, so --pair is exercised too."""
    path = tmp_path_factory.mktemp("inspect") / "ready.json"
    info = ReadyFile(
        producer="http://127.0.0.1:1",
        consumer="http://127.0.0.1:1",
        model="",  # no served model: --text is not exercised here
        block_size=BLOCK,
        hash_unit=1,
        max_model_len=2048,
        connector="kvtool",
        admin=master.admin,
        master=master.address,
    )
    path.write_text(json.dumps(info.to_json()))
    return path


def kvtool(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "MC_TCP_BIND_ADDRESS": "127.0.0.1", "COLUMNS": "200"}
    return subprocess.run(
        [sys.executable, "-m", "kvtool.cli", "inspect", *args],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def kvtool_json(*args: str) -> dict:
    done = kvtool(*args, "--json")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_keys_lists_a_producers_block_and_tail_keys_decoded(producer, master):
    prompt = tokens(1, 85)
    _, saves = produce(producer, prompt, request_id=REQUEST)
    assert producer.put("someone-elses/key", b"x") is PutOutcome.STORED

    listing = kvtool_json(
        "keys", "--admin", master.admin, "--namespace", NS.key_component(), "--block-size", str(BLOCK)
    )
    by_key = {entry["key"]: entry for entry in listing["keys"]}
    for save in saves:
        entry = by_key[save.key]
        assert entry["kind"] == ("block" if save.kind is KeyKind.BLOCK else "tail")
        assert (entry["namespace"], entry["end_token"]) == (NS.key_component(), save.token_end)
        assert entry["tokens"] == save.token_end - save.token_start
        assert entry["chain_hash"] == save.chain_hash.hex()
        assert entry["size_bytes"] > PAYLOAD
    assert by_key[saves[-1].key]["tokens"] == 21

    foreign = kvtool_json("keys", "--admin", master.admin, "--kind", "foreign")
    assert [e["key"] for e in foreign["keys"]] == ["someone-elses/key"]
    watermarks = kvtool_json("keys", "--admin", master.admin, "--kind", "watermark")
    assert sorted(e["seq"] for e in watermarks["keys"]) == [SEQ_PENDING, SEQ_FINAL]


def test_keys_pages_a_large_listing(producer, master):
    page = kvtool_json("keys", "--admin", master.admin, "--limit", "2", "--no-sizes")
    assert len(page["keys"]) == 2 and page["next_offset"] == 2 and page["matched"] > 2
    rest = kvtool_json("keys", "--admin", master.admin, "--limit", "1000", "--offset", "2", "--no-sizes")
    assert rest["next_offset"] is None and len(rest["keys"]) == page["matched"] - 2
    assert not {e["key"] for e in page["keys"]} & {e["key"] for e in rest["keys"]}


def test_watermarks_show_the_request_durable_at_its_prompt_length(producer, pair_file):
    rows = kvtool_json("watermarks", "--pair", str(pair_file))["watermarks"]
    (row,) = [r for r in rows if r.get("request_id") == REQUEST]
    assert row["state"] == "durable" and row["seq"] == SEQ_FINAL
    assert (row["prompt_tokens"], row["durable_offset"], row["tail_boundary"], row["tail_durable"]) == (
        85,
        85,
        85,
        True,
    )


@pytest.mark.parametrize("extra", [0, 30])
def test_prompt_predicts_the_hit_a_consumer_lookup_gets(producer, pair_file, extra):
    prompt = tokens(1, 85) + tokens(9, extra)  # the produced prompt, and a continuation of it
    keys = prompt_keys(prompt)
    consumer = plan_load(keys, find_stored_prefix(keys, producer.exists), local_tokens=0)
    ids = ",".join(map(str, prompt))
    report = kvtool_json("prompt", "--pair", str(pair_file), "--tokens", ids, "--namespace", NS.key_component())
    assert report["hit_tokens"] == consumer.external_tokens == (84 if extra == 0 else 85)
    assert (report["block_hit_tokens"], report["tail_hit_tokens"]) == (consumer.block_tokens, consumer.tail_tokens)
    assert report["loadable_hit_tokens"] == report["hit_tokens"]
    rows = {(b["kind"], b["end_token"]): b for b in report["boundaries"]}
    assert rows[("tail", 85)]["stored"] and rows[("tail", 85)]["in_hit"] and rows[("tail", 85)]["miss_reason"] is None


def test_prompt_names_every_miss(producer, pair_file, master):
    prompt = tokens(2, 85)
    _, saves = produce(producer, prompt, request_id="cmpl-inspect-2")
    other_prompt = tokens(3, 40)
    produce(producer, other_prompt, namespace=OTHER)
    damaged_prompt = tokens(4, 50)
    produce(producer, damaged_prompt[:32])  # its first block, intact
    damaged_keys = prompt_keys(damaged_prompt)
    tail_header = ObjectHeader(NS.fingerprint(), damaged_keys.tail_hash(50), KeyKind.TAIL, "float32", 2, 32, 50, 0)
    good = encode_object(tail_header, os.urandom(PAYLOAD))
    damaged = good[:-1] + bytes([good[-1] ^ 0xFF])  # one payload byte flipped: the checksum fails
    assert producer.put(damaged_keys.tail_key(50), damaged) is PutOutcome.STORED

    def boundaries(prompt_ids, *args):
        ids = ",".join(map(str, prompt_ids))
        report = kvtool_json(
            "prompt", "--pair", str(pair_file), "--tokens", ids, "--namespace", NS.key_component(), *args
        )
        return report, {(b["kind"], b["end_token"]): b for b in report["boundaries"]}

    # Removed from the store after it was durable: evicted or expired (with the request's watermark).
    assert producer.remove(saves[-1].key) == 0
    report, rows = boundaries(prompt, "--request-id", "cmpl-inspect-2")
    assert rows[("tail", 85)]["miss_reason"].startswith("evicted or expired")
    assert report["hit_tokens"] == 64
    _, rows = boundaries(prompt)
    assert rows[("tail", 85)]["miss_reason"] == "never stored"

    # The same tokens under another namespace.
    _, rows = boundaries(other_prompt)
    assert rows[("block", 32)]["miss_reason"].startswith("stored under another namespace")
    assert OTHER.key_component() in rows[("block", 32)]["miss_reason"]
    assert rows[("tail", 40)]["miss_reason"].startswith("stored under another namespace")

    # A present object that fails its check: the lookup counts it, the load would not.
    report, rows = boundaries(damaged_prompt)
    assert rows[("tail", 50)]["stored"]
    assert rows[("tail", 50)]["miss_reason"].startswith("object failed its check: checksum")
    assert (report["hit_tokens"], report["loadable_hit_tokens"]) == (49, 32)

    # Never produced at all.
    _, rows = boundaries(tokens(5, 20))
    assert rows[("tail", 20)]["miss_reason"] == "never stored"


def test_store_shows_capacity_use_and_counters(producer, master):
    report = kvtool_json("store", "--admin", master.admin)
    assert report["capacity_bytes"] >= 64 << 20
    assert 0 < report["used_bytes"] < report["capacity_bytes"]
    assert report["key_count"] >= 5
    assert report["evicted_keys"] == 0 and report["put_no_space_failures"] == 0
    assert report["eviction_high_watermark"] == 0.9


def test_the_table_output_renders(producer, pair_file):
    done = kvtool("store", "--pair", str(pair_file))
    assert done.returncode == 0 and "capacity_bytes" in done.stdout and "eviction_high_watermark" in done.stdout
    done = kvtool("keys", "--pair", str(pair_file), "--kind", "tail")
    assert done.returncode == 0 and "tail" in done.stdout


@pytest.mark.parametrize("subcommand", ["keys", "watermarks", "store", "prompt"])
def test_an_unreachable_or_wrong_admin_url_is_one_line(master, subcommand):
    extra = {"prompt": ["--tokens", "1,2,3", "--block-size", "32"], "watermarks": []}.get(subcommand)
    extra = None if extra is None else ["--master", master.address, *extra]
    for url, words in (("http://127.0.0.1:9", "did not answer"), (f"{master.admin}/nowhere", "does not look like")):
        done = kvtool(subcommand, "--admin", url, *(extra or []))
        assert done.returncode == 1, done.stderr
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error:") and words in lines[0], done.stderr
