"""A real store too small for a prompt's save: puts fail with no space, nothing is half-published, and
the watermark stays behind every object that failed (the tail stays a miss)."""

from __future__ import annotations

import pytest
import torch

from connector.config import load_config
from connector.data import BlockTransfer, KVToolMetadata, RequestSave
from connector.core.hashing import RequestIdentity
from connector.core.keys import KeyKind, Namespace, watermark_key
from connector.core.objects import HEADER_SIZE
from connector.core.prefix import PromptKeys, plan_save
from connector.core.search import find_stored_prefix
from connector.store.store import open_store
from connector.core.watermarks import SaveState, WatermarkRecord
from connector.worker.worker import WorkerSide

pytestmark = pytest.mark.integration

BLOCK, BLOCKS = 32, 320
LAYERS = ["l0", "l1"]
NS = Namespace(
    model="full", dtype="float32", kv_layout="cpu", block_size=BLOCK, num_layers=2, num_kv_heads=2, head_size=64
)


def test_a_full_segment_fails_puts_and_a_consumer_never_sees_past_the_watermark(master):
    small = load_config(
        {"master_server_address": master.address, "global_segment_size": 16 << 20, "local_buffer_size": 16 << 20}
    )
    store = open_store(small)
    try:
        caches = {name: torch.randn(BLOCKS, 2, BLOCK, 128) for name in LAYERS}  # 64 KiB a block
        tokens = list(range(BLOCKS * BLOCK - 11))  # 319 full blocks + a 21-token tail: 20 MiB > 16 MiB
        keys = PromptKeys.build(tokens, BLOCK, 1, NS.key_component(), RequestIdentity().root_hash())
        saves = plan_save(keys)
        transfers = tuple(BlockTransfer(s.block_index, s.kind, s.token_start, s.token_end, s.chain_hash) for s in saves)
        worker = WorkerSide(NS, store, small, saves_enabled=True)
        worker.register_kv_caches(caches, [LAYERS], BLOCKS)
        worker.wait_for_save(KVToolMetadata(saves=[RequestSave("big", transfers, prompt_tokens=len(tokens))]))
        worker.shutdown(timeout_s=60)
        stats = worker.take_stats()
        tried = sum(stats.get(f"saves_{o}", 0) for o in ("stored", "present", "no_space", "failed"))
        assert tried + stats.get("saves_skipped_after_failure", 0) == len(saves), stats

        (value,) = store.get([watermark_key(NS.key_component(), "big", 1)])
        record = WatermarkRecord.decode(value)
        # The master evicts in the background, so whether a put found the segment full is a race; what a
        # consumer can see is not: never more than the watermark, and never a tail after a failed put.
        if stats.get("saves_no_space", 0):
            assert record.state is SaveState.FAILED and "no_space" in record.reason
            assert record.durable_offset < len(tokens) and not record.tail_durable
            tail = saves[-1]
            assert tail.kind is KeyKind.TAIL and not store.exists([tail.key])[0]
        visible = find_stored_prefix(keys, store.exists)
        assert visible.tokens <= record.durable_offset

        # Nothing half-published: every object that is visible reads back whole.
        present = store.exists([s.key for s in saves])
        expected = HEADER_SIZE + 2 * 32 * 1024
        values = store.get([s.key for s, found in zip(saves, present, strict=True) if found], expected)
        assert all(v is not None and len(v) == expected for v in values)
    finally:
        store.close()
