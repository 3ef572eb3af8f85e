"""What a save costs the engine's step: the block copy kvtool makes there now, against the copy,
join, encode and checksum it made there before, side by side in one run on the same cache tensors.

A real-size layout (Llama-3-8B-like: 32 layers, 8 KV heads of 128, bfloat16, block 32, a [2, block,
heads * dim] tensor per layer and block) and a save of ``--tokens`` tokens. The engine-thread time of
the new path is ``WorkerSide._copy_block`` into save-area slots (one ``memmove`` per layer row since
format 3); the sealing it moved to the put thread (XXH3-64 and the header) is timed apart.

    .venv/bin/python benchmarks/fast-path/save_copy.py [--tokens 4096] [--out FILE]
"""

from __future__ import annotations

import argparse
import time
import zlib
from pathlib import Path
import torch

from connector.config import KVToolConfig
from connector.data import BlockTransfer
from connector.core.keys import KeyKind, Namespace
from connector.core.objects import HEADER_SIZE, ObjectHeader, encode_header, seal_object
from connector.store.staging import StagingArea
from connector.worker.worker import WorkerSide
from published import git_head, write_result  # noqa: E402 - the sibling module

LAYERS, HEADS, DIM, BLOCK = 32, 8, 128, 32


def header(payload_len: int, crc: int = 0) -> ObjectHeader:
    return ObjectHeader(
        namespace_fingerprint=b"\0" * 16,
        chain_hash=b"\1" * 16,
        kind=KeyKind.BLOCK,
        dtype="bfloat16",
        num_layers=LAYERS,
        token_start=0,
        token_end=BLOCK,
        payload_len=payload_len,
        payload_crc=crc,
    )


def before(layers: list[torch.Tensor], block: int) -> bytes:
    """The engine-step path before this change: per-layer tobytes, a join, then encode (CRC, concat)."""
    payload = b"".join(t[block].contiguous().view(torch.uint8).reshape(-1).numpy().tobytes() for t in layers)
    return encode_header(header(len(payload), zlib.crc32(payload))) + bytes(payload)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    blocks = args.tokens // BLOCK
    layers = [torch.randn(blocks, 2, BLOCK, HEADS * DIM).to(torch.bfloat16) for _ in range(LAYERS)]
    group_bytes = sum(t[0].numel() * t.element_size() for t in layers)
    # The worker's copy, called as the step calls it, into slots of a save area.
    namespace = Namespace(
        model="bench",
        dtype="bfloat16",
        kv_layout="bench",
        block_size=BLOCK,
        num_layers=LAYERS,
        num_kv_heads=HEADS,
        head_size=DIM,
    )
    side = WorkerSide(namespace, None, KVToolConfig(master_server_address="127.0.0.1:1"), saves_enabled=False)
    names = [f"layer{i}" for i in range(LAYERS)]
    side.register_kv_caches(dict(zip(names, layers, strict=True)), [names], blocks)
    area = StagingArea("save", HEADER_SIZE + group_bytes, blocks)
    area.memory.fill_(0)  # touched first, as the worker does at start-up
    lease = area.take(blocks)
    assert lease is not None
    transfers = [BlockTransfer(b, KeyKind.BLOCK, b * BLOCK, (b + 1) * BLOCK, b"\1" * 16) for b in range(blocks)]
    results = {}
    for name in ("before", "after", "before", "after"):  # twice each, interleaved; the best kept
        t0 = time.perf_counter()
        if name == "before":
            made = [before(layers, t.block_id) for t in transfers]
        else:
            made = [lease.region(i, HEADER_SIZE + group_bytes) for i in range(blocks)]
            for t, region in zip(transfers, made, strict=True):
                side._copy_block(t, region)  # noqa: SLF001 - the step's own copy
        elapsed = time.perf_counter() - t0
        seal = 0.0
        if name == "after":
            t1 = time.perf_counter()
            for region in made:
                seal_object(header(group_bytes), region.view)
            seal = time.perf_counter() - t1
        best = results.get(name)
        if best is None or elapsed < best["engine_step_s"]:
            results[name] = {"engine_step_s": round(elapsed, 4), "put_thread_seal_s": round(seal, 4)}
        del made
    total = blocks * (HEADER_SIZE + group_bytes)
    for row in results.values():
        row["engine_step_gb_per_s"] = round(total / row["engine_step_s"] / 1e9, 2)
    commit = git_head()
    out = {
        "what": "engine-step time of one save's block copies, before (tobytes+join+encode+CRC) vs after (one "
        "memmove per layer row into the save area)",
        "commit": commit,
        "layout": {"layers": LAYERS, "kv_heads": HEADS, "head_dim": DIM, "dtype": "bfloat16", "block_size": BLOCK},
        "tokens": args.tokens,
        "bytes": total,
        "results": results,
        "engine_step_speedup": round(results["before"]["engine_step_s"] / results["after"]["engine_step_s"], 2),
    }
    write_result(out, args.out)


if __name__ == "__main__":
    main()
