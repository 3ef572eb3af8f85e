"""What a save costs in CPU when the segment it lands in is fresh, with and without the fault-in.

An engine in the embedded mode lends the store a segment (``global_segment_size``) and its puts are
copied into it by the store client's transfer thread, in the engine's process. Mooncake leaves the
segment's pages untouched, so each put into a fresh part of it first takes a page fault per 4 KiB;
``prefault_segment`` (``connector/segment.py``) faults them in at start-up instead.

Each measurement runs in a fresh process (a fresh segment of ``--segment-mib``) against a loopback
master, with the fault-in off and on, alternating, ``--rounds`` times:

- raw: ``batch_put_from`` of 4 objects of 640 KiB (a 100-token save of the bench model is 2.5 MB),
  each batch to new keys (so new segment memory), ``--puts`` batches;
- connector: ``WorkerSide.wait_for_save`` of 100-token prompts of the bench model (12 layers, 4 KV
  heads of 64, float32, block 32: 3 blocks and a 4-token tail, with their pointers and watermark
  records), each waited for until its put ended, ``--puts`` saves.

CPU is every thread's of the process (``/proc/self/task/*/schedstat``: the put and copy threads,
the store client's own threads), per put or save; wall is per put or save too. The master's CPU is
not counted (another process).

    .venv/bin/python benchmarks/fast-path/segment_faults.py --out benchmarks/fast-path/segment_faults.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
os.environ.update({"MC_TCP_BIND_ADDRESS": "127.0.0.1", "VLLM_HOST_IP": "127.0.0.1"})
from published import provenance, write_result  # noqa: E402 - the sibling module

LAYERS, HEADS, DIM, BLOCK, TOKENS = 12, 4, 64, 32, 100
OBJECT_BYTES, OBJECTS = 640 << 10, 4


def thread_cpu_ns() -> dict[str, int]:
    """CPU ns of each of this process's threads, by name (the connector's threads are named
    ``kvtool-...``; the store client's own threads are not Python's: ``client``)."""
    import threading

    names = {thread.native_id: thread.name.split("_")[0] for thread in threading.enumerate()}
    by_name: dict[str, int] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as handle:
                spent = int(handle.read().split()[0])
        except OSError:
            continue  # a thread that ended
        name = names.get(int(tid), "client")
        by_name[name] = by_name.get(name, 0) + spent
    return by_name


def timed(step, count: int) -> dict[str, float]:
    """Run ``step(i)`` ``count`` times after 5 warm-up calls: CPU (in all and by thread) and wall ms per
    call."""
    for i in range(5):
        step(-1 - i)
    cpu, wall = thread_cpu_ns(), time.perf_counter()
    for i in range(count):
        step(i)
    wall_ms = (time.perf_counter() - wall) / count * 1e3
    spent = {name: (ns - cpu.get(name, 0)) / count / 1e6 for name, ns in thread_cpu_ns().items()}
    by_thread = {name: round(ms, 3) for name, ms in sorted(spent.items(), key=lambda item: -item[1]) if ms >= 0.005}
    return {"cpu_ms": sum(spent.values()), "wall_ms": wall_ms, "cpu_ms_by_thread": by_thread}


def raw_puts(config, count: int) -> dict[str, float]:
    import torch

    from connector.store.mooncake import MooncakeStore

    store = MooncakeStore(config)
    client = store._client  # noqa: SLF001 - the raw calls on the connector's own client
    source = torch.ones(OBJECT_BYTES * OBJECTS, dtype=torch.uint8)
    client.register_buffer(source.data_ptr(), source.numel())
    prefault_s = None
    if store.prefault is not None:
        store.prefault.done.wait(120)
        prefault_s = round(store.prefault.seconds, 3)
    addresses = [source.data_ptr() + i * OBJECT_BYTES for i in range(OBJECTS)]

    def put(i: int) -> None:
        codes = client.batch_put_from([f"raw/{i}/{j}" for j in range(OBJECTS)], addresses, [OBJECT_BYTES] * OBJECTS)
        if any(codes):
            raise RuntimeError(f"raw put failed: {codes}")

    try:
        return {**timed(put, count), "prefault_s": prefault_s}
    finally:
        store.close()


def connector_saves(config, count: int) -> dict[str, float]:
    import torch

    from connector.data import KVToolMetadata, RequestSave
    from connector.core.keys import Namespace
    from connector.core.prefix import PromptKeys, plan_save
    from connector.core.saveplans import save_transfer
    from connector.store.stack import open_store_stack
    from connector.worker.worker import WorkerSide

    ns = Namespace(
        model="bench",
        dtype="float32",
        kv_layout="bench",
        block_size=BLOCK,
        num_layers=LAYERS,
        num_kv_heads=HEADS,
        head_size=DIM,
    )
    blocks = 41  # saves take their blocks in turn: what they hold does not matter here
    caches = {f"layer.{i}": torch.randn((blocks, 2, HEADS, BLOCK, DIM)) for i in range(LAYERS)}
    side = WorkerSide(ns, open_store_stack(config, "worker"), config, saves_enabled=True)
    side.register_kv_caches(caches, [list(caches)], blocks, layouts=("CPU_ATTN:vec",))
    store = side._store._store  # noqa: SLF001 - the backend under the time-outs, for its fault-in
    if getattr(store, "prefault", None) is not None:
        store.prefault.done.wait(120)
    rng, area = random.Random(0), side._saver.area  # noqa: SLF001 - a save has ended when its slots are back

    def save(i: int) -> None:
        keys = PromptKeys.build(
            [rng.randrange(10, 1000) for _ in range(TOKENS)], BLOCK, 1, ns.key_component(), bytes(16)
        )
        transfers = tuple(save_transfer(keys, ref, 1 + (4 * i + n) % 40) for n, ref in enumerate(plan_save(keys)))
        side.wait_for_save(KVToolMetadata(saves=[RequestSave(f"r{i}", transfers, prompt_tokens=TOKENS)]))
        side.before_step()
        while area.free_slots != area.slots:
            time.sleep(0.0002)

    try:
        return timed(save, count)
    finally:
        side.shutdown()


def child(args: argparse.Namespace) -> None:
    from connector.config import load_config

    config = load_config(
        {
            "master_server_address": args.master,
            "global_segment_size": args.segment_mib << 20,
            "prefault_segment": args.prefault == "on",
        }
    )
    measure = raw_puts if args.path == "raw" else connector_saves
    print(json.dumps(measure(config, args.puts)), flush=True)


def run_child(args: argparse.Namespace, master: str, path: str, prefault: str) -> dict[str, float]:
    argv = [
        sys.executable,
        __file__,
        "--child",
        path,
        "--prefault",
        prefault,
        "--master",
        master,
        "--puts",
        str(args.puts),
        "--segment-mib",
        str(args.segment_mib),
    ]
    done = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, timeout=600)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode or not lines:
        raise SystemExit(f"the {path} run (fault-in {prefault}) failed:\n{done.stderr[-2000:]}")
    return json.loads(lines[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--puts", type=int, default=200)
    parser.add_argument("--segment-mib", type=int, default=1024)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--child", choices=("raw", "connector"), dest="path")
    parser.add_argument("--prefault", choices=("off", "on"))
    parser.add_argument("--master")
    args = parser.parse_args()
    if args.path:
        return child(args)
    from kvtool.store.master import LocalMaster

    runs: dict[str, dict[str, list[dict[str, float]]]] = {path: {"off": [], "on": []} for path in ("raw", "connector")}
    master = LocalMaster().start()
    try:
        for _ in range(args.rounds):
            for path, by_setting in runs.items():
                for prefault in ("off", "on"):
                    by_setting[prefault].append(run_child(args, master.address, path, prefault))
    finally:
        master.stop()
    median = {
        path: {
            setting: {
                name: round(statistics.median(run[name] for run in measured), 3) for name in ("cpu_ms", "wall_ms")
            }
            for setting, measured in by_setting.items()
        }
        for path, by_setting in runs.items()
    }
    result = {
        "what": "CPU and wall ms per put (raw: 4 x 640 KiB) and per 100-token save (connector) into a fresh segment",
        "median_of_rounds": median,
        "cpu_on_vs_off": {path: round(m["on"]["cpu_ms"] / m["off"]["cpu_ms"], 3) for path, m in median.items()},
        "runs": runs,
        "configuration": {
            "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "segment_mib": args.segment_mib,
            "puts": args.puts,
            "rounds": args.rounds,
            "save": {
                "layers": LAYERS,
                "kv_heads": HEADS,
                "head_size": DIM,
                "block": BLOCK,
                "tokens": TOKENS,
                "dtype": "float32",
            },
            **provenance(),
        },
    }
    write_result(result, args.out)


if __name__ == "__main__":
    main()
