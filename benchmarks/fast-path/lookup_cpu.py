"""CPU cost of one prompt's lookup (keys, existence queries answered from memory, longest prefix).

Side by side in one run: the lookup as it runs (``ServedIndex``, linear) and the per-length walk
it replaced (``PromptKeys.serves`` for every candidate end, quadratic), patched in as ``_longest``.

No store: ``exists`` is a set, so what is measured is the connector's own Python, the part that runs
under the GIL beside the engine. Three store states per prompt: everything stored (a repeat), nothing
stored (a miss), and a shorter prompt stored (half the blocks and a tail: the lookup asks twice).

    .venv/bin/python benchmarks/fast-path/lookup_cpu.py [--out FILE]
"""

from __future__ import annotations

import argparse
import platform
import random
import time
from pathlib import Path

from connector.config import divergence_grid, load_config
from connector.core.hashing import RequestIdentity
from connector.core import search as search_module
from connector.core.prefix import PromptKeys, plan_save
from connector.core.search import find_stored_prefixes
from published import git_head, write_result  # noqa: E402 - the sibling module

LENGTHS = (1024, 8192, 32768)
SETTINGS = ({"block_size": 256, "hash_unit": 1}, {"block_size": 32, "hash_unit": 1})
REPEATS = 3


def keys_for(tokens: list[int], block_size: int, hash_unit: int) -> PromptKeys:
    grid = divergence_grid(load_config({"master_server_address": "127.0.0.1:1"}), block_size)
    root = RequestIdentity().root_hash()
    return PromptKeys.build(tokens, block_size, hash_unit, "bench", root, grid=grid)


def stored_keys(tokens: list[int], block_size: int, hash_unit: int) -> set[str]:
    """What a producer's save of ``tokens`` puts (blocks and tail; pointers are not needed here)."""
    return {ref.key for ref in plan_save(keys_for(tokens, block_size, hash_unit))}


def walk_longest(keys: PromptKeys, ends, known) -> tuple[int, int]:
    """The longest-prefix search before the index: every candidate end walked on its own."""
    length = len(keys.tokens)
    served = [end for end in ends if end > 0 and keys.serves(end, known)]
    return max(served, default=0), max((end for end in served if end < length), default=0)


INDEXED = search_module._longest


def measure(tokens: list[int], store: set[str], block_size: int, hash_unit: int) -> dict[str, float]:
    """Best of REPEATS: process CPU ms to build the keys, and to find the stored prefix."""
    build, look = [], []
    for _ in range(REPEATS):
        t0 = time.process_time()
        keys = keys_for(tokens, block_size, hash_unit)
        t1 = time.process_time()
        found = find_stored_prefixes([keys], lambda asked: [key in store for key in asked])[0]
        t2 = time.process_time()
        build.append((t1 - t0) * 1e3)
        look.append((t2 - t1) * 1e3)
        assert found.tokens <= len(tokens)
    keys_ms, lookup_ms = min(build), min(look)
    return {"keys_ms": round(keys_ms, 2), "lookup_ms": round(lookup_ms, 2), "total_ms": round(keys_ms + lookup_ms, 2)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    rng = random.Random(0)
    results: dict = {}
    for setting in SETTINGS:
        bs, unit = setting["block_size"], setting["hash_unit"]
        name = f"block{bs}_unit{unit}"
        results[name] = {}
        for length in LENGTHS:
            tokens = [rng.randrange(32000) for _ in range(length)]
            shorter = tokens[: (length // 2 // bs) * bs + bs // 3]
            cases = {
                "repeat": stored_keys(tokens + [7], bs, unit),
                "miss": set(),
                "shorter_stored": stored_keys(shorter, bs, unit),
            }
            row = {}
            for search, longest in (("indexed", INDEXED), ("walk", walk_longest)):
                search_module._longest = longest
                row[search] = {case: measure(tokens, store, bs, unit) for case, store in cases.items()}
            search_module._longest = INDEXED
            results[name][str(length)] = row
            worst = {search: max(r["total_ms"] for r in cases_.values()) for search, cases_ in row.items()}
            print(
                f"{name} {length:>6} tokens: worst indexed {worst['indexed']:8.2f} ms, walk {worst['walk']:8.2f} ms",
                flush=True,
            )
    commit = git_head()
    out = {
        "what": "CPU ms of one lookup (keys + longest stored prefix), best of 3, exists answered from memory",
        "commit": commit,
        "python": platform.python_version(),
        "machine": platform.processor() or platform.machine(),
        "results": results,
        "lookup_cpu_ms_by_prompt_tokens": {
            str(n): max(r["total_ms"] for r in results["block256_unit1"][str(n)]["indexed"].values()) for n in LENGTHS
        },
        "lookup_cpu_ms_by_prompt_tokens_walk": {
            str(n): max(r["total_ms"] for r in results["block256_unit1"][str(n)]["walk"].values()) for n in LENGTHS
        },
    }
    write_result(out, args.out, echo=False)


if __name__ == "__main__":
    main()
