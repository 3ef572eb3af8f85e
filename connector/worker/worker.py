"""Worker side: copies whole physical blocks between vLLM's KV cache and stored objects.

Both directions go through host staging areas registered with the store (``staging``): transfers
are zero-copy batches between the store and their slots. Loads are asynchronous (``loader.Loader``):
read into the load area, checked and copied into the request's blocks on a background thread (blocks
vLLM keeps for the request, unscheduled, until it is reported), and reported through
``get_finished``; a failed or late load is a failed receive, which vLLM recomputes. Saves copy the
blocks into slots of the save area after the step that computed them, before the next step touches a
block (``stepcopies``: on a copy thread, waited for at the next step's first hook; so a later
preemption or block reuse cannot change what is stored), as many as have room, then a background
thread seals and puts them (``saver.Saver``). On a GPU the copies are queued on copy streams
(``devicecopy``).
"""

from __future__ import annotations

import logging
import time
import warnings
from contextlib import AbstractContextManager, nullcontext
from functools import partial

import torch

from .blockcopy import BlockRows
from .caches import EngineCaches, cache_groups, staging_area
from ..store.breaker import CircuitBreaker
from ..calls import BoundedCalls
from ..counters import Counters, WarnOnce
from .devicecopy import CopyStream, DeviceOps, Fence, device_ops_for
from ..config import KVToolConfig
from ..data import BlockTransfer, KVToolMetadata, KVToolWorkerMeta, RequestSave, StoredObject
from ..core.keys import KeyKind, Namespace, object_key, watermark_key
from .loader import MAX_SAMPLES, Loader
from ..core.objects import HEADER_SIZE, ObjectHeader, PointerRecord, encode_pointer
from .saver import ObjectCopy, Saver, SaveJob
from ..store.staging import Lease, Region
from .stepcopies import StepCopies
from ..store.store import KVStore
from ..core.tokencut import token_views

# How long get_finished waits for the loads in flight after a step that computed nothing.
IDLE_LOAD_WAIT_S = 0.010

logger = logging.getLogger("vllm.kvtool")

# Loads only read from the fetched bytes; torch warns that they are read-only.
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)


class WorkerSide:
    def __init__(
        self,
        namespace: Namespace,
        store: KVStore | None,
        config: KVToolConfig,
        *,
        saves_enabled: bool,
        load_calls: BoundedCalls | None = None,
        breaker: CircuitBreaker | None = None,
        defer_copies: bool = True,
    ):
        self._namespace = namespace
        self._breaker = breaker  # open: the store is failing, saves are not copied
        self._ns_key = namespace.key_component()
        self._fingerprint = namespace.fingerprint()
        self._store = store
        self._config = config
        self._saves_enabled = saves_enabled and store is not None
        self._groups: list[list[torch.Tensor]] = []  # per KV cache group: its layers' cache tensors
        self._widest_views: tuple[torch.Tensor, ...] = ()
        self._group_bytes: list[int] = []  # per group: bytes of one block across its layers
        self._rows: list[BlockRows | None] = []  # per group: its tensors' byte rows, for whole-block copies
        self._load_failures: dict[str, tuple[int, str]] = {}
        self._sent: set[str] = set()
        self._step_start: float | None = None
        self._step_samples: list[tuple[int, float]] = []  # (tokens scheduled, seconds of the forward pass)
        self.stats = Counters()
        self._warn_once = WarnOnce(logger)
        self._loader = Loader(
            store,
            key_of=self._key,
            header_of=self._header,
            write_block=self._write_block,
            timeout_s=config.load_timeout_s,
            calls=load_calls,
            copies=self._loading,
        )
        self._saver: Saver | None = None
        # On a device (CUDA): the copy streams of saves and loads (``devicecopy``); None on the CPU.
        self._save_stream: CopyStream | None = None
        # Host copies of a step's saves, finished before the next step (not deferred under vLLM's V2 runner).
        self._step_copies = StepCopies(deferrable=defer_copies)
        self._load_stream: CopyStream | None = None

    # -- set-up -------------------------------------------------------------------------------------

    def register_kv_caches(
        self,
        kv_caches: dict[str, torch.Tensor | list[torch.Tensor]],
        group_layers: list[list[str]],
        num_blocks: int,
        layouts: tuple[str | None, ...] = (),
        device_ops: DeviceOps | None = None,
    ) -> None:
        """The cache tensors of every group's layers (``caches``): a block is copied whole, but for a tail
        in a group whose kernel ``layouts`` (per group, ``EngineLayout.attention``) can be cut per token;
        and the staging areas, sized for its largest object."""
        groups = cache_groups(kv_caches, group_layers, num_blocks)
        ops = device_ops or device_ops_for([t for tensors in groups for t in tensors])
        if ops is not None:  # the engine's thread: its current stream is the compute stream
            self._save_stream, self._load_stream = CopyStream(ops), CopyStream(ops)
        caches = EngineCaches.of(groups, layouts, queued=ops is not None)
        caches.log(self._ns_key)
        self._groups, self._widest_views, self._rows = caches.groups, caches.widest_views, caches.rows
        self._group_bytes, self._token_bytes = caches.group_bytes, caches.token_bytes
        if self._store is None:
            return
        self._loader.area = staging_area(self._store, "load", caches.slot_bytes, self._config.load_buffer_bytes)
        if self._saves_enabled:
            area = staging_area(self._store, "save", caches.slot_bytes, self._config.save_buffer_bytes)
            self._saver = Saver(self._store, area=area, drain_timeout_s=self._config.shutdown_drain_s)

    @property
    def ready(self) -> bool:
        return bool(self._groups) and all(self._groups) and self._store is not None

    # -- helpers ------------------------------------------------------------------------------------

    def _key(self, transfer: BlockTransfer) -> str:
        return object_key(self._ns_key, transfer.group, transfer.kind, transfer.token_end, transfer.chain_hash)

    def _payload_bytes(self, transfer: BlockTransfer) -> int:
        """A tail's valid tokens where its group is cut per token; else the whole block."""
        if not self._cut_tail(transfer):
            return self._group_bytes[transfer.group]
        return self._token_bytes[transfer.group] * (transfer.token_end - transfer.token_start)

    def _header(self, transfer: BlockTransfer) -> ObjectHeader:
        return ObjectHeader(
            namespace_fingerprint=self._fingerprint,
            chain_hash=transfer.chain_hash,
            kind=transfer.kind,
            dtype=self._namespace.dtype,
            num_layers=len(self._groups[transfer.group]),
            token_start=transfer.token_start,
            token_end=transfer.token_end,
            payload_len=self._payload_bytes(transfer),
            group=transfer.group,
        )

    def _pointers(self, transfer: BlockTransfer) -> tuple[tuple[str, bytes], ...]:
        """The (key, record) of each pointer to a saved object."""
        return tuple(
            (
                object_key(self._ns_key, transfer.group, KeyKind.POINTER, boundary, digest),
                encode_pointer(
                    PointerRecord(
                        self._fingerprint,
                        digest,
                        transfer.group,
                        boundary,
                        transfer.kind,
                        transfer.token_end,
                        transfer.chain_hash,
                        transfer.token_ids[boundary - transfer.token_start :],
                    )
                ),
            )
            for boundary, digest in transfer.pointers
        )

    # -- loads --------------------------------------------------------------------------------------

    def repair_block_copies(self, copies: tuple[tuple[int, int], ...]) -> None:
        """Redo vLLM's copy-on-write block copies of this step, whole, before the forward reads them.

        vLLM 0.32's ``copy_kv_cache_blocks_inplace`` (vllm/v1/worker/utils.py) skips a cache view whose
        ``data_ptr`` it has seen. Under the hybrid allocator a Mamba layer and an attention layer share
        one buffer and their views start at the same address; when the Mamba view comes first (layer 0
        Mamba, layer 1 attention) only its page (19,840 B on the mamba preset) of each block is copied,
        and an attention block's copy misses most of its values (32,768 B). A sub-block prefix hit
        (``--prefix-match-unit`` below the block size) copies its tail blocks this way: its forward then
        attends wrong values. Called from ``bind_connector_metadata``: after ``_update_states`` (the
        zeroing of new blocks and vLLM's copy) and before the forward. Not from ``start_load_kv``, which
        vLLM calls after the forward in a step without synchronous loads (kv_connector_model_runner_mixin
        ``_get_kv_connector_output``): a copy then would take the forward's output (a producer's
        state after L instead of L - 1). Copying every distinct view again makes the copy whole (bytes
        already copied are copied identically)."""
        if not copies or not self._groups:
            return
        src = torch.tensor([pair[0] for pair in copies], dtype=torch.long)
        dst = torch.tensor([pair[1] for pair in copies], dtype=torch.long)
        for tensor in self._widest_views:
            tensor[dst] = tensor[src]  # gathers every source before writing (vLLM's semantics)
        self.stats.add("block_copies_repaired", len(copies))

    def start_load_kv(self, meta: KVToolMetadata) -> None:
        """Start this step's loads in the background (a worker without a store fails them at once)."""
        if self._load_stream is not None and meta.loads:
            self._load_stream.note_compute()  # the engine's thread: what a load's copies must follow
        for load in meta.loads:
            if load.failure is not None:
                self._loader.fail(load, "unloadable", load.failure)
            elif self.ready:
                self._loader.start(load)
            else:  # planned loads must still fail, or vLLM would use blocks nobody filled
                self._loader.fail(load, "no_store", "the worker-side connector is disabled or has no store")

    def get_finished(self, step_tokens: int = 1) -> tuple[set[str], set[str]]:
        """Loads that ended since the last step: (received, of which failed). Copies the good ones in.

        After a step that computed nothing (``step_tokens`` 0: every request waits for a load or a
        lookup) it first waits up to ``IDLE_LOAD_WAIT_S`` for the fetches in flight: no stream is
        running to be delayed, and a load reported now is scheduled a step sooner."""
        wait_s = IDLE_LOAD_WAIT_S if step_tokens == 0 else 0.0
        finished, counts = self._loader.finish(wait_s)  # also starts loads whose turn came
        for name, amount in counts.items():
            self.stats.add(name, amount)
        failed = finished.failed or {}
        for req_id, (token, failure) in failed.items():
            self._load_failures[req_id] = (token, failure.cause)
            self._warn_once(
                f"load-{failure.cause}", f"kvtool: load failed ({failure.cause}), recomputing: {failure.detail}"
            )
        return set(finished.received), set(failed)

    def _write_block(self, transfer: BlockTransfer, payload: memoryview) -> None:
        rows = self._whole_rows(transfer)
        if rows is not None:
            rows.scatter(transfer.block_id, torch.frombuffer(payload, dtype=torch.uint8, count=rows.nbytes))
            return
        if self._cut_tail(transfer):
            # A tail cut per token fills its block's first slots only. vLLM zeroes the new blocks of a
            # hybrid model (stale Mamba bytes can read as NaN in slots the kernel masks) but not the ones
            # a load restores: the rest of this one is zeroed here, as vLLM would have.
            for block in (layer[transfer.block_id] for layer in self._groups[transfer.group]):
                block.zero_()
        offset = 0
        for target in self._pieces(transfer):
            size = target.numel() * target.element_size()
            source = torch.frombuffer(payload, dtype=torch.uint8, count=size, offset=offset)
            target.copy_(source.view(target.dtype).view(target.shape))
            offset += size

    def _whole_rows(self, transfer: BlockTransfer) -> BlockRows | None:
        """The group's byte rows where the object is its whole block (not a tail cut per token)."""
        return None if self._cut_tail(transfer) else self._rows[transfer.group]

    def _cut_tail(self, transfer: BlockTransfer) -> bool:
        """A tail whose group is cut per token: its object holds its valid tokens only."""
        return transfer.kind is KeyKind.TAIL and bool(self._token_bytes[transfer.group])

    def _pieces(self, transfer: BlockTransfer) -> list[torch.Tensor]:
        """The parts of the KV cache an object holds, in its payload's order: each layer's block, or
        for a tail cut per token each layer's first tokens (K, then V)."""
        layers = [layer[transfer.block_id] for layer in self._groups[transfer.group]]
        if not self._cut_tail(transfer):
            return layers
        valid = transfer.token_end - transfer.token_start
        return [view for block in layers for view in token_views(block, valid)]

    def take_worker_meta(self) -> KVToolWorkerMeta | None:
        """Loads that failed since the last step, the cost model's measurements (``profit``), and the
        requests whose prompt save left objects unstored (``Saver.take_unsaved``)."""
        unsaved = self._saver.take_unsaved() if self._saver is not None else frozenset()
        if not (self._load_failures or self._loader.samples or self._step_samples or unsaved):
            return None
        meta = KVToolWorkerMeta(self._load_failures, self._loader.samples, self._step_samples, unsaved)
        self._load_failures, self._loader.samples, self._step_samples = {}, [], []
        return meta

    def step_started(self) -> None:
        self._step_start = time.perf_counter()

    # -- saves --------------------------------------------------------------------------------------

    def wait_for_save(self, meta: KVToolMetadata) -> None:
        # The forward pass ran since bind_connector_metadata (``step_started``): a prefill-cost sample.
        if self._step_start is not None and meta.step_tokens > 0:
            self._step_samples.append((meta.step_tokens, time.perf_counter() - self._step_start))
            del self._step_samples[:-MAX_SAMPLES]
        self._step_start = None
        # An answer save's blocks are held by vLLM until it is reported sent: report it whatever
        # happens to its copy (made here, skipped, or impossible), or they would never be freed.
        self._sent.update(save.req_id for save in meta.saves if save.answer)
        if self._saver is None or not self.ready:
            return
        admitted = [(save, lease) for save in meta.saves if (lease := self._admit(save)) is not None]
        if not admitted:
            return
        if self._save_stream is not None:
            self._copy_saves(admitted)  # a device's copies are queued on the save stream: no wait here
        else:
            if self._step_copies.run(partial(self._copy_saves, admitted)):  # host copies: off the engine thread
                self.stats.add("saves_copied_off_step", len(admitted))

    def before_step(self) -> None:
        """The next step's first hook (vLLM's ``handle_preemptions``): the last step's copies are done."""
        self._step_copies.settle()

    def take_sent(self) -> set[str]:
        """Answer saves whose blocks were copied (or given up) since the last step: vLLM frees them."""
        sent, self._sent = self._sent, set()
        return sent

    def _admit(self, save: RequestSave) -> Lease | None:
        """Slots for the save's leading objects (on the engine's thread), or None: no copy is made."""
        assert self._saver is not None
        if self._breaker is not None and self._breaker.is_open:
            self.stats.add("saves_skipped_breaker")  # no copy made: the store is failing
            self._saver.note_unsaved(save)
            return None
        lease = self._saver.admit(len(save.transfers))
        if lease is None:
            self._saver.note_unsaved(save)
        return lease

    def _copy_saves(self, admitted: list[tuple[RequestSave, Lease]]) -> None:
        for save, lease in admitted:
            try:
                self._snapshot(save, lease)
            except Exception:  # noqa: BLE001 - a bug costs this save, never the engine
                lease.release()
                self.stats.add("saves_crashed")
                self._saver.note_unsaved(save)
                logger.exception("kvtool: copying a save's blocks failed; it is dropped")

    def _snapshot(self, save: RequestSave, lease: Lease) -> None:
        """Copy the save's blocks (as many leading ones as have slots) and queue their puts."""
        assert self._saver is not None
        # The slots keep a prefix: objects in put order (blocks by position, then tails and states).
        # Only the copy of the block's bytes is made before the next step (``stepcopies``); the put
        # thread seals them.
        copies = []
        with self._saving() as fence:  # on a device: queued copies, which the put thread waits for
            for number, transfer in enumerate(save.transfers[: len(lease)]):
                region = lease.region(number, HEADER_SIZE + self._payload_bytes(transfer))
                self._copy_block(transfer, region)
                pointers = partial(self._pointers, transfer)  # encoded on the put thread
                copies.append(ObjectCopy(number, self._key(transfer), region, pointers, self._header(transfer)))
        watermark = lambda seq: watermark_key(self._ns_key, save.watermark_id, seq)  # noqa: E731
        stored = tuple(self._stored_key(obj) for obj in save.already_stored)
        self._saver.submit(SaveJob(save, copies, watermark, lease, copied=fence, stored_keys=stored))

    def _stored_key(self, obj: StoredObject) -> str | None:
        """This rank's key of an object a lookup found stored (asked about again by the put thread)."""
        return object_key(self._ns_key, obj.group, obj.kind, obj.token_end, obj.chain_hash) if obj.chain_hash else None

    def _saving(self) -> AbstractContextManager[Fence | None]:
        return self._save_stream.saving() if self._save_stream is not None else nullcontext()

    def _loading(self) -> AbstractContextManager[None]:
        return self._load_stream.loading() if self._load_stream is not None else nullcontext()

    def _copy_block(self, transfer: BlockTransfer, region: Region) -> None:
        """The object's parts of the block (``_pieces``), in turn, after room for the header: one copy."""
        target = torch.frombuffer(region.view, dtype=torch.uint8)
        rows = self._whole_rows(transfer)
        if rows is not None:
            rows.gather(transfer.block_id, target[HEADER_SIZE : HEADER_SIZE + rows.nbytes])
            return
        offset = HEADER_SIZE
        for piece in self._pieces(transfer):
            size = piece.numel() * piece.element_size()
            # One copy straight from the (strided) piece into its place, in the piece's element order:
            # a tail's 2 pieces a layer cost one torch call each, no intermediate contiguous copy.
            place = target[offset : offset + size].view(piece.dtype).view(piece.shape)  # offsets stay aligned
            place.copy_(piece, non_blocking=True)  # queued on a device
            offset += size

    def take_stats(self) -> dict[str, int]:
        area = self._loader.area
        if area is not None and area.oversize:
            self.stats.add("loads_oversize", area.oversize)
            area.oversize = 0
        taken = self.stats.take()
        for source in (self._saver, self._store):
            more = getattr(source, "take_stats", None)
            if more is not None:
                for name, value in more().items():
                    taken[name] = taken.get(name, 0) + value
        return taken

    def shutdown(self, timeout_s: float | None = None) -> None:
        self._step_copies.shutdown()
        if self._saver is not None:
            self._saver.shutdown(timeout_s)
