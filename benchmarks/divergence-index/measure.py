"""What a divergence-point index costs in a real Mooncake store.

The index adds one small pointer object (about 160 bytes) per grid boundary strictly inside every
stored block or tail, under ``kvtool/2/<ns>/<group>/p/<g>/<hash>``. This script starts its own
loopback ``mooncake_master`` (twice: once for small objects, once for block-sized ones, so the two
memory curves do not mix), connects the connector's own ``MooncakeStore`` to it, and measures:

1. the master's resident memory (VmRSS) as keys are added, and what its admin port reports;
2. where the segment allocator actually places objects (the stride between consecutive objects),
   which shows the allocation granularity that ``/metrics`` does not;
3. single put latency (``MooncakeStore.put``) of 160-byte and block-sized values;
4. batched put latency (the raw client's ``put_batch``) per batch size;
5. existence-query latency (``MooncakeStore.exists`` = ``batch_is_exist``), half the keys present;

and derives, per block size B and grid G, the pointer keys per block and what they cost.

A third run (``--only connector``; a fresh master) measures the connector's own code over the connector's
store stack (``open_store``: ``TimedStore`` over ``MooncakeStore``): the put thread's work for one save
(``Saver``: each object put alone, then the save's pointers in one ``put_many``), the master's key
count after the saves, and lookup latency (``find_stored_prefixes`` with the pointer reader) for a
prompt that extends a stored one, one that diverges inside a stored block, and an unseen one.

    python benchmarks/divergence-index/measure.py --out benchmarks/divergence-index/results.json
    python benchmarks/divergence-index/measure.py --only connector --out benchmarks/divergence-index/results.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.metadata
import json
import os
import platform
import random
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

LOOPBACK = "127.0.0.1"
ENV = {"MC_TCP_BIND_ADDRESS": LOOPBACK, "VLLM_HOST_IP": LOOPBACK}
os.environ.update(ENV)  # before the Mooncake client is imported (MooncakeStore imports it lazily)

from connector.config import KVToolConfig, divergence_grid  # noqa: E402
from connector.data import RequestSave  # noqa: E402
from connector.hashing import RequestIdentity  # noqa: E402
from connector.keys import KeyKind, Namespace, decode_key, watermark_key  # noqa: E402
from connector.mooncake import MooncakeStore  # noqa: E402
from connector.objects import HEADER_SIZE, pointer_size  # noqa: E402
from connector.prefix import PromptKeys, plan_save  # noqa: E402
from connector.search import StoredPrefix, find_stored_prefixes  # noqa: E402
from connector.saver import ObjectCopy, Saver, SaveJob  # noqa: E402
from connector.lookups import POINTER_READ_SHARE, pointer_reader  # noqa: E402
from connector.saveplans import save_transfer  # noqa: E402
from connector.store import KVStore, PutOutcome, open_store  # noqa: E402
from connector.worker import WorkerSide  # noqa: E402

MOONCAKE_PACKAGE = "mooncake-transfer-engine-non-cuda"
POINTER_BYTES = 160  # an 80-byte header plus the ~75-character key of the containing object
BLOCK_BYTES = 200 * 1024
SMALL_CHECKPOINTS = (5_000, 20_000, 50_000)  # cumulative keys at which the master's memory is read
BLOCK_CHECKPOINTS = (1_000, 2_000, 4_000)
SEGMENT_BYTES = 2 << 30  # the client's global segment (4,000 blocks of 200 KiB fill 0.8 GiB)
LOCAL_BUFFER_BYTES = 64 << 20
BLOCK_SIZES = (16, 32, 64, 256)
GRIDS = (1, 4, 8, 16, 32, 64)
PUT_BATCH_SIZES = (16, 64, 256)  # asked for; the derived table's sizes are added
EXISTS_SIZES = (1, 16, 64, 256, 1024)
FOOTPRINT_SIZES = (100, 150, 160, 161, 176, 200, 240, 256, 1000, BLOCK_BYTES)
EXISTS_REPEATS = 300
WARMUP_CALLS = 20
SETTLE_S = 0.5  # pause before reading the master's RSS


# ---------------------------------------------------------------- the master


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((LOOPBACK, 0))
        return sock.getsockname()[1]


def master_argv(rpc_port: int | str, admin_port: int | str) -> list[str]:
    binary = Path(sys.executable).parent / "mooncake_master"
    return [
        str(binary),
        f"--rpc_address={LOOPBACK}",
        f"--rpc_port={rpc_port}",
        f"--metrics_host={LOOPBACK}",
        f"--metrics_port={admin_port}",
        "--enable_http_metadata_server=false",
    ]


@dataclass
class Master:
    process: subprocess.Popen[bytes]
    address: str
    admin: str

    def rss_bytes(self) -> int:
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise RuntimeError("no VmRSS line")

    def metrics(self) -> dict[str, float]:
        """The master's unlabelled Prometheus samples (key count, allocated bytes, ...)."""
        samples = {}
        for line in httpx.get(f"{self.admin}/metrics", timeout=10).text.splitlines():
            name, _, value = line.partition(" ")
            if line and not line.startswith("#") and "{" not in name:
                samples[name] = float(value)
        return samples

    def cpu_s(self) -> float:
        """CPU seconds the master has used (user + system)."""
        fields = Path(f"/proc/{self.process.pid}/stat").read_text().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def segment_used_bytes(self) -> int:
        detail = httpx.get(f"{self.admin}/get_segments_detail", timeout=10).json()
        return sum(segment["allocator_used_bytes"] for segment in detail["segments"])

    def buffer_addresses(self, keys: Sequence[str]) -> list[int]:
        answer = httpx.get(f"{self.admin}/batch_query_keys", params={"keys": ",".join(keys)}, timeout=10).json()
        return [answer["data"][key]["values"][0]["buffer_address_"] for key in keys]


@contextmanager
def running_master(log_path: Path) -> Iterator[Master]:
    rpc_port, admin_port = free_port(), free_port()
    with open(log_path, "ab") as log:
        process = subprocess.Popen(
            master_argv(rpc_port, admin_port),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, **ENV},
        )
    master = Master(process, f"{LOOPBACK}:{rpc_port}", f"http://{LOOPBACK}:{admin_port}")
    try:
        wait_healthy(master)
        yield master
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def wait_healthy(master: Master, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if master.process.poll() is not None:
            raise RuntimeError(f"mooncake_master exited with {master.process.returncode}")
        try:
            if httpx.get(f"{master.admin}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"mooncake_master not healthy after {timeout_s} s")


def client_config(master: Master) -> KVToolConfig:
    return KVToolConfig(
        master_server_address=master.address,
        global_segment_size=SEGMENT_BYTES,
        local_buffer_size=LOCAL_BUFFER_BYTES,
    )


@contextmanager
def connected_store(master: Master) -> Iterator[MooncakeStore]:
    store = MooncakeStore(client_config(master))
    try:
        yield store
    finally:
        store.close()


def raw_client(store: MooncakeStore) -> Any:
    """The ``MooncakeDistributedStore`` inside the connector's store (for ``put_batch``)."""
    return store._client  # noqa: SLF001 - the store interface has no batch put


# ---------------------------------------------------------------- keys and timing


class Keys:
    """Keys shaped like the connector's: ``kvtool/2/<16 hex>/0/<kind>/<token>/<32 hex>``, never repeated."""

    def __init__(self, seed: int):
        self._random = random.Random(seed)
        self._namespace = self._random.randbytes(8).hex()
        self._token = 0

    def make(self, kind: str, count: int) -> list[str]:
        keys = []
        for _ in range(count):
            self._token += 1
            keys.append(f"kvtool/2/{self._namespace}/0/{kind}/{self._token}/{self._random.randbytes(16).hex()}")
        return keys


@dataclass
class Latency:
    calls: int
    p50_us: float
    p99_us: float
    mean_us: float
    calls_per_s: int


def summarize(samples_ns: Sequence[int]) -> Latency:
    ordered = sorted(samples_ns)

    def at(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] / 1e3

    mean_us = statistics.fmean(ordered) / 1e3
    per_s = round(1e6 / mean_us) if mean_us else 0
    return Latency(len(ordered), round(at(0.50), 1), round(at(0.99), 1), round(mean_us, 1), per_s)


def timed_calls(call: Callable[[int], None], count: int) -> list[int]:
    """Run ``call(i)`` for i in range(count); the nanoseconds each took."""
    samples = []
    for index in range(count):
        start = time.perf_counter_ns()
        call(index)
        samples.append(time.perf_counter_ns() - start)
    return samples


def checked(code: int, what: str) -> None:
    if code != 0:
        raise RuntimeError(f"{what} returned {code}")


# ---------------------------------------------------------------- measurements


@dataclass
class MemoryPoint:
    keys: int
    master_rss_bytes: int
    metrics_key_count: int
    metrics_allocated_bytes: int
    segment_used_bytes: int


def memory_point(master: Master, keys: int) -> MemoryPoint:
    time.sleep(SETTLE_S)
    metrics = master.metrics()
    return MemoryPoint(
        keys,
        master.rss_bytes(),
        int(metrics.get("master_key_count", -1)),
        int(metrics.get("master_allocated_bytes", -1)),
        master.segment_used_bytes(),
    )


@dataclass
class Fill:
    points: list[MemoryPoint]  # the master's memory at 0 keys and at each checkpoint
    put_ns: list[int]  # every put's latency
    keys: list[str]  # what was stored


def fill(master: Master, store: MooncakeStore, keys: Keys, kind: str, value: bytes, checkpoints: Sequence[int]) -> Fill:
    """Single puts (the connector's ``MooncakeStore.put``) up to each checkpoint."""
    result = Fill([memory_point(master, 0)], [], [])
    for target in checkpoints:
        batch = keys.make(kind, target - len(result.keys))
        result.put_ns += timed_calls(lambda i, batch=batch: put_one(store, batch[i], value), len(batch))
        result.keys += batch
        result.points.append(memory_point(master, target))
    return result


def put_one(store: MooncakeStore, key: str, value: bytes) -> None:
    outcome = store.put(key, value)
    if outcome.name != "STORED":
        raise RuntimeError(f"put of {key} answered {outcome}")


def per_key_growth(points: Sequence[MemoryPoint]) -> dict[str, float]:
    """Master RSS per key: from the empty master to the last point, and from the first checkpoint to the last."""
    first, second, last = points[0], points[1], points[-1]
    return {
        "rss_bytes_per_key_from_empty": round((last.master_rss_bytes - first.master_rss_bytes) / last.keys, 1),
        "rss_bytes_per_key_marginal": round(
            (last.master_rss_bytes - second.master_rss_bytes) / (last.keys - second.keys), 1
        ),
        "metrics_allocated_bytes_per_key": round(last.metrics_allocated_bytes / last.keys, 1),
        "segment_used_bytes_per_key": round(last.segment_used_bytes / last.keys, 1),
    }


def segment_strides(master: Master, store: MooncakeStore, keys: Keys, sizes: Sequence[int]) -> dict[int, int]:
    """Bytes the allocator really reserves per object: the usual address step between consecutive puts."""
    strides = {}
    for size in sizes:
        batch = keys.make("f", 8)
        for key in batch:
            put_one(store, key, bytes(size))
        addresses = master.buffer_addresses(batch)
        strides[size] = statistics.median_low(b - a for a, b in zip(addresses, addresses[1:], strict=False))
    return strides


def put_batch_latency(store: MooncakeStore, keys: Keys, size: int) -> dict[str, Any]:
    client, values = raw_client(store), [bytes(POINTER_BYTES)] * size
    repeats = min(300, max(30, 6_000 // size))
    batches = [keys.make("p", size) for _ in range(WARMUP_CALLS + repeats)]

    def call(index: int) -> None:
        checked(client.put_batch(batches[index], values), f"put_batch of {size}")

    samples = timed_calls(call, len(batches))[WARMUP_CALLS:]
    latency = summarize(samples)
    return {**asdict(latency), "us_per_key": round(latency.mean_us / size, 2)}


def exists_latency(store: MooncakeStore, present: Sequence[str], keys: Keys, size: int) -> dict[str, Any]:
    """Existence queries of ``size`` keys, half of them stored; the answers are checked."""
    repeats = EXISTS_REPEATS if size <= 256 else EXISTS_REPEATS // 3
    stored = size // 2
    queries = []
    for index in range(WARMUP_CALLS + repeats):
        start = (index * stored) % max(1, len(present) - stored)
        queries.append(list(present[start : start + stored]) + keys.make("x", size - stored))

    def call(index: int) -> None:
        answer = store.exists(queries[index])
        if sum(answer) != stored:
            raise RuntimeError(f"existence query of {size} found {sum(answer)}, expected {stored}")

    return asdict(summarize(timed_calls(call, len(queries))[WARMUP_CALLS:]))


# ---------------------------------------------------------------- the two runs


def small_objects(log_dir: Path) -> dict[str, Any]:
    keys = Keys(seed=1)
    with running_master(log_dir / "master-small.log") as master, connected_store(master) as store:
        filled = fill(master, store, keys, "p", bytes(POINTER_BYTES), SMALL_CHECKPOINTS)
        return {
            "memory": [asdict(point) for point in filled.points],
            "per_key": per_key_growth(filled.points),
            "put_single": asdict(summarize(filled.put_ns)),
            "put_batch": {size: put_batch_latency(store, keys, size) for size in batch_sizes(PUT_BATCH_SIZES)},
            "exists": {size: exists_latency(store, filled.keys, keys, size) for size in batch_sizes(EXISTS_SIZES)},
            "segment_stride_bytes": segment_strides(master, store, keys, FOOTPRINT_SIZES),
        }


def block_objects(log_dir: Path) -> dict[str, Any]:
    keys = Keys(seed=2)
    with running_master(log_dir / "master-blocks.log") as master, connected_store(master) as store:
        filled = fill(master, store, keys, "b", bytes(BLOCK_BYTES), BLOCK_CHECKPOINTS)
        return {
            "memory": [asdict(point) for point in filled.points],
            "per_key": per_key_growth(filled.points),
            "put_single": asdict(summarize(filled.put_ns)),
        }


# ---------------------------------------------------------------- the derived table


def pointers_per_block(block: int, grid: int, lead: bool = False) -> int:
    """A pointer at each multiple of the grid strictly inside a block (a block starts at a multiple of the
    grid or of B), and at its first token with ``lead`` (off the grid: lead pointers exist where the grid
    exceeds extend_min_tokens); none without a grid (0)."""
    return int(lead) + (block - 1) // grid if grid else 0


def batch_sizes(asked: Sequence[int]) -> list[int]:
    """The sizes asked for plus every pointer count of the derived table, so it needs no interpolation."""
    derived = {pointers_per_block(block, grid) for block in BLOCK_SIZES for grid in GRIDS}
    return sorted(set(asked) | derived - {0})


def derived_row(block: int, grid: int, small: dict[str, Any], blocks: dict[str, Any]) -> dict[str, Any]:
    count = pointers_per_block(block, grid)
    master_bytes = count * small["per_key"]["rss_bytes_per_key_marginal"]
    segment_bytes = count * small["segment_stride_bytes"][POINTER_BYTES]
    block_put_us = blocks["put_single"]["mean_us"]
    batched_us = small["put_batch"][count]["mean_us"] if count else 0.0
    return {
        "block_size": block,
        "grid": grid,
        "pointer_keys_per_block": count,
        "keys_per_block_vs_no_index": count + 1,  # the master's key count grows by this factor
        "max_tokens_short_of_exact_prefix": grid - 1 if count else block - 1,
        "master_rss_bytes_per_block": round(master_bytes),
        "segment_bytes_per_block": segment_bytes,
        "index_bytes_per_token": round((master_bytes + segment_bytes) / block, 1),
        "put_us_per_block_sequential": round(count * small["put_single"]["mean_us"]),
        "put_us_per_block_batched": round(batched_us),
        "put_batched_vs_block_put": round(batched_us / block_put_us, 2),
        "lookup_exists_p50_us": small["exists"][count]["p50_us"] if count else 0.0,
        "lookup_exists_p99_us": small["exists"][count]["p99_us"] if count else 0.0,
    }


def derived_table(small: dict[str, Any], blocks: dict[str, Any]) -> list[dict[str, Any]]:
    return [derived_row(block, grid, small, blocks) for block in BLOCK_SIZES for grid in GRIDS]


def markdown(rows: Sequence[dict[str, Any]]) -> str:
    header = list(rows[0])
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(row[name]) for name in header) + " |" for row in rows]
    return "\n".join(lines)


# ---------------------------------------------------------------- connector level


CONNECTOR_OBJECT_BYTES = {32: 64 << 10, 256: 256 << 10}  # block size -> payload of one block object
SAVED_BLOCKS = 8  # a saved prompt: 8 full blocks and a tail of half a block
CONNECTOR_SAVES = 40  # timed saves per setting (distinct prompts), after WARMUP_SAVES
WARMUP_SAVES = 5
# Timed lookups per case (distinct prompts), after WARMUP_LOOKUPS: fewer at B = 256, where one lookup takes
# a tenth of a second or more of Python work (the candidate scan in connector/prefix.py grows as B squared).
LOOKUPS = {32: 200, 256: 30}
WARMUP_LOOKUPS = 5
DIVERGE_AT = 4 * 8 + 5  # case (b): prompts leave a stored one 5/8 into its block 4 (in eighths of a block)
SHORT_SHARED = 3  # case "short": prompts share a stored one's first 3/16 block (a short system prompt)
ROOT = RequestIdentity().root_hash()
DEFAULTS = KVToolConfig(master_server_address="127.0.0.1:1")  # the connector's default settings
STORED_TOKENS = (1, 50_000)  # stored prompts draw from here, new tokens from above: they always differ
NEW_TOKENS = (50_000, 100_000)


def connector_grids(block: int) -> tuple[int, ...]:
    """Off, the connector's default (``auto``, asked of the connector), every token."""
    auto = divergence_grid(DEFAULTS, block)
    return (0, auto, 1)


@dataclass(frozen=True)
class Setting:
    """One block size and grid, under its own namespace (so its keys are counted apart)."""

    block: int
    grid: int

    @property
    def namespace(self) -> Namespace:
        return Namespace(f"divergence-index-g{self.grid}", "bfloat16", "NHD", self.block, 1, 1, 1)

    @property
    def object_bytes(self) -> int:
        return HEADER_SIZE + CONNECTOR_OBJECT_BYTES[self.block]

    @property
    def prompt_tokens(self) -> int:
        return SAVED_BLOCKS * self.block + self.block // 2

    @property
    def lead(self) -> bool:
        """Whether saves put lead pointers too, at each object's first token (the connector's rule: a grid
        wider than ``extend_min_tokens``)."""
        return self.grid > DEFAULTS.extend_min_tokens

    def keys(self, tokens: Sequence[int]) -> PromptKeys:
        namespace = self.namespace.key_component()
        return PromptKeys.build(tokens, self.block, 1, namespace, ROOT, grid=self.grid, lead_pointers=self.lead)

    def pointers_per_save(self) -> int:
        tail = self.prompt_tokens % self.block
        return SAVED_BLOCKS * pointers_per_block(self.block, self.grid, self.lead) + pointers_per_block(
            tail, self.grid, self.lead
        )

    def keys_per_save(self) -> int:
        """Objects (blocks and tail), their pointers, and the save's two watermark records."""
        return SAVED_BLOCKS + 1 + self.pointers_per_save() + 2


class Tokens:
    def __init__(self, seed: int):
        self._random = random.Random(seed)

    def draw(self, count: int, span: tuple[int, int]) -> list[int]:
        return [self._random.randrange(*span) for _ in range(count)]


class CallLog:
    """A ``KVStore`` that adds up the time and keys of each kind of call to the store under it."""

    def __init__(self, store: KVStore):
        self._store = store
        self.ns: Counter[str] = Counter()
        self.keys: Counter[str] = Counter()

    @contextmanager
    def _timed(self, phase: str, keys: int) -> Iterator[None]:
        start = time.perf_counter_ns()
        try:
            yield
        finally:
            self.ns[phase] += time.perf_counter_ns() - start
            self.keys[phase] += keys

    def exists(self, keys: Sequence[str]) -> list[bool]:
        with self._timed("exists", len(keys)):
            return self._store.exists(keys)

    def get(self, keys: Sequence[str], object_bytes: int = 0) -> list[bytes | None]:
        with self._timed("get", len(keys)):
            return self._store.get(keys, object_bytes)

    def put(self, key: str, value: bytes) -> PutOutcome:
        decoded = decode_key(key)
        with self._timed("watermarks" if decoded and decoded.kind is KeyKind.WATERMARK else "objects", 1):
            return self._store.put(key, value)

    def put_many(self, items: Sequence[tuple[str, bytes]], replace: bool = False) -> PutOutcome:
        with self._timed("pointers", len(items)):
            return self._store.put_many(items, replace)

    def remove(self, key: str) -> int:
        return self._store.remove(key)

    def close(self) -> None:
        self._store.close()

    def clear(self) -> None:
        self.ns.clear()
        self.keys.clear()


def save_job(setting: Setting, worker: WorkerSide, tokens: Sequence[int], number: int) -> SaveJob:
    """A save as the worker hands it to the put thread: its objects copied (zeros of a block object's
    size), each with its pointer records built by the worker."""
    keys = setting.keys(tokens)
    transfers = tuple(save_transfer(keys, ref, block_id) for block_id, ref in enumerate(plan_save(keys)))
    save = RequestSave(f"bench-{number}", transfers, prompt_tokens=len(tokens))
    value = bytes(setting.object_bytes)
    copies = [
        ObjectCopy(index, worker._key(transfer), value, worker._pointers(transfer))  # noqa: SLF001
        for index, transfer in enumerate(transfers)
    ]
    ns_key = setting.namespace.key_component()
    return SaveJob(save, copies, lambda seq: watermark_key(ns_key, save.watermark_id, seq))


def timed_saves(setting: Setting, log: CallLog, prompts: Sequence[list[int]]) -> list[Counter[str]]:
    """The put thread's work (``Saver._run``) for each prompt's save: its time in all and per call kind."""
    worker = WorkerSide(setting.namespace, None, DEFAULTS, saves_enabled=False)
    saver = Saver(log, budget_bytes=1 << 40, drain_timeout_s=1.0)
    spent = []
    for number, tokens in enumerate(prompts):
        job = save_job(setting, worker, tokens, number)
        log.clear()
        start = time.perf_counter_ns()
        saver._run(job)  # noqa: SLF001 - the put thread's body for one save, on this thread to time it
        spent.append(Counter(total=time.perf_counter_ns() - start, **log.ns))
    saver.shutdown()
    check_saves(setting, saver.take_stats(), len(prompts))
    return spent


def check_saves(setting: Setting, stats: dict[str, int], saves: int) -> None:
    pointers = setting.pointers_per_save() * saves
    if stats.get("saves_stored") != (SAVED_BLOCKS + 1) * saves or stats.get("pointers_stored", 0) != pointers:
        raise RuntimeError(f"saves at {setting} did not all store: {stats}")


def save_summary(setting: Setting, spent: Sequence[Counter[str]]) -> dict[str, Any]:
    """Per save: the whole put thread's work, then its parts (p50 of each)."""
    parts = {phase: summarize([s[phase] for s in spent]).p50_us for phase in ("objects", "pointers")}
    other = summarize([s["exists"] + s["watermarks"] for s in spent]).p50_us
    total = summarize([s["total"] for s in spent])
    objects = SAVED_BLOCKS + 1
    return {
        "saves": len(spent),
        "objects_per_save": objects,
        "object_bytes": setting.object_bytes,
        "pointers_per_save": setting.pointers_per_save(),
        "save": asdict(total),
        "objects_p50_us": parts["objects"],
        "pointer_batch_p50_us": parts["pointers"],
        "exists_and_watermarks_p50_us": other,
        "save_p50_us_per_object": round(total.p50_us / objects, 1),
        "pointer_batch_vs_object_puts": round(parts["pointers"] / parts["objects"], 3),
    }


def lookup_prompts(setting: Setting, tokens: Tokens, stored: Sequence[list[int]], case: str) -> list[PromptKeys]:
    """Distinct prompts of one case: stored prompts extended by a block of new tokens, stored prompts
    left 5/8 into block 4 (as long as the stored prompt), the last stored prompt's first 3/16 block then
    new tokens (a short system prompt; the last one, so that no later save replaced the lead pointer it
    hits through), or new prompts of the stored length."""
    block, length = setting.block, setting.prompt_tokens
    common = {"extends": length, "diverges": DIVERGE_AT * block // 8, "short": SHORT_SHARED * block // 16, "unseen": 0}[
        case
    ]
    total = length + block if case == "extends" else length
    prompts = []
    for index in range(WARMUP_LOOKUPS + LOOKUPS[block]):
        head = (stored[-1] if case == "short" else stored[index % len(stored)])[:common]
        prompts.append(setting.keys(head + tokens.draw(total - common, NEW_TOKENS)))
    return prompts


def expected_hit(setting: Setting, case: str) -> int:
    """The hit each case should find: the stored tail; the exact divergence point (a pointer's token ids
    extend the hit from the grid point before it; whole blocks without a grid); nothing."""
    if case == "extends":
        return setting.prompt_tokens
    if case == "unseen":
        return 0
    if case == "short":  # inside the first block: through its lead pointer, else the grid's points
        common = SHORT_SHARED * setting.block // 16
        if setting.lead and common >= DEFAULTS.extend_min_tokens:
            return common
        return common if setting.grid and common >= setting.grid else 0
    common = DIVERGE_AT * setting.block // 8
    return common if setting.grid else common // setting.block * setting.block


def timed_lookups(setting: Setting, log: CallLog, prompts: Sequence[PromptKeys], expected: int) -> dict[str, Any]:
    """``find_stored_prefixes`` for one prompt at a time, with the scheduler's pointer reader; every hit
    checked."""
    read = pointer_reader(log, DEFAULTS.lookup_timeout_s * POINTER_READ_SHARE, setting.block)
    found: list[StoredPrefix] = []

    def call(index: int) -> None:
        found.append(find_stored_prefixes([prompts[index]], log.exists, read, DEFAULTS.extend_min_tokens)[0])

    log.clear()
    samples = timed_calls(call, len(prompts))
    hits = {prefix.hit_tokens for prefix in found}
    if hits != {expected}:
        raise RuntimeError(f"lookups at {setting} found {sorted(hits)} tokens, expected {expected}")
    calls = len(prompts)  # the per-lookup means below include the warm-up lookups
    return {
        "hit_tokens": expected,
        "round_trips": sorted({prefix.queries for prefix in found}),
        "hits_through_a_pointer": sum(bool(prefix.targets) for prefix in found[WARMUP_LOOKUPS:]),
        "hits_extended_by_token_ids": sum(bool(prefix.extended) for prefix in found[WARMUP_LOOKUPS:]),
        "keys_asked_per_lookup": round(log.keys["exists"] / calls, 1),
        "records_read_per_lookup": round(log.keys["get"] / calls, 1),
        "store_calls_mean_us": round((log.ns["exists"] + log.ns["get"]) / calls / 1e3, 1),
        **asdict(summarize(samples[WARMUP_LOOKUPS:])),
    }


LOOKUP_CASES = ("extends", "diverges", "short", "unseen")


def measure_setting(master: Master, log: CallLog, setting: Setting, tokens: Tokens) -> dict[str, Any]:
    prompts = [tokens.draw(setting.prompt_tokens, STORED_TOKENS) for _ in range(WARMUP_SAVES + CONNECTOR_SAVES)]
    keys_before = int(master.metrics()["master_key_count"])
    spent = timed_saves(setting, log, prompts)[WARMUP_SAVES:]
    keys_after = int(master.metrics()["master_key_count"])
    lookups = {
        case: timed_lookups(setting, log, lookup_prompts(setting, tokens, prompts, case), expected_hit(setting, case))
        for case in LOOKUP_CASES
    }
    added = keys_after - keys_before
    return {
        "block_size": setting.block,
        "grid": setting.grid,
        **save_summary(setting, spent),
        "master_keys_added": added,
        "master_key_count_after": keys_after,
        "keys_per_save_measured": round(added / len(prompts), 2),
        "keys_per_save_expected": setting.keys_per_save(),
        "keys_per_full_block_expected": 1 + pointers_per_block(setting.block, setting.grid, setting.lead),
        "block_lead_pointers": setting.lead,
        "lookups": lookups,
    }


def machine_busy_cpu_s() -> float:
    """CPU seconds the whole machine has spent busy since boot (/proc/stat: all but idle and iowait)."""
    fields = [int(value) for value in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def own_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def connector_level(log_dir: Path) -> dict[str, Any]:
    """Every setting against one fresh master, through the connector's store stack; and the CPU time
    the rest of the machine used meanwhile (near 0 on an otherwise idle machine)."""
    tokens = Tokens(seed=3)
    settings = [Setting(block, grid) for block in CONNECTOR_OBJECT_BYTES for grid in connector_grids(block)]
    started, busy, own = time.monotonic(), machine_busy_cpu_s(), own_cpu_s()
    with running_master(log_dir / "master-connector.log") as master:
        log = CallLog(open_store(client_config(master)))
        try:
            rows = [measure_setting(master, log, setting, tokens) for setting in settings]
        finally:
            log.close()
        master_cpu = master.cpu_s()
    cpu = {
        "wall_s": time.monotonic() - started,
        "machine_busy_cpu_s": machine_busy_cpu_s() - busy,
        "this_process_cpu_s": own_cpu_s() - own,
        "master_cpu_s": master_cpu,
    }
    cpu["other_processes_cpu_s"] = cpu["machine_busy_cpu_s"] - cpu["this_process_cpu_s"] - master_cpu
    return {"cpu": {name: round(value, 1) for name, value in cpu.items()}, "settings": rows}


def connector_configuration() -> dict[str, Any]:
    return {
        "store": "connector.store.open_store (TimedStore over MooncakeStore; no circuit breaker)",
        "object_payload_bytes": CONNECTOR_OBJECT_BYTES,
        "object_header_bytes": HEADER_SIZE,
        "pointer_record_bytes_max": {block: pointer_size(block) for block in CONNECTOR_OBJECT_BYTES},
        "saved_prompt": f"{SAVED_BLOCKS} full blocks + a tail of half a block",
        "saves_per_setting": CONNECTOR_SAVES,
        "warmup_saves": WARMUP_SAVES,
        "lookups_per_case": LOOKUPS,
        "warmup_lookups": WARMUP_LOOKUPS,
        "hash_unit": 1,
        "diverges_at": f"{DIVERGE_AT}/8 of a block",
    }


SAVE_COLUMNS = (
    "block_size",
    "grid",
    "pointers_per_save",
    "objects_p50_us",
    "pointer_batch_p50_us",
    "exists_and_watermarks_p50_us",
    "save_p50_us_per_object",
    "keys_per_save_measured",
    "keys_per_save_expected",
)


def connector_tables(rows: Sequence[dict[str, Any]]) -> str:
    saves = [{**{name: row[name] for name in SAVE_COLUMNS}, "save_p50_us": row["save"]["p50_us"]} for row in rows]
    lookups = [
        {"B": row["block_size"], "G": row["grid"], "case": case, **found}
        for row in rows
        for case, found in row["lookups"].items()
    ]
    return markdown(saves) + "\n\n" + markdown(lookups)


# ---------------------------------------------------------------- main


def configuration(command: list[str]) -> dict[str, Any]:
    return {
        "command": " ".join(command),
        "date_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "mooncake_package": f"{MOONCAKE_PACKAGE}=={importlib.metadata.version(MOONCAKE_PACKAGE)}",
        "machine": {"cpu_cores": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "master_flags": master_argv("<free port>", "<free port>")[1:],
        "client": {
            "global_segment_size": SEGMENT_BYTES,
            "local_buffer_size": LOCAL_BUFFER_BYTES,
            "protocol": "tcp",
            "metadata_server": "P2PHANDSHAKE",
        },
        "environment": ENV,
        "pointer_value_bytes": POINTER_BYTES,
        "block_value_bytes": BLOCK_BYTES,
        "small_checkpoints": SMALL_CHECKPOINTS,
        "block_checkpoints": BLOCK_CHECKPOINTS,
        "put_batch_sizes": batch_sizes(PUT_BATCH_SIZES),
        "exists_sizes": batch_sizes(EXISTS_SIZES),
        "exists_repeats": EXISTS_REPEATS,
        "warmup_calls": WARMUP_CALLS,
        "block_sizes": BLOCK_SIZES,
        "grids": GRIDS,
    }


def store_level(log_dir: Path, command: list[str]) -> dict[str, Any]:
    started = time.monotonic()
    small = small_objects(log_dir)
    blocks = block_objects(log_dir)
    return {
        "configuration": configuration(command),
        "small_objects": small,
        "block_objects": blocks,
        "derived": derived_table(small, blocks),
        "elapsed_s": round(time.monotonic() - started, 1),
    }


def connector_run(log_dir: Path, command: list[str]) -> dict[str, Any]:
    stamp = configuration(command)
    return {
        "configuration": {name: stamp[name] for name in ("command", "date_utc", "mooncake_package", "machine")}
        | connector_configuration(),
        **connector_level(log_dir),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="results JSON file")
    parser.add_argument("--log-dir", type=Path, default=Path(tempfile.gettempdir()) / "kvtool-divergence-index")
    parser.add_argument(
        "--only", choices=("store", "connector"), help="run one part; the other's results in --out are kept"
    )
    args = parser.parse_args()
    args.log_dir.mkdir(parents=True, exist_ok=True)
    command = [Path(sys.executable).name, *sys.argv]
    results = json.loads(args.out.read_text()) if args.only and args.out.exists() else {}
    if args.only != "connector":
        results.update(store_level(args.log_dir, command))
        print(markdown(results["derived"]))
    if args.only != "store":
        results["connector"] = connector_run(args.log_dir, command)
        print(connector_tables(results["connector"]["settings"]))
        print(f"CPU during the connector run: {results['connector']['cpu']}")
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
