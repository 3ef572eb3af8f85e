"""The lookup's own cost, without a master: keys asked and Python per batch of N new 1k-token requests.

The batches of ``lookup_latency.py`` (half extending a stored prompt past a point inside one of its
blocks, half unseen; block 32, hash unit 1, the default grid), looked up against an in-memory key set
that holds what those stored prompts' saves publish (objects and pointer records). No master, no
network, no thread hand-offs: what is left is the connector's Python (keys, search, pointer checks;
the keys counted are those of the existence queries),
which a change to it moves and the machine's noise moves much less than the real-master benchmark.
Run it on two trees to compare them (from a worktree, with ``PYTHONPATH`` naming it: otherwise the
installed checkout's ``connector`` is imported).

    .venv/bin/python benchmarks/fast-path/lookup_replay.py [--level 64] [--batches 20] [--out FILE]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

import connector
from connector.config import divergence_grid, lead_pointers, load_config
from connector.core.hashing import RequestIdentity
from connector.core.prefix import PromptKeys
from connector.core.search import find_stored_prefixes
from lookup_latency import NAMESPACE, PROMPT, new_batch, publish  # the sibling module: the same batches
from published import git_head, write_result


class KeySet:
    """The store's calls a lookup makes, over a dict (``publish`` puts into it too)."""

    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}
        self.asked = 0

    def exists(self, keys: list[str]) -> list[bool]:
        self.asked += len(keys)
        return [key in self.objects for key in keys]

    def get(self, keys: list[str], object_bytes: int = 0) -> list[bytes | None]:
        return [self.objects.get(key) for key in keys]

    def put_many(self, items: list[tuple[str, bytes]], replace: bool = False) -> None:
        self.objects.update(items)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--level", type=int, default=64, help="new requests a batch")
    parser.add_argument("--batches", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5, help="passes over the batches; the median pass counts")
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    bs = args.block_size
    config = load_config({"master_server_address": "127.0.0.1:1"})
    grid, lead, root = divergence_grid(config, bs), lead_pointers(config, bs), RequestIdentity().root_hash()

    def keys_for(tokens: list[int]) -> PromptKeys:
        return PromptKeys.build(tokens, bs, config.hash_unit, NAMESPACE, root, grid=grid, lead_pointers=lead)

    rng = random.Random(0)
    store = KeySet()
    stored = [[rng.randrange(32000) for _ in range(PROMPT)] for _ in range(64)]
    for tokens in stored:
        publish(store, keys_for(tokens))
    read = store.get  # pointer records, read in the calling thread
    batches = [new_batch(rng, args.level, stored, bs) for _ in range(args.batches)]
    passes = []
    for _ in range(args.repeats):
        store.asked = 0
        start = time.perf_counter()
        for batch in batches:
            find_stored_prefixes([keys_for(tokens) for tokens in batch], store.exists, read, config.extend_min_tokens)
        passes.append((time.perf_counter() - start) * 1e3 / len(batches))
    out = {
        "what": "Python ms and keys asked per lookup batch of new 1k-token requests, against an in-memory key set",
        "commit": git_head(),
        "connector_from": str(Path(connector.__file__).resolve().parent),  # the tree measured (PYTHONPATH)
        "level": args.level,
        "batches": args.batches,
        "block_size": bs,
        "hash_unit": config.hash_unit,
        "divergence_grid": grid,
        "python_ms_per_batch": round(statistics.median(passes), 2),
        "python_ms_per_batch_passes": [round(value, 2) for value in passes],
        "keys_asked_per_batch": round(store.asked / len(batches), 1),
    }
    write_result(out, args.out)


if __name__ == "__main__":
    main()
