"""Worker side over real torch KV tensors and a scripted store: whole-block round trips, checks on
load, and watermarks that never run ahead of stored data."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from connector.config import load_config
from connector.data import BlockTransfer, KVToolMetadata, RequestLoad, RequestSave
from connector.core.hashing import RequestIdentity
from connector.core.keys import KeyKind, Namespace, decode_key
from connector.core.prefix import PromptKeys, plan_save
from connector.store.store import PutOutcome
from connector.core.watermarks import SaveState, WatermarkRecord
from connector.worker.worker import WorkerSide

from .scripted_store import InlineCalls, ScriptedStore

# Staging areas of a few MiB: they are touched when a worker registers (the default is 256 MiB each).
SMALL_AREAS = {"save_buffer_bytes": 8 << 20, "load_buffer_bytes": 8 << 20}
CONFIG = load_config({"master_server_address": "127.0.0.1:1", **SMALL_AREAS})

NUM_BLOCKS, BLOCK = 8, 32
LAYERS = ["model.layers.0.attn", "model.layers.1.attn"]
NS = Namespace(
    model="m", dtype="float32", kv_layout="cpu", block_size=BLOCK, num_layers=2, num_kv_heads=2, head_size=64
)
PROMPT = list(range(100, 185))  # 85 tokens: two full blocks and a 21-token tail


def kv_caches(fill: str):
    make = torch.randn if fill == "random" else torch.zeros
    return {name: make(NUM_BLOCKS, 2, BLOCK, 128) for name in LAYERS}


def worker(store, caches, saves=True):
    side = WorkerSide(NS, store, CONFIG, saves_enabled=saves, load_calls=InlineCalls())
    side.register_kv_caches(caches, [LAYERS], NUM_BLOCKS)
    return side


def transfers(block_ids):
    keys = PromptKeys.build(PROMPT, BLOCK, 1, NS.key_component(), RequestIdentity().root_hash())
    saves = plan_save(keys)
    return tuple(
        BlockTransfer(block_ids[s.block_index], s.kind, s.token_start, s.token_end, s.chain_hash) for s in saves
    )


def save(store, caches, source_blocks=(3, 5, 1)):
    side = worker(store, caches)
    meta = KVToolMetadata(
        saves=[
            RequestSave(
                "req-1",
                transfers(source_blocks),
                prompt_tokens=len(PROMPT),
                tag="t1",
                last_block_key="kvtool/last-block",
                tail_key="kvtool/tail",
            )
        ]
    )
    side.wait_for_save(meta)
    side.shutdown()  # drains the put queue
    return side


def records(store):
    found = {}
    for key, value in store.objects.items():
        decoded = decode_key(key)
        if decoded is not None and decoded.kind is KeyKind.WATERMARK:
            found[decoded.seq] = WatermarkRecord.decode(value)
    return found


def load_and_compare(store, expected) -> WorkerSide:
    """Load what ``save`` stored (blocks 3, 5, 1) into blocks 0, 6, 7 of fresh caches; each must equal
    ``expected``'s source block."""
    target = kv_caches("zeros")
    loader = worker(store, target, saves=False)
    loader.start_load_kv(KVToolMetadata(loads=[RequestLoad("req-2", transfers((0, 6, 7)))]))
    assert loader.get_finished() == ({"req-2"}, set())
    for name in LAYERS:
        for src, dst in [(3, 0), (5, 6), (1, 7)]:
            assert torch.equal(expected[name][src], target[name][dst])
    return loader


def test_whole_blocks_round_trip_into_other_blocks():
    store, source = ScriptedStore(), kv_caches("random")
    save(store, source)
    loader = load_and_compare(store, source)
    assert loader.take_stats()["tail_objects_loaded"] == 1


def test_a_durable_save_publishes_pending_then_durable_at_the_prompt_length():
    store = ScriptedStore()
    save(store, kv_caches("random"))
    found = records(store)
    assert found[0].state is SaveState.PENDING and found[0].durable_offset == 0
    final = found[1]
    assert (final.state, final.durable_offset, final.tail_boundary, final.tail_durable) == (
        SaveState.DURABLE,
        85,
        85,
        True,
    )
    assert (final.request_id, final.tag, final.prompt_tokens) == ("req-1", "t1", 85)
    assert (final.last_block_key, final.tail_key) == ("kvtool/last-block", "kvtool/tail")


def test_a_failed_tail_put_leaves_the_watermark_at_the_last_full_block_and_the_tail_a_miss():
    store = ScriptedStore()
    store.put_outcome_for = lambda key: PutOutcome.NO_SPACE if "/t/" in key else PutOutcome.STORED
    save(store, kv_caches("random"))
    final = records(store)[1]
    assert (final.state, final.durable_offset, final.tail_durable) == (SaveState.FAILED, 64, False)
    assert "no_space" in final.reason
    assert not any("/t/" in key for key in store.objects)


def test_a_failed_block_put_stops_the_watermark_before_it():
    store = ScriptedStore()
    store.put_outcome_for = lambda key: PutOutcome.FAILED if "/b/64/" in key else PutOutcome.STORED
    save(store, kv_caches("random"))
    final = records(store)[1]
    # The watermark stops at its first failed put: the tail went in the same batch, but it is not
    # durable (its key's chain runs through block 1, so no lookup reaches it without block 1).
    assert (final.state, final.durable_offset, final.tail_durable) == (SaveState.FAILED, 32, False)
    assert "block put ending at token 64: failed" == final.reason


def corrupt(store, marker, mutate):
    key = next(k for k in store.objects if marker in k)
    store.objects[key] = mutate(store.objects[key])


@pytest.mark.parametrize(
    "mutate",
    [
        lambda data: data[:-1] + bytes([data[-1] ^ 1]),  # a flipped payload byte
        lambda data: data[: len(data) // 2],  # truncated
        lambda data: data[:8] + b"X" * 16 + data[24:],  # another namespace's fingerprint
    ],
    ids=["flipped", "truncated", "foreign-namespace"],
)
def test_a_bad_object_fails_the_whole_load_and_writes_only_the_loads_own_blocks(mutate):
    store, source = ScriptedStore(), kv_caches("random")
    save(store, source)
    corrupt(store, "/b/64/", mutate)
    target = kv_caches("zeros")
    loader = worker(store, target, saves=False)
    loader.start_load_kv(KVToolMetadata(loads=[RequestLoad("req-2", transfers((0, 6, 7)))]))
    # A failed receive: vLLM drops the whole external hit and recomputes every block of it. Objects
    # checked before the bad one were copied in (each right after its check); no other block was.
    assert loader.get_finished() == ({"req-2"}, {"req-2"})
    others = [block for block in range(NUM_BLOCKS) if block not in (0, 6, 7)]
    assert all(not target[name][others].any() for name in LAYERS)
    (failure,) = loader.take_worker_meta().load_failures.items()
    assert failure[0] == "req-2" and failure[1][0] == 0  # recomputed from the load's first token
    assert loader.get_finished() == (set(), set())  # reported once


def test_a_store_error_on_load_fails_the_request():
    store = ScriptedStore()
    save(store, kv_caches("random"))
    store.fail_get = True
    loader = worker(store, kv_caches("zeros"), saves=False)
    loader.start_load_kv(KVToolMetadata(loads=[RequestLoad("req-2", transfers((0, 6, 7)))]))
    assert loader.get_finished() == ({"req-2"}, {"req-2"})
    assert loader.take_stats()["load_failures_store_error"] == 1


def test_a_worker_without_a_store_fails_planned_loads():
    side = WorkerSide(NS, None, CONFIG, saves_enabled=False)
    side.start_load_kv(KVToolMetadata(loads=[RequestLoad("req-2", transfers((0, 6, 7)))]))
    assert side.get_finished() == ({"req-2"}, {"req-2"})


def test_kv_caches_on_a_device_it_cannot_copy_from_are_refused_at_registration():
    # The connector turns this into one warning and serves without itself (CPU and CUDA are moved).
    caches = {name: torch.empty(NUM_BLOCKS, 2, BLOCK, 128, device="meta") for name in LAYERS}
    with pytest.raises(ValueError, match="on the CPU and on CUDA devices"):
        WorkerSide(NS, ScriptedStore(), CONFIG, saves_enabled=True).register_kv_caches(caches, [LAYERS], NUM_BLOCKS)


@pytest.mark.parametrize("store", ["up", "down"])
def test_copy_on_write_copies_are_made_whole_across_views_that_share_memory(store):
    """vLLM 0.32 copies a block once per cache start address: a Mamba view (a smaller page) and an
    attention view of one hybrid buffer start at the same one, and only the Mamba page was copied. vLLM's
    own sub-block hits need the repair with no store at all (one unreachable at start-up)."""
    slots, slot_bytes, mamba_bytes = NUM_BLOCKS, 4 * 2 * BLOCK * 128, 4 * 1000
    buffer = torch.zeros(slots * slot_bytes, dtype=torch.int8)
    mamba = buffer.view(slots, slot_bytes)[:, :mamba_bytes].view(slots, 1, 1, mamba_bytes)
    attention = buffer.view(torch.float32).view(slots, 2, BLOCK, 128)
    assert mamba.data_ptr() == attention.data_ptr()
    backend = ScriptedStore() if store == "up" else None
    side = WorkerSide(NS, backend, CONFIG, saves_enabled=False, load_calls=InlineCalls())
    side.register_kv_caches({"mixer": mamba, "attn": attention}, [["mixer"], ["attn"]], NUM_BLOCKS)
    attention[2] = torch.randn(2, BLOCK, 128)
    attention[5] = torch.randn(2, BLOCK, 128)
    block_2, block_5 = attention[2].clone(), attention[5].clone()
    mamba[6] = mamba[2]  # what vLLM's copy did for (2 -> 6): the Mamba page only
    assert not torch.equal(attention[6], block_2)
    side.repair_block_copies(((2, 6), (5, 2)))  # every source is read before any block is written
    assert torch.equal(attention[6], block_2) and torch.equal(attention[2], block_5)


def test_a_tail_cut_per_token_holds_its_valid_tokens_only_and_loads_them_into_the_first_slots():
    """On the CPU kernel's layout (K transposed, then V, per head: connector.core.tokencut) a 21-token tail
    stores 21 tokens' K and V, and a load writes them where the kernel reads those tokens; the rest of
    the block is the engine's to compute."""
    from connector.core.objects import HEADER_SIZE, decode_header

    store, source = ScriptedStore(), kv_caches("random")
    side = WorkerSide(NS, store, CONFIG, saves_enabled=True, load_calls=InlineCalls())
    side.register_kv_caches(source, [LAYERS], NUM_BLOCKS, ("CPU_ATTN:vec",))
    side.wait_for_save(KVToolMetadata(saves=[RequestSave("req-1", transfers((3, 5, 1)), prompt_tokens=85)]))
    side.shutdown()
    per_token = len(LAYERS) * 2 * 2 * 64 * 4  # layers x heads x (K and V) x head size x float32
    (tail,) = [value for key, value in store.objects.items() if "/t/" in key]
    assert decode_header(tail).payload_len == len(tail) - HEADER_SIZE == 21 * per_token
    (block,) = [value for key, value in store.objects.items() if "/b/32/" in key]
    assert len(block) - HEADER_SIZE == 2 * 2 * BLOCK * 128 * 4  # full blocks stay whole

    target = kv_caches("zeros")
    for name in LAYERS:
        target[name][6].fill_(float("nan"))  # stale bytes (a hybrid's Mamba page): zeroed as vLLM would
    loader = WorkerSide(NS, store, CONFIG, saves_enabled=False, load_calls=InlineCalls())
    loader.register_kv_caches(target, [LAYERS], NUM_BLOCKS, ("CPU_ATTN:vec",))
    loader.start_load_kv(KVToolMetadata(loads=[RequestLoad("r", transfers((2, 4, 6)))]))
    assert loader.get_finished() == ({"r"}, set())
    for name in LAYERS:
        got, want = target[name][6].view(2, 2 * BLOCK, 64), source[name][1].view(2, 2 * BLOCK, 64)
        keys_got, keys_want = got[:, :BLOCK].reshape(2, 64, BLOCK), want[:, :BLOCK].reshape(2, 64, BLOCK)
        assert torch.equal(keys_got[:, :, :21], keys_want[:, :, :21]) and not keys_got[:, :, 21:].any()
        assert torch.equal(got[:, BLOCK : BLOCK + 21], want[:, BLOCK : BLOCK + 21]) and not got[:, BLOCK + 21 :].any()
        assert torch.equal(target[name][4], source[name][5])  # a full block, whole


def test_host_copies_of_a_save_leave_the_engine_thread_and_end_before_the_next_step():
    """Once vLLM's per-step hook has been seen, a step's save copies run on the copy thread; the next
    step's hook waits for them, so a block vLLM then reuses was read before it was overwritten."""
    import threading

    store, source = ScriptedStore(), kv_caches("random")
    expected = {name: tensor.clone() for name, tensor in source.items()}
    side = worker(store, source)
    threads = []
    copy_block = side._copy_block
    side._copy_block = lambda *args: (threads.append(threading.current_thread().name), copy_block(*args))[1]
    side.before_step()  # vLLM's handle_preemptions: the hook that makes deferring safe
    meta = KVToolMetadata(saves=[RequestSave("req-1", transfers((3, 5, 1)), prompt_tokens=len(PROMPT))])
    side.wait_for_save(meta)
    side.before_step()  # the next step: its first hook waits for the copies
    for tensor in source.values():
        tensor.zero_()  # what that step may now do to the blocks
    side.shutdown()
    assert threads and all(name.startswith("kvtool-copy") for name in threads)
    load_and_compare(store, expected)


def test_without_the_per_step_hook_copies_stay_on_the_engine_thread():
    import threading

    from connector.worker.stepcopies import StepCopies

    copies, ran = StepCopies(), []
    copies.run(lambda: ran.append(threading.current_thread().name))
    assert ran == [threading.current_thread().name]  # no hook seen: nothing may race the copy
    copies.settle()
    copies.run(lambda: 1 / 0)  # a failing copy is logged, never raised into the engine
    copies.settle()
    copies.shutdown()


def test_under_vllms_v2_model_runner_copies_stay_on_the_engine_thread():
    """The V2 runner calls the per-step hook after it has zeroed new blocks and applied copy-on-write
    copies: a copy deferred to that hook could read a block already written. No deferral there."""
    import threading

    from connector.connector import _v1_model_runner
    from connector.worker.stepcopies import StepCopies

    copies, ran = StepCopies(deferrable=False), []
    copies.settle()  # the hook seen
    assert copies.run(lambda: ran.append(threading.current_thread().name)) is False
    assert ran == [threading.current_thread().name]
    copies.shutdown()
    assert _v1_model_runner(SimpleNamespace(use_v2_model_runner=False)) is True
    assert _v1_model_runner(SimpleNamespace(use_v2_model_runner=True)) is False

    class Unsettled:
        @property
        def use_v2_model_runner(self):
            raise ValueError("HiSparse requires Model Runner V2")

    assert _v1_model_runner(Unsettled()) is False  # unknown: never deferred

    store, source = ScriptedStore(), kv_caches("random")
    side = WorkerSide(NS, store, CONFIG, saves_enabled=True, load_calls=InlineCalls(), defer_copies=False)
    side.register_kv_caches(source, [LAYERS], NUM_BLOCKS)
    side.before_step()
    side.wait_for_save(KVToolMetadata(saves=[RequestSave("req-1", transfers((3, 5, 1)), prompt_tokens=len(PROMPT))]))
    assert side.take_stats().get("saves_copied_off_step", 0) == 0
    side.shutdown()


def test_the_connector_registers_the_caches_for_repair_when_the_store_is_down(monkeypatch):
    """An engine whose store was unreachable at start-up still hands its caches to the worker side."""
    import connector.connector as module

    registered = []
    monkeypatch.setattr(module, "check_attention_layout", lambda config, layout: None)
    instance = module.KVToolConnector.__new__(module.KVToolConnector)
    instance.layout = SimpleNamespace(layer_names=(("a",),), attention=(None,))
    instance._store = None
    instance._vllm_config = None
    instance._kv_cache_config = SimpleNamespace(num_blocks=4)
    instance._worker = SimpleNamespace(register_kv_caches=lambda *args: registered.append(args))
    instance.register_kv_caches({"a": torch.zeros(4, 2)})
    assert len(registered) == 1
