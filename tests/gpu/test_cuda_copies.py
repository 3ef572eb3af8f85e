"""The connector's copies on CUDA tensors (skipped without a GPU; ``benchmarks/gpu/run.sh`` runs them).

The same round trips as ``tests/unit/test_devicecopy.py``, with torch's real streams and events: a save
queued on the save stream while the compute stream goes on, then a load into other blocks on the load
stream, in both layouts vLLM's GPU backends use (blocks first, and K/V in front of the blocks).
"""

from __future__ import annotations

import pytest
import torch

from connector.data import KVToolMetadata, RequestLoad, RequestSave
from connector.worker.devicecopy import TorchCudaOps, device_ops_for
from connector.worker.worker import WorkerSide

from ..unit.scripted_store import InlineCalls, ScriptedStore
from ..unit.test_worker import CONFIG, LAYERS, NS, NUM_BLOCKS, PROMPT, transfers

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

SHAPES = {"blocks-first": (NUM_BLOCKS, 2, 32, 2, 64), "kv-first": (2, NUM_BLOCKS, 32, 2, 64)}


def caches(shape, fill):
    make = torch.randn if fill == "random" else torch.zeros
    return {name: make(shape, device="cuda", dtype=torch.bfloat16) for name in LAYERS}


@pytest.mark.parametrize("layout", list(SHAPES))
def test_blocks_round_trip_between_gpu_blocks_through_the_store(layout):
    source, target = caches(SHAPES[layout], "random"), caches(SHAPES[layout], "zeros")
    assert isinstance(device_ops_for(list(source.values())), TorchCudaOps)
    axis = 1 if layout == "kv-first" else 0
    saved_blocks, loaded_blocks = [3, 5, 1], [0, 6, 7]
    expected = {
        name: t.index_select(axis, torch.tensor(saved_blocks, device="cuda")).clone() for name, t in source.items()
    }
    store = ScriptedStore()
    saver = WorkerSide(NS, store, CONFIG, saves_enabled=True, load_calls=InlineCalls())
    saver.register_kv_caches(source, [LAYERS], NUM_BLOCKS)
    save = RequestSave(
        "req-1", transfers(tuple(saved_blocks)), prompt_tokens=len(PROMPT), tag="t", last_block_key="k", tail_key="t"
    )
    saver.wait_for_save(KVToolMetadata(saves=[save]))
    for tensor in source.values():  # a later step's compute, queued at once: it must run after the copies
        tensor.mul_(0)
    saver.shutdown()

    loader = WorkerSide(NS, store, CONFIG, saves_enabled=False, load_calls=InlineCalls())
    loader.register_kv_caches(target, [LAYERS], NUM_BLOCKS)
    loader.start_load_kv(KVToolMetadata(loads=[RequestLoad("req-2", transfers(tuple(loaded_blocks)))]))
    assert loader.get_finished() == ({"req-2"}, set())
    for name in LAYERS:
        moved = target[name].index_select(axis, torch.tensor(loaded_blocks, device="cuda"))
        assert torch.equal(moved, expected[name]), name
