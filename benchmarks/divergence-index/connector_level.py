"""What a divergence-point index costs through the connector's own code, against a real Mooncake master.

The connector-level part of ``measure.py`` (which holds the master and timing helpers): the put
thread's work for one save (``Saver``: each object put alone, then the save's pointers in one
``put_many``), the master's key count after the saves, and lookup latency (``find_stored_prefixes``
with the pointer reader) for a prompt that extends a stored one, one that diverges inside a stored
block, one sharing a short prefix with one, and an unseen one. It writes the ``connector`` key of the
results file and keeps the rest.

    python benchmarks/divergence-index/connector_level.py --out benchmarks/divergence-index/results.json
"""

from __future__ import annotations

from functools import partial

import argparse
import json
import os
import random
import resource
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from measure import (  # the sibling script: sets the loopback environment before Mooncake loads
    Master,
    client_config,
    configuration,
    markdown,
    pointers_per_block,
    running_master,
    summarize,
    timed_calls,
)

from connector.config import KVToolConfig, divergence_grid
from kvtool.portable import portable
from connector.data import RequestSave
from connector.core.hashing import RequestIdentity
from connector.core.keys import KeyKind, Namespace, decode_key, watermark_key
from connector.scheduler.lookups import POINTER_READ_SHARE, pointer_reader
from connector.core.objects import HEADER_SIZE, pointer_size
from connector.core.prefix import PromptKeys, plan_save
from connector.core.saveplans import save_transfer
from connector.worker.saver import ObjectCopy, Saver, SaveJob
from connector.store.staging import Lease, Region, StagingArea
from connector.core.search import StoredPrefix, find_stored_prefixes
from connector.store.store import KVStore, PutOutcome, open_store
from connector.worker.worker import WorkerSide

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

    def register(self, address: int, nbytes: int) -> None:
        self._store.register(address, nbytes)

    def get_into(self, keys: Sequence[str], regions: Sequence[Region], lease: Lease) -> list[int]:
        with self._timed("get", len(keys)):
            return self._store.get_into(keys, regions, lease)

    def put_from(self, items: Sequence[tuple[str, Region]], lease: Lease) -> list[PutOutcome]:
        with self._timed("objects", len(items)):
            return self._store.put_from(items, lease)

    def remove(self, key: str) -> int:
        return self._store.remove(key)

    def close(self) -> None:
        self._store.close()

    def clear(self) -> None:
        self.ns.clear()
        self.keys.clear()


def save_job(setting: Setting, worker: WorkerSide, tokens: Sequence[int], number: int, area: StagingArea) -> SaveJob:
    """A save as the worker hands it to the put thread: its objects copied into staging slots (a block
    object's size, as the engine's step leaves them), each with its pointer records built by the worker."""
    keys = setting.keys(tokens)
    transfers = tuple(save_transfer(keys, ref, block_id) for block_id, ref in enumerate(plan_save(keys)))
    save = RequestSave(f"bench-{number}", transfers, prompt_tokens=len(tokens))
    lease = area.take(len(transfers))
    assert lease is not None, "the staging area holds one save"
    copies = [
        ObjectCopy(index, worker._key(transfer), lease.region(index), partial(worker._pointers, transfer))  # noqa: SLF001
        for index, transfer in enumerate(transfers)
    ]
    ns_key = setting.namespace.key_component()
    return SaveJob(save, copies, lambda seq: watermark_key(ns_key, save.watermark_id, seq), lease)


def timed_saves(setting: Setting, log: CallLog, prompts: Sequence[list[int]]) -> list[Counter[str]]:
    """The put thread's work (``Saver._run``) for each prompt's save: its time in all and per call kind."""
    worker = WorkerSide(setting.namespace, None, DEFAULTS, saves_enabled=False)
    most = max(len(plan_save(setting.keys(tokens))) for tokens in prompts)
    area = StagingArea("bench", setting.object_bytes, most)
    log.register(area.address, area.nbytes)
    saver = Saver(log, area=area, drain_timeout_s=1.0)
    spent = []
    for number, tokens in enumerate(prompts):
        job = save_job(setting, worker, tokens, number, area)
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
        "store": "connector.store.store.open_store (TimedStore over MooncakeStore; no circuit breaker)",
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


def connector_run(log_dir: Path, command: list[str]) -> dict[str, Any]:
    stamp = configuration(command)
    return {
        "configuration": {name: stamp[name] for name in ("command", "date_utc", "mooncake_package", "machine")}
        | connector_configuration(),
        **connector_level(log_dir),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="results JSON file (its other keys are kept)")
    parser.add_argument("--log-dir", type=Path, default=Path(tempfile.gettempdir()) / "kvtool-divergence-index")
    args = parser.parse_args()
    args.log_dir.mkdir(parents=True, exist_ok=True)
    command = [Path(sys.executable).name, *sys.argv]
    results = json.loads(args.out.read_text()) if args.out.exists() else {}
    results["connector"] = connector_run(args.log_dir, command)
    print(connector_tables(results["connector"]["settings"]))
    print(f"CPU during the connector run: {results['connector']['cpu']}")
    args.out.write_text(json.dumps(portable(results), indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
