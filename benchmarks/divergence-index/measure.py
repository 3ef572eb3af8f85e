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

A third run, through the connector's own code, is ``connector_level.py`` (its own command; it uses the
master and timing helpers here).

    python benchmarks/divergence-index/measure.py --out benchmarks/divergence-index/results.json
    python benchmarks/divergence-index/connector_level.py --out benchmarks/divergence-index/results.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.metadata
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any


LOOPBACK = "127.0.0.1"
ENV = {"MC_TCP_BIND_ADDRESS": LOOPBACK, "VLLM_HOST_IP": LOOPBACK}
os.environ.update(ENV)  # before the Mooncake client is imported (MooncakeStore imports it lazily)

from connector.config import KVToolConfig  # noqa: E402
from kvtool.portable import portable  # noqa: E402
from connector.store.mooncake import MooncakeStore  # noqa: E402
from kvtool import web  # noqa: E402
from kvtool.store.master import LocalMaster  # noqa: E402
from kvtool.store.mooncake import master_argv  # noqa: E402

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
        for line in web.get(f"{self.admin}/metrics", timeout=10).text.splitlines():
            name, _, value = line.partition(" ")
            if line and not line.startswith("#") and "{" not in name:
                samples[name] = float(value)
        return samples

    def cpu_s(self) -> float:
        """CPU seconds the master has used (user + system)."""
        fields = Path(f"/proc/{self.process.pid}/stat").read_text().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def segment_used_bytes(self) -> int:
        detail = web.get(f"{self.admin}/get_segments_detail", timeout=10).json()
        return sum(segment["allocator_used_bytes"] for segment in detail["segments"])

    def buffer_addresses(self, keys: Sequence[str]) -> list[int]:
        answer = web.get(f"{self.admin}/batch_query_keys", params={"keys": ",".join(keys)}, timeout=10).json()
        return [answer["data"][key]["values"][0]["buffer_address_"] for key in keys]


@contextmanager
def running_master(log_path: Path) -> Iterator[Master]:
    with LocalMaster(log_path) as local:
        assert local.process is not None
        yield Master(local.process, local.address, local.admin)


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


# ---------------------------------------------------------------- main


def configuration(command: list[str]) -> dict[str, Any]:
    return {
        "command": " ".join(command),
        "date_utc": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "mooncake_package": f"{MOONCAKE_PACKAGE}=={importlib.metadata.version(MOONCAKE_PACKAGE)}",
        "machine": {"cpu_cores": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "master_flags": master_argv("<free port>", "<free port>")[1:],  # kvtool.store.master.LocalMaster
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="results JSON file")
    parser.add_argument("--log-dir", type=Path, default=Path(tempfile.gettempdir()) / "kvtool-divergence-index")
    args = parser.parse_args()
    args.log_dir.mkdir(parents=True, exist_ok=True)
    command = [Path(sys.executable).name, *sys.argv]
    # The connector-level part (connector_level.py) writes its own key of the same file: kept.
    kept = json.loads(args.out.read_text()) if args.out.exists() else {}
    results = {"connector": kept["connector"]} if "connector" in kept else {}
    results.update(store_level(args.log_dir, command))
    print(markdown(results["derived"]))
    args.out.write_text(json.dumps(portable(results), indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
