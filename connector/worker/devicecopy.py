"""Copies between a KV cache on an accelerator (CUDA) and the host staging areas, ordered by events.

On the CPU the KV cache is host memory and a block is copied with ``memmove`` (``blockcopy``). On a
GPU the copies are asynchronous, on a copy stream per direction, and ordered against the engine's
compute stream by events, never by synchronizing the device:

- **Saves** (``CopyStream.saving``, on the engine's thread in ``wait_for_save``): the save stream first
  waits for the compute stream (the step's KV is written), the copies out of the KV cache into the
  pinned save area are queued on it, and the compute stream then waits for their event, on the device:
  no later step can overwrite a block before its copy read it, and the engine's thread never waits.
  The put thread waits for that event (``Fence.wait``) before it seals and puts the objects.
- **Loads** (``CopyStream.loading``, on a fetch thread): the load stream waits for the compute stream
  (a block freed by a finished request may still be written by work queued before), the checked
  objects are copied from the pinned load area into the request's blocks, and the fetch thread waits
  for their event before the load is reported received; the request is scheduled only after.

The device calls sit behind ``DeviceOps`` (``TorchCudaOps`` for CUDA), so the ordering is tested on
the CPU with a recording fake (``tests/unit/test_devicecopy.py``).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any, Protocol

import torch


class DeviceOps(Protocol):
    """What the copies need of a device: streams, events, and making a stream current on a thread."""

    def current_stream(self) -> Any: ...  # the calling thread's current stream (the engine's: compute)

    def new_stream(self) -> Any: ...  # has wait_stream(stream), wait_event(event)

    def new_event(self) -> Any: ...  # has record(stream), synchronize(), query()

    def use(self, stream: Any) -> AbstractContextManager[Any]: ...  # ``stream`` current in the block


class TorchCudaOps:
    """``DeviceOps`` on one CUDA device through torch."""

    def __init__(self, device: torch.device):
        self.device = device

    def current_stream(self) -> Any:
        return torch.cuda.current_stream(self.device)

    def new_stream(self) -> Any:
        return torch.cuda.Stream(self.device)

    def new_event(self) -> Any:
        return torch.cuda.Event()

    @contextmanager
    def use(self, stream: Any) -> Iterator[None]:
        # The device first: a fetch thread starts on device 0, and leaving a stream context on it
        # would create a CUDA context on GPU 0 in every rank's process.
        with torch.cuda.device(self.device), torch.cuda.stream(stream):
            yield


class Fence:
    """The event a save's copies end with: the put thread waits for it before reading them."""

    def __init__(self) -> None:
        self._event: Any = None
        self._set = threading.Event()

    def arm(self, event: Any) -> None:
        self._event = event
        self._set.set()

    def wait(self) -> None:
        self._set.wait()
        self._event.synchronize()  # this event only: the device keeps computing


class CopyStream:
    """One direction's copies between the KV cache and host staging memory, on a stream of its own."""

    def __init__(self, ops: DeviceOps):
        self._ops = ops
        # The engine's compute stream, taken on its thread (a fetch thread's current stream is another).
        self._compute = ops.current_stream()
        self._stream = ops.new_stream()
        self._lock = threading.Lock()  # fetch threads share the load stream

    def note_compute(self) -> None:
        """Take the calling thread's current stream as the compute stream (on the engine's thread, in
        each step: the stream the forward pass runs on)."""
        with self._lock:
            self._compute = self._ops.current_stream()

    @contextmanager
    def saving(self) -> Iterator[Fence]:
        """Copies queued inside (on the engine's thread) run after the step's compute, and before any
        later compute."""
        self.note_compute()
        fence = Fence()
        self._stream.wait_stream(self._compute)
        try:
            with self._ops.use(self._stream):
                yield fence
                event = self._ended()
        except BaseException:
            self._ended().synchronize()  # copies may be queued: end them before their slots go back
            raise
        self._compute.wait_event(event)
        fence.arm(event)

    @contextmanager
    def loading(self) -> Iterator[None]:
        """Copies queued inside (on this thread) have completed when the block ends."""
        with self._lock:
            compute = self._compute
        self._stream.wait_stream(compute)
        try:
            with self._ops.use(self._stream):
                yield
        finally:  # also after a failed write: copies queued before it end before the slots go back
            self._ended().synchronize()

    def _ended(self) -> Any:
        """An event recorded on this stream now: it completes when every copy queued so far has."""
        event = self._ops.new_event()
        event.record(self._stream)
        return event


def device_ops_for(tensors: list[torch.Tensor]) -> DeviceOps | None:
    """The ops for the device the KV cache is on: None on the CPU (host copies), CUDA's on a GPU."""
    devices = {tensor.device for tensor in tensors}
    if len(devices) != 1:
        raise ValueError(f"the KV cache spans several devices ({sorted(map(str, devices))})")
    (device,) = devices
    if device.type == "cpu":
        return None
    if device.type == "cuda":
        return TorchCudaOps(device)
    raise ValueError(f"the KV cache is on {device}; kvtool moves KV on the CPU and on CUDA devices")


def block_major(tensor: torch.Tensor, num_blocks: int) -> list[torch.Tensor]:
    """A layer's cache tensor as tensors with the blocks in their first dimension: itself, or for a
    layout that keeps K and V apart in front of the blocks (``[2, blocks, ...]``, FlashAttention's) its
    K and V halves. Raises ValueError for any other shape."""
    if tensor.dim() >= 3 and num_blocks == 2 and tuple(tensor.shape[:2]) == (2, 2):
        raise ValueError("a KV cache of 2 blocks behind a dimension of 2 is ambiguous (K/V first or blocks first)")
    if tensor.dim() >= 2 and tensor.shape[0] == num_blocks:
        return [tensor]
    if tensor.dim() >= 3 and tensor.shape[0] == 2 and tensor.shape[1] == num_blocks:
        return [tensor[0], tensor[1]]
    raise ValueError(
        f"a KV cache of shape {tuple(tensor.shape)} has its {num_blocks} blocks neither in its first "
        "dimension nor behind a K/V dimension of 2"
    )
