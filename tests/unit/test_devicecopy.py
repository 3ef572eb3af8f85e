"""The GPU path's copies (connector/devicecopy.py), on the CPU: the device's streams and events are a
recording fake, the copies torch's queued ones (what a CUDA cache takes) on CPU tensors.

What must hold on a device: a save's copies are queued after the step's compute and before any later
compute (the compute stream waits for their event on the device, the engine's thread never waits),
and the put thread reads them only after their event; a load's copies have completed before the load
is reported received, and copies that fail make the load a failure. No GPU was needed to check the
order; that the CUDA calls do what the fake records is checked by ``benchmarks/gpu/run.sh`` on a GPU.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager

import pytest
import torch

from connector.data import KVToolMetadata, RequestLoad, RequestSave
from connector.worker.devicecopy import block_major, device_ops_for
from connector.worker.worker import WorkerSide

from .scripted_store import InlineCalls, ScriptedStore
from .test_worker import CONFIG, LAYERS, NS, NUM_BLOCKS, PROMPT, transfers


class FakeDevice:
    """Streams and events that log what is asked of them, in order (across threads)."""

    def __init__(self, fail_sync: bool = False):
        self.log: list[tuple[str, ...]] = []
        self._lock = threading.Lock()
        self._count = 0
        self.fail_sync = fail_sync
        self.compute = self._Stream(self, "compute")

    def note(self, *entry: str) -> None:
        with self._lock:
            self.log.append(entry)

    def _name(self, kind: str) -> str:
        with self._lock:
            self._count += 1
            return f"{kind}{self._count}"

    class _Stream:
        def __init__(self, device, name):
            self.device, self.name = device, name

        def wait_stream(self, other):
            self.device.note("wait_stream", self.name, other.name)

        def wait_event(self, event):
            self.device.note("wait_event", self.name, event.name)

    class _Event:
        def __init__(self, device, name):
            self.device, self.name = device, name

        def record(self, stream):
            self.device.note("record", self.name, stream.name)

        def synchronize(self):
            self.device.note("synchronize", self.name)
            if self.device.fail_sync:
                raise RuntimeError("CUDA error: an illegal memory access was encountered")

    # DeviceOps
    def current_stream(self):
        return self.compute

    def new_stream(self):
        return self._Stream(self, self._name("stream"))

    def new_event(self):
        return self._Event(self, self._name("event"))

    @contextmanager
    def use(self, stream):
        self.note("use", stream.name)
        yield
        self.note("end", stream.name)


class LoggedStore(ScriptedStore):
    def __init__(self, device: FakeDevice):
        super().__init__()
        self.device = device

    def put_from(self, items, lease):
        self.device.note("put_from")
        return super().put_from(items, lease)


def on_device(store, caches, device, saves=True):
    side = WorkerSide(NS, store, CONFIG, saves_enabled=saves, load_calls=InlineCalls())
    side.register_kv_caches(caches, [LAYERS], NUM_BLOCKS, device_ops=device)
    return side


def save_on_device(caches, device, blocks=(3, 5, 1)):
    store = LoggedStore(device)
    side = on_device(store, caches, device)
    save = RequestSave("req-1", transfers(blocks), prompt_tokens=len(PROMPT), tag="t", last_block_key="k", tail_key="t")
    side.wait_for_save(KVToolMetadata(saves=[save]))
    side.shutdown()
    return store


def kv_first(fill):
    """FlashAttention's layout: K and V in front of the blocks."""
    make = torch.randn if fill == "random" else torch.zeros
    return {name: make(2, NUM_BLOCKS, 32, 2, 64) for name in LAYERS}


def test_a_saves_copies_run_after_the_steps_compute_and_before_the_next_and_are_put_after_their_event():
    device = FakeDevice()
    save_on_device(kv_first("random"), device)
    log = device.log
    save_stream = log[0][1]
    assert log[:2] == [("wait_stream", save_stream, "compute"), ("use", save_stream)]
    (record,) = [entry for entry in log if entry[0] == "record"]
    event = record[1]
    assert record == ("record", event, save_stream)
    # The compute stream waits for the copies on the device; the engine's thread never synchronizes.
    assert log.index(("wait_event", "compute", event)) == log.index(("end", save_stream)) + 1
    assert log.index(("synchronize", event)) < log.index(("put_from",))  # the put thread, after the copies


@pytest.mark.parametrize("layout", ["kv-first", "blocks-first"])
def test_blocks_round_trip_through_queued_copies_and_a_load_completes_before_it_is_reported(layout):
    make = (
        kv_first
        if layout == "kv-first"
        else (
            lambda fill: {n: (torch.randn if fill == "random" else torch.zeros)(NUM_BLOCKS, 2, 32, 128) for n in LAYERS}
        )
    )  # noqa: E501
    source, target = make("random"), make("zeros")
    store = save_on_device(source, FakeDevice())
    device = FakeDevice()
    loader = on_device(store, target, device, saves=False)
    device.log.clear()
    loader.start_load_kv(KVToolMetadata(loads=[RequestLoad("req-2", transfers((0, 6, 7)))]))
    load_stream = device.log[0][1]
    assert device.log[:2] == [("wait_stream", load_stream, "compute"), ("use", load_stream)]
    (record,) = [entry for entry in device.log if entry[0] == "record"]
    event = record[1]
    assert device.log[-3:] == [("end", load_stream), ("record", event, load_stream), ("synchronize", event)]
    assert loader.get_finished() == ({"req-2"}, set())
    for name in LAYERS:
        for src, dst in [(3, 0), (5, 6), (1, 7)]:
            if layout == "kv-first":
                assert torch.equal(source[name][:, src], target[name][:, dst])
            else:
                assert torch.equal(source[name][src], target[name][dst])


def test_copies_that_fail_on_the_device_fail_the_load():
    store = save_on_device(kv_first("random"), FakeDevice())
    loader = on_device(store, kv_first("zeros"), FakeDevice(fail_sync=True), saves=False)
    loader.start_load_kv(KVToolMetadata(loads=[RequestLoad("req-2", transfers((0, 6, 7)))]))
    assert loader.get_finished() == ({"req-2"}, {"req-2"})  # vLLM recomputes


def test_block_major_views_and_the_devices_kvtool_moves():
    flat = torch.zeros(6, 2, 4)
    assert block_major(flat, 6) == [flat]
    halves = block_major(torch.zeros(2, 6, 4, 3), 6)
    assert [tuple(h.shape) for h in halves] == [(6, 4, 3), (6, 4, 3)]
    with pytest.raises(ValueError, match="neither in its first dimension"):
        block_major(torch.zeros(3, 5, 4), 6)
    with pytest.raises(ValueError, match="ambiguous"):
        block_major(torch.zeros(2, 2, 4), 2)
    assert device_ops_for([flat]) is None  # host copies
    with pytest.raises(ValueError, match="several devices"):
        device_ops_for([flat, torch.zeros(1, device="meta")])
    with pytest.raises(ValueError, match="CPU and on CUDA"):
        device_ops_for([torch.zeros(1, device="meta")])


def test_copies_queued_before_a_failure_end_before_their_slots_go_back():
    from connector.worker.devicecopy import CopyStream

    device = FakeDevice()
    stream = CopyStream(device)
    with pytest.raises(RuntimeError, match="a bad write"):
        with stream.loading():
            raise RuntimeError("a bad write")
    assert [entry[0] for entry in device.log[-2:]] == ["record", "synchronize"]
    device.log.clear()
    with pytest.raises(RuntimeError, match="a bad copy"):
        with stream.saving():
            raise RuntimeError("a bad copy")
    assert [entry[0] for entry in device.log[-2:]] == ["record", "synchronize"]
