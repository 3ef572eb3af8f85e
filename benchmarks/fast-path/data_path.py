"""The connector's data path against the raw store, side by side in one run.

A real-size block (Llama-3-8B-like: 32 layers, 8 KV heads of 128, bfloat16, block 16: 2 MiB a block)
and a save or load of ``--blocks`` blocks. A loopback ``mooncake_master``, a second process that lends
the store its only segment (so every transfer crosses processes, as between a producer and a
consumer), and this process as the engine, which lends nothing. In every round, interleaved:

- raw put: ``batch_put_from`` of the objects' bytes from a registered buffer (the floor a connector
  can reach with these calls);
- connector save: ``WorkerSide.wait_for_save`` (the engine step's copy into the save staging area)
  until the put thread has put every object (existence query, checksums and headers, one
  ``batch_put_from``);
- raw get: ``batch_get_into`` of those objects into a registered buffer;
- connector load: ``WorkerSide.start_load_kv`` until ``get_finished`` reports the request (one
  ``batch_get_into`` into the load staging area, every header and checksum checked, every block copied
  into the KV cache).

The segment is filled once with filler objects and emptied before the rounds, so every path writes
into memory already touched (a fresh segment's first-touch page faults would otherwise land on
whichever path wrote there first).
MB/s per path, the median of ``--rounds`` rounds; ``save_vs_raw`` and ``load_vs_raw`` are the ratios.

    .venv/bin/python benchmarks/fast-path/data_path.py [--blocks 48] [--rounds 5] [--repeats 1] [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
import zlib
from pathlib import Path

os.environ.update({"MC_TCP_BIND_ADDRESS": "127.0.0.1", "VLLM_HOST_IP": "127.0.0.1"})

import torch  # noqa: E402

from connector.config import load_config  # noqa: E402
from connector.data import BlockTransfer, KVToolMetadata, RequestLoad, RequestSave  # noqa: E402
from connector.core.keys import Namespace  # noqa: E402
from connector.core.objects import HEADER_SIZE, payload_checksum  # noqa: E402
from connector.core.prefix import PromptKeys, plan_save  # noqa: E402
from connector.store.stack import open_store_stack  # noqa: E402
from connector.worker.worker import WorkerSide  # noqa: E402
from kvtool.store.master import LocalMaster  # noqa: E402
from published import provenance, write_result  # noqa: E402 - the sibling module

LAYERS, HEADS, DIM, BLOCK = 32, 8, 128, 16
NS = Namespace(
    model="bench",
    dtype="bfloat16",
    kv_layout="bench",
    block_size=BLOCK,
    num_layers=LAYERS,
    num_kv_heads=HEADS,
    head_size=DIM,
)
OWNER = """
import os, sys, time
os.environ["MC_TCP_BIND_ADDRESS"] = "127.0.0.1"
from mooncake.store import MooncakeDistributedStore
client = MooncakeDistributedStore()
code = client.setup("127.0.0.1", "P2PHANDSHAKE", int(sys.argv[2]), 16 << 20, "tcp", "", sys.argv[1])
print(code, flush=True)
sys.stdin.read()  # lend the segment until the benchmark closes stdin
"""


def segment_owner(master: str, nbytes: int) -> subprocess.Popen:
    owner = subprocess.Popen(
        [sys.executable, "-c", OWNER, master, str(nbytes)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    if owner.stdout.readline().strip() != "0":
        raise RuntimeError("the segment owner could not join the store")
    return owner


def engine(config, blocks: int, device: str = "cpu") -> tuple[WorkerSide, dict[str, torch.Tensor]]:
    """A worker on a Llama-3-8B-like KV cache; on ``cuda`` the cache is on the GPU (the copies then go
    through the pinned staging areas on copy streams, ``connector/devicecopy.py``)."""
    shape = (blocks + 1, 2, HEADS, BLOCK, DIM)
    caches = {f"layer.{i}": torch.randn(shape).to(torch.bfloat16).to(device) for i in range(LAYERS)}
    side = WorkerSide(NS, open_store_stack(config, "worker"), config, saves_enabled=True)
    side.register_kv_caches(caches, [list(caches)], blocks + 1)
    return side, caches


def save_of(round_number: int, blocks: int) -> RequestSave:
    tokens = [(round_number * 7919 + i) % 50_000 for i in range(blocks * BLOCK)]
    keys = PromptKeys.build(tokens, BLOCK, 1, NS.key_component(), round_number.to_bytes(16, "little"))
    transfers = tuple(
        BlockTransfer(ref.block_index + 1, ref.kind, ref.token_start, ref.token_end, ref.chain_hash)
        for ref in plan_save(keys)
    )
    return RequestSave(f"save-{round_number}", transfers, prompt_tokens=len(tokens), checkpoint=True)


def wait(predicate, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not end within {timeout_s} s")
        time.sleep(0.0005)


def connector_save(side: WorkerSide, save: RequestSave) -> float:
    area = side._saver.area  # noqa: SLF001 - the put has returned when its slots are back
    start = time.perf_counter()
    side.wait_for_save(KVToolMetadata(saves=[save]))
    wait(lambda: area.free_slots == area.slots, "a save")
    return time.perf_counter() - start


def connector_load(side: WorkerSide, save: RequestSave) -> float:
    load = RequestLoad(f"load-{save.req_id}", save.transfers)
    start = time.perf_counter()
    side.start_load_kv(KVToolMetadata(loads=[load]))
    done: list[tuple[set[str], set[str]]] = []
    wait(lambda: bool(done.append(side.get_finished()) or done[-1][0]), "a load")
    elapsed = time.perf_counter() - start
    if done[-1][1]:
        raise RuntimeError(f"the connector's load failed: {side.take_stats()}")
    return elapsed


class Raw:
    """The floor: the same objects, straight between the store and a registered buffer."""

    def __init__(self, client, count: int, size: int):
        self.client, self.count, self.size = client, count, size
        self.source = torch.randint(0, 255, (count * size,), dtype=torch.uint8)
        self.target = torch.zeros(count * size, dtype=torch.uint8)
        for buffer in (self.source, self.target):
            if client.register_buffer(buffer.data_ptr(), buffer.numel()) != 0:
                raise RuntimeError("could not register the raw buffers")

    def keys(self, round_number: int) -> list[str]:
        return [f"raw/{round_number}/{i}" for i in range(self.count)]

    def _args(self, buffer: torch.Tensor, round_number: int) -> tuple[list[str], list[int], list[int]]:
        keys = self.keys(round_number)
        return keys, [buffer.data_ptr() + i * self.size for i in range(self.count)], [self.size] * self.count

    def touch_segment(self, nbytes: int) -> None:
        """Fill the store's segment with filler objects, then remove them: its pages are touched."""
        fillers = [f"filler/{i}" for i in range(int(nbytes * 0.85) // self.size)]
        for start in range(0, len(fillers), self.count):
            batch = fillers[start : start + self.count]
            self.client.batch_put_from(batch, self._args(self.source, 0)[1][: len(batch)], [self.size] * len(batch))
        for key in fillers:
            self.client.remove(key)

    def put(self, round_number: int) -> float:
        start = time.perf_counter()
        codes = self.client.batch_put_from(*self._args(self.source, round_number))
        elapsed = time.perf_counter() - start
        if any(code != 0 for code in codes):
            raise RuntimeError(f"raw put failed: {sorted(set(codes))}")
        return elapsed

    def get(self, round_number: int) -> float:
        start = time.perf_counter()
        counts = self.client.batch_get_into(*self._args(self.target, round_number))
        elapsed = time.perf_counter() - start
        if any(count != self.size for count in counts):
            raise RuntimeError(f"raw get failed: {sorted(set(counts))}")
        return elapsed


def cpu_work(nbytes: int) -> dict[str, list[float]]:
    """What the connector adds to a transfer, per byte, on this machine: the checksum of every object
    (XXH3-64 since format 3; CRC-32, format 2's, beside it) and the copy between the staging area and
    the KV cache (both made once per object and direction)."""
    source = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    target = torch.empty_like(source)
    target.copy_(source)  # first touch
    crc, checksum, copy = [], [], []
    for _ in range(5):
        start = time.perf_counter()
        zlib.crc32(memoryview(source.numpy()))
        crc.append(time.perf_counter() - start)
        start = time.perf_counter()
        payload_checksum(memoryview(source.numpy()))
        checksum.append(time.perf_counter() - start)
        start = time.perf_counter()
        target.copy_(source)
        copy.append(time.perf_counter() - start)
    return {"xxh3_64": checksum, "crc32": crc, "host_copy": copy}


def measure(blocks: int, rounds: int, device: str = "cpu") -> dict:
    block_bytes = LAYERS * 2 * HEADS * BLOCK * DIM * 2
    object_bytes = HEADER_SIZE + block_bytes
    total = blocks * object_bytes
    local = LocalMaster().start()
    master = local.address
    segment = int((2 * rounds + 2) * total / 0.75)  # below the master's eviction high watermark (0.9)
    owner = segment_owner(master, segment)
    try:
        config = load_config(
            {
                "master_server_address": master,
                "global_segment_size": 0,
                "save_buffer_bytes": total,
                "load_buffer_bytes": total,
                "load_timeout_s": 60,
                "save_timeout_s": 60,
            }
        )
        side, _ = engine(config, blocks, device)
        raw = Raw(side._store._store._client, blocks, object_bytes)  # noqa: SLF001 - the same client
        raw.touch_segment(segment)
        spent: dict[str, list[float]] = {"raw_put": [], "connector_save": [], "raw_get": [], "connector_load": []}
        for number in range(rounds + 1):  # round 0 warms every path up (first-touch pages, connections)
            save = save_of(number, blocks)
            times = {
                "raw_put": raw.put(number),
                "connector_save": connector_save(side, save),
                "raw_get": raw.get(number),
                "connector_load": connector_load(side, save),
            }
            for name, seconds in times.items():
                if number:
                    spent[name].append(seconds)
        stats = side.take_stats()
        side.shutdown()
    finally:
        owner.stdin.close()
        owner.wait(timeout=30)
        local.stop()
    spent.update(cpu_work(total))
    mb_s = {name: round(total / 1e6 / statistics.median(values), 1) for name, values in spent.items()}
    return {
        "mb_per_s": mb_s,
        "save_vs_raw": round(mb_s["connector_save"] / mb_s["raw_put"], 3),
        "load_vs_raw": round(mb_s["connector_load"] / mb_s["raw_get"], 3),
        "seconds": {name: [round(v, 4) for v in values] for name, values in spent.items()},
        "connector_counts": {k: v for k, v in stats.items() if k.startswith(("saves_", "objects_", "bytes_", "load"))},
        "object_bytes": object_bytes,
        "objects": blocks,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=1, help="whole runs (a fresh master each); the median")
    parser.add_argument("--device", default="cpu", help="where the KV cache is: cpu, or cuda (the GPU path)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    runs = [measure(args.blocks, args.rounds, args.device) for _ in range(args.repeats)]
    # The run whose save ratio is the median, with every run's ratios beside it: on a shared 2-core
    # machine whole runs drift by a few percent either way.
    result = sorted(runs, key=lambda run: run["save_vs_raw"])[len(runs) // 2]
    if len(runs) > 1:
        for name in ("save_vs_raw", "load_vs_raw"):
            result[f"{name}_runs"] = [run[name] for run in runs]
            result[name] = statistics.median(run[name] for run in runs)
    result["configuration"] = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "layout": {"layers": LAYERS, "kv_heads": HEADS, "head_size": DIM, "block": BLOCK, "dtype": "bfloat16"},
        "device": args.device,
        "transport": "Mooncake TCP over loopback, the segment in a second process",
        **provenance(),
    }
    write_result(result, args.out)


if __name__ == "__main__":
    main()
