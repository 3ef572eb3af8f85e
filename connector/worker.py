"""Worker side: copies whole physical blocks between vLLM's KV cache and stored objects.

Loads are synchronous, before the forward pass that needs them. Saves copy the blocks into host
memory at the end of the step that computed them (so a later preemption or block reuse cannot
change what is stored), then put them from a background thread.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import warnings
from collections import Counter
from dataclasses import dataclass, replace

import torch

from .data import BlockTransfer, KVToolMetadata, KVToolWorkerMeta, RequestLoad, RequestSave
from .keys import KeyKind, Namespace, block_key, tail_key, watermark_key
from .objects import HEADER_SIZE, ObjectHeader, ObjectRejected, encode_object, verify_object
from .store import KVStore, PutOutcome, StoreError
from .watermarks import SEQ_FINAL, SEQ_PENDING, ObjectProgress, WatermarkRecord, watermark

logger = logging.getLogger("vllm.kvtool")

# Loads only read from the fetched bytes; torch warns that they are read-only.
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)


class _SaveJob:
    """One request's save in flight: its objects' progress, in prompt order, updated by the put thread."""

    def __init__(self, save: RequestSave):
        self.save = save
        self.objects = [ObjectProgress(o.kind, o.token_start, o.token_end, "present") for o in save.already_stored]
        self.transfer_index: list[int] = []
        for transfer in save.transfers:
            self.transfer_index.append(len(self.objects))
            self.objects.append(ObjectProgress(transfer.kind, transfer.token_start, transfer.token_end, "pending"))
        # Blocks first in token order, the tail last, as the watermark rule reads them.
        order = sorted(
            range(len(self.objects)), key=lambda i: (self.objects[i].kind is KeyKind.TAIL, self.objects[i].token_start)
        )
        position = {old: new for new, old in enumerate(order)}
        self.objects = [self.objects[i] for i in order]
        self.transfer_index = [position[i] for i in self.transfer_index]

    def record(self) -> WatermarkRecord:
        save = self.save
        return watermark(
            save.req_id, save.tag, save.prompt_tokens, self.objects, time.time(), save.last_block_key, save.tail_key
        )

    def settle(self, transfer_number: int, outcome: str) -> None:
        index = self.transfer_index[transfer_number]
        self.objects[index] = replace(self.objects[index], outcome=outcome)


@dataclass(frozen=True)
class _PreparedPut:
    """A queued put: an object of a save (``transfer_number`` set) or a watermark record."""

    job: _SaveJob
    key: str
    value: bytes
    transfer_number: int | None = None
    final_record: bool = False


class WorkerSide:
    def __init__(self, namespace: Namespace, store: KVStore | None, *, saves_enabled: bool):
        self._namespace = namespace
        self._ns_key = namespace.key_component()
        self._fingerprint = namespace.fingerprint()
        self._store = store
        self._saves_enabled = saves_enabled and store is not None
        self._layers: list[torch.Tensor] = []
        self._block_bytes = 0  # bytes of one block across all layers
        self._invalid_block_ids: set[int] = set()
        self._load_failures: dict[str, tuple[int, str]] = {}
        self.stats: Counter[str] = Counter()
        self._stats_lock = threading.Lock()
        self._warned: set[str] = set()
        self._puts: queue.Queue[_PreparedPut | None] = queue.Queue()
        self._put_thread: threading.Thread | None = None

    # -- set-up -------------------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor], layer_names: list[str], num_blocks: int) -> None:
        layers = []
        for name in layer_names:
            tensor = kv_caches.get(name)
            if tensor is None:
                raise ValueError(f"no KV cache tensor for layer {name}")
            if tensor.shape[0] != num_blocks:
                raise ValueError(
                    f"layer {name}: KV cache of shape {tuple(tensor.shape)} does not have its {num_blocks} blocks "
                    "in the first dimension"
                )
            layers.append(tensor)
        self._layers = layers
        self._block_bytes = sum(t[0].numel() * t.element_size() for t in layers)
        logger.info(
            "kvtool: %d layers, per-layer block shape %s %s, %d bytes a block; namespace %s",
            len(layers),
            tuple(layers[0].shape[1:]) if layers else (),
            self._namespace.dtype,
            self._block_bytes,
            self._ns_key,
        )
        if self._saves_enabled:
            self._put_thread = threading.Thread(target=self._put_loop, name="kvtool-put", daemon=True)
            self._put_thread.start()

    @property
    def ready(self) -> bool:
        return bool(self._layers) and self._store is not None

    # -- helpers ------------------------------------------------------------------------------------

    def _key(self, transfer: BlockTransfer) -> str:
        make = block_key if transfer.kind is KeyKind.BLOCK else tail_key
        return make(self._ns_key, transfer.token_end, transfer.chain_hash)

    def _header(self, transfer: BlockTransfer) -> ObjectHeader:
        return ObjectHeader(
            namespace_fingerprint=self._fingerprint,
            chain_hash=transfer.chain_hash,
            kind=transfer.kind,
            dtype=self._namespace.dtype,
            num_layers=len(self._layers),
            token_start=transfer.token_start,
            token_end=transfer.token_end,
            payload_len=self._block_bytes,
        )

    def _count(self, name: str, amount: int = 1) -> None:
        with self._stats_lock:
            self.stats[name] += amount

    def _warn_once(self, topic: str, message: str) -> None:
        if topic not in self._warned:
            self._warned.add(topic)
            logger.warning(message)

    # -- loads --------------------------------------------------------------------------------------

    def start_load_kv(self, meta: KVToolMetadata) -> None:
        if not self.ready:
            # Planned loads must still be reported, or vLLM would use blocks nobody filled.
            for load in meta.loads:
                self._fail_from(load, 0, "no_store", "the worker has no store connection")
            return
        for load in meta.loads:
            self._load_request(load)

    def _load_request(self, load: RequestLoad) -> None:
        assert self._store is not None
        keys = [self._key(t) for t in load.transfers]
        try:
            values = self._store.get(keys, HEADER_SIZE + self._block_bytes)
        except StoreError as exc:
            self._fail_from(load, 0, "store_error", str(exc))
            return
        for index, (transfer, value) in enumerate(zip(load.transfers, values, strict=True)):
            if value is None:
                self._fail_from(load, index, "missing", f"{keys[index]} could not be read")
                return
            try:
                payload = verify_object(value, self._header(transfer))
            except ObjectRejected as exc:
                self._fail_from(load, index, exc.cause, f"{keys[index]}: {exc}")
                return
            self._write_block(transfer.block_id, payload)
            self._count("objects_loaded")
            self._count("bytes_loaded", len(payload))
            self._count("tail_objects_loaded" if transfer.kind is KeyKind.TAIL else "block_objects_loaded")

    def _fail_from(self, load: RequestLoad, index: int, cause: str, detail: str) -> None:
        """Mark the failed block and every later one invalid: vLLM recomputes from the first."""
        self._invalid_block_ids.update(t.block_id for t in load.transfers[index:])
        self._load_failures[load.req_id] = (load.transfers[index].token_start, cause)
        self._count(f"load_failures_{cause}")
        self._warn_once(f"load-{cause}", f"kvtool: load failed ({cause}), recomputing: {detail}")

    def _write_block(self, block_id: int, payload: memoryview) -> None:
        offset = 0
        for layer in self._layers:
            target = layer[block_id]
            size = target.numel() * target.element_size()
            source = torch.frombuffer(payload, dtype=torch.uint8, count=size, offset=offset)
            target.copy_(source.view(layer.dtype).view(target.shape))
            offset += size

    def take_load_failures(self) -> KVToolWorkerMeta | None:
        if not self._load_failures:
            return None
        failures, self._load_failures = self._load_failures, {}
        return KVToolWorkerMeta(failures)

    def get_block_ids_with_load_errors(self) -> set[int]:
        invalid, self._invalid_block_ids = self._invalid_block_ids, set()
        return invalid

    # -- saves --------------------------------------------------------------------------------------

    def wait_for_save(self, meta: KVToolMetadata) -> None:
        if not self._saves_enabled or not self.ready:
            return
        for save in meta.saves:
            self._snapshot(save)

    def _snapshot(self, save: RequestSave) -> None:
        job = _SaveJob(save)
        prepared = []
        for number, transfer in enumerate(save.transfers):
            value = encode_object(self._header(transfer), self._read_block(transfer.block_id))
            prepared.append(_PreparedPut(job, self._key(transfer), value, transfer_number=number))
        self._puts.put(_PreparedPut(job, self._watermark_key(save, SEQ_PENDING), job.record().encode()))
        for item in prepared:
            self._puts.put(item)
        # Queued after the data: when the put thread reaches it, every put of the save has ended.
        self._puts.put(_PreparedPut(job, self._watermark_key(save, SEQ_FINAL), b"", final_record=True))

    def _watermark_key(self, save: RequestSave, seq: int) -> str:
        return watermark_key(self._ns_key, save.req_id, seq)

    def _read_block(self, block_id: int) -> bytes:
        parts = [layer[block_id].contiguous().view(torch.uint8).reshape(-1).numpy().tobytes() for layer in self._layers]
        return b"".join(parts)

    def _put_loop(self) -> None:
        while True:
            item = self._puts.get()
            if item is None:
                return
            value = item.job.record().encode() if item.final_record else item.value
            outcome = self._put(item.key, value)
            if item.transfer_number is None:
                self._count(f"watermarks_{outcome.value}")
                continue
            item.job.settle(item.transfer_number, outcome.value)
            self._count(f"saves_{outcome.value}")
            if outcome is PutOutcome.STORED:
                self._count("bytes_saved", len(value))
            elif outcome is PutOutcome.NO_SPACE:
                self._warn_once("no-space", "kvtool: the store is full; puts are dropped until it evicts")

    def _put(self, key: str, value: bytes) -> PutOutcome:
        if self._store is None:
            return PutOutcome.FAILED
        try:
            return self._store.put(key, value)
        except StoreError as exc:
            self._warn_once("put", f"kvtool: put failed, that prefix stays a miss: {exc}")
            return PutOutcome.FAILED

    def pending_puts(self) -> int:
        return self._puts.qsize()

    def take_stats(self) -> dict[str, int]:
        with self._stats_lock:
            taken, self.stats = dict(self.stats), Counter()
        return taken

    def shutdown(self, timeout_s: float = 10.0) -> None:
        if self._put_thread is not None:
            self._puts.put(None)
            self._put_thread.join(timeout=timeout_s)
            self._put_thread = None
