"""Lookup latency against a real master: one step's batch of N new 1k-token requests.

Starts its own loopback ``mooncake_master``, stores prompts through the connector's store stack,
then times ``find_stored_prefixes`` (what the lookup thread runs for one step's batch: keys, the
existence queries, pointer reads) for batches of 1, 16 and 64 new requests. Half of each batch
extends a stored prompt past a point inside one of its blocks (a divergence point: pointers are
read), half is unseen. Wall ms per batch, p50 and p99 over ``--batches`` batches. Beside it, the
floor the master sets: the same existence queries (the same keys, in the same calls) sent straight
through the Mooncake client's ``batch_is_exist`` right after each batch.

    .venv/bin/python benchmarks/fast-path/lookup_latency.py [--block-size 32] [--divergence-grid N] [--python-too]
        [--out FILE]

``--python-too``: every batch runs twice, with the C key builder and with the pure-Python reference,
in turns; both are reported (``python_key_builder``).
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

os.environ.update({"MC_TCP_BIND_ADDRESS": "127.0.0.1", "VLLM_HOST_IP": "127.0.0.1"})

from connector.core import native  # noqa: E402
from connector.config import divergence_grid, lead_pointers, load_config  # noqa: E402
from connector.core.hashing import RequestIdentity  # noqa: E402
from connector.scheduler.lookups import POINTER_READ_SHARE, pointer_reader  # noqa: E402
from connector.core.objects import HEADER_SIZE, PointerRecord, encode_pointer  # noqa: E402
from connector.core.prefix import PromptKeys, plan_save  # noqa: E402
from connector.core.search import find_stored_prefixes  # noqa: E402
from connector.store.store import open_store  # noqa: E402
from kvtool.store.master import LocalMaster  # noqa: E402
from published import git_head, write_result  # noqa: E402 - the sibling module

LEVELS = (1, 16, 64)
PROMPT = 1024
FINGERPRINT = bytes(range(16))  # a namespace: its key component is a prefix of the fingerprint's hex
NAMESPACE = FINGERPRINT.hex()[:16]


def publish(store, keys: PromptKeys) -> None:
    """A prompt's objects, then its pointers' records, as a save puts them."""
    saved = plan_save(keys)
    store.put_many([(ref.key, b"\0" * (HEADER_SIZE + 64)) for ref in saved])
    pointers = [
        (
            p.key,
            encode_pointer(
                PointerRecord(
                    FINGERPRINT,
                    p.chain_hash,
                    p.group,
                    p.token_end,
                    ref.kind,
                    ref.token_end,
                    ref.chain_hash,
                    keys.tokens[p.token_end : ref.token_end],
                )
            ),
        )
        for ref in saved
        for p in keys.pointers_inside(ref)
    ]
    if pointers:
        store.put_many(pointers, replace=True)


class StoreClock:
    """Wraps the store calls a lookup makes and adds up the time spent waiting for their answers; keeps
    the keys of each existence query (``raw_floor``)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.queries: list[list[str]] = []

    def timed(self, call, record: bool = False):
        def wrapped(keys):
            if record:
                self.queries.append(list(keys))
            start = time.perf_counter()
            try:
                return call(keys)
            finally:
                self.seconds += time.perf_counter() - start

        return wrapped


def raw_client(store):
    """The Mooncake client under the store stack (time-outs, faults): what the floor asks directly."""
    while not hasattr(store, "_client"):
        store = store._store  # noqa: SLF001 - a benchmark's look under the wrappers
    return store._client  # noqa: SLF001


def raw_floor(client, queries: list[list[str]]) -> float:
    """ms the master takes to answer the same existence queries asked straight, one call each."""
    start = time.perf_counter()
    for keys in queries:
        client.batch_is_exist(keys)
    return (time.perf_counter() - start) * 1e3


def new_batch(rng: random.Random, level: int, stored_prompts: list[list[int]], bs: int) -> list[list[int]]:
    """``level`` new prompts: every other one extends a stored prompt past a point inside one of its
    blocks, the others are unseen."""
    batch = []
    for i in range(level):
        if i % 2 == 0:
            base = stored_prompts[rng.randrange(len(stored_prompts))]
            cut = rng.randrange(bs, PROMPT - bs)
            batch.append(base[:cut] + [rng.randrange(32000) for _ in range(PROMPT - cut)])
        else:
            batch.append([rng.randrange(32000) for _ in range(PROMPT)])
    return batch


def summary(times: list[float], store_times: list[float], floors: list[float], keys: list[int]) -> dict[str, float]:
    python = [total - waited for total, waited in zip(times, store_times, strict=True)]
    ordered = sorted(times)
    return {
        "p50_ms": round(statistics.median(ordered), 2),
        "p99_ms": round(ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))], 2),
        # Of each batch: the time waiting for the master's answers (existence queries, pointer reads),
        # the rest being the connector's Python (keys, search); p50 over the batches.
        "store_p50_ms": round(statistics.median(store_times), 2),
        "python_p50_ms": round(statistics.median(python), 2),
        # The same existence queries sent straight to the master: no lookup over this store can be faster.
        "raw_exists_p50_ms": round(statistics.median(floors), 2),
        "raw_exists_p99_ms": round(sorted(floors)[min(len(floors) - 1, int(0.99 * len(floors)))], 2),
        "keys_asked_p50": statistics.median(keys),
    }


@dataclass
class Lookup:
    """What one timed lookup batch runs: its prompts' keys, the store's calls (timed), the master's floor."""

    keys_for: Callable[[list[int]], PromptKeys]
    exists: Callable
    read: Callable
    extend_min_tokens: int
    clock: StoreClock
    client: object

    def timed(self, batch: list[list[int]], samples: tuple[list[float], ...]) -> None:
        times, store_times, floors, keys = samples
        self.clock.seconds, self.clock.queries = 0.0, []
        t0 = time.perf_counter()
        find_stored_prefixes(
            [self.keys_for(tokens) for tokens in batch], self.exists, self.read, self.extend_min_tokens
        )
        times.append((time.perf_counter() - t0) * 1e3)
        store_times.append(self.clock.seconds * 1e3)
        floors.append(raw_floor(self.client, self.clock.queries))
        keys.append(sum(len(query) for query in self.clock.queries))


def run_levels(
    lookup: Lookup, builders: dict, batches: int, new: Callable[[int], list[list[int]]]
) -> dict[str, dict[str, dict[str, float]]]:
    """Each level's summary, per key builder (``builders``: name -> module or None; empty: the default)."""
    results: dict[str, dict[str, dict[str, float]]] = {name: {} for name in builders or {"default": None}}
    for level in LEVELS:
        samples: dict[str, tuple[list[float], ...]] = {name: ([], [], [], []) for name in results}
        for index in range(batches):
            batch = new(level)
            # Each builder runs the same batch, in turns (first one, then the other first), so the
            # machine's drift and the master's warm caches favour neither.
            for name in list(results)[:: 1 if index % 2 == 0 else -1]:
                if builders:
                    native.KEYS = builders[name]
                lookup.timed(batch, samples[name])
        for name in results:
            results[name][str(level)] = summary(*samples[name])
            print(name, level, results[name][str(level)], flush=True)
    native.KEYS = builders.get("c", native.KEYS)
    return results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--batches", type=int, default=40)
    parser.add_argument("--divergence-grid", type=int, default=None, help="pointer grid in tokens (default: auto)")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument(
        "--python-too", action="store_true", help="run each batch with the pure-Python key builder too, in turns"
    )
    args = parser.parse_args()
    bs = args.block_size
    master = LocalMaster().start()
    address = master.address
    try:
        grid_setting = {} if args.divergence_grid is None else {"divergence_grid": args.divergence_grid}
        config = load_config({"master_server_address": address, "global_segment_size": 256 << 20, **grid_setting})
        store = open_store(config)
        grid = divergence_grid(config, bs)
        root = RequestIdentity().root_hash()
        rng = random.Random(0)

        lead = lead_pointers(config, bs)

        def keys_for(tokens: list[int]) -> PromptKeys:
            return PromptKeys.build(tokens, bs, config.hash_unit, NAMESPACE, root, grid=grid, lead_pointers=lead)

        # Stored prompts, with their pointers (a tiny payload stands in for KV: only keys are asked).
        stored_prompts = [[rng.randrange(32000) for _ in range(PROMPT)] for _ in range(max(LEVELS))]
        for tokens in stored_prompts:
            publish(store, keys_for(tokens))
        # As vLLM's engine core does once it is up (``freeze_gc_heap``): what exists now is never
        # scanned again by the collector's passes, which the lookups' allocations would set off.
        gc.collect()
        gc.freeze()
        clock = StoreClock()
        exists = clock.timed(store.exists, record=True)
        client = raw_client(store)
        read = clock.timed(pointer_reader(store, config.lookup_timeout_s * POINTER_READ_SHARE, bs))
        builders = {"c": native.KEYS, "python": None} if args.python_too and native.KEYS is not None else {}
        lookup = Lookup(keys_for, exists, read, config.extend_min_tokens, clock, client)
        results = run_levels(lookup, builders, args.batches, lambda level: new_batch(rng, level, stored_prompts, bs))
        store.close()
    finally:
        master.stop()
    commit = git_head()
    out = {
        "what": "wall ms of one step's lookup batch of N new 1k-token requests against a real master",
        "commit": commit,
        "block_size": bs,
        "hash_unit": config.hash_unit,
        "divergence_grid": grid,
        "batches": args.batches,
        "key_builder": native.describe(),
        "lookup_ms_by_batch": results[next(iter(results))],
        "lookup_p99_ms": {level: row["p99_ms"] for level, row in results[next(iter(results))].items()},
    }
    if "python" in results:  # the same batches with the pure-Python reference builder, in turns with the C one
        out["python_key_builder"] = {
            "lookup_ms_by_batch": results["python"],
            "lookup_p99_ms": {level: row["p99_ms"] for level, row in results["python"].items()},
        }
    write_result(out, args.out, echo=False)


if __name__ == "__main__":
    main()
