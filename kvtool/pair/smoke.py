"""`serve-pair --smoke`: one scripted producer-then-consumer exchange, reported as a table."""

from __future__ import annotations

import json
import random
import time
from pathlib import Path
from typing import Any

import httpx

from kvtool import web
from kvtool import prometheus

from kvtool.client import complete
from kvtool.model import model_vocab_size
from kvtool.pair.ready import ReadyFile
from kvtool.report import ReportTable
from kvtool.store.admin import open_admin, wait_for_quiet_key_count

SEED = 7
FIRST_TOKEN_ID = 3  # below are <unk>, <s>, </s>


def smoke_prompts(vocab_size: int, seed: int = SEED) -> list[tuple[list[int], list[int]]]:
    """(producer prompt, consumer prompt) pairs: 20 then 20+30 tokens, 85 then 85+30 tokens."""
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(FIRST_TOKEN_ID, vocab_size) for _ in range(n)]

    short, long = tokens(20), tokens(85)
    return [(short, short + tokens(30)), (long, long + tokens(30))]


metric_total = prometheus.total  # the one Prometheus parser (kvtool/prometheus.py)


def _metrics(url: str) -> str:
    try:
        return web.get(url.rstrip("/") + "/metrics", timeout=5.0).text
    except httpx.HTTPError:
        return ""


def _wait_for_store_growth(admin_url: str | None, keys_before: float | None, timeout_s: float = 5.0) -> float | None:
    """The producer saves asynchronously: give its keys a moment to land before the consumer asks."""
    if admin_url is None:
        time.sleep(1.0)
        return None
    # A save is several puts: wait for the count to grow, then to stay put a moment.
    keys, _ = wait_for_quiet_key_count(open_admin(admin_url), timeout_s, quiet_s=0.3, above=keys_before)
    return keys if keys is not None else keys_before


def _flatten(params: Any, prefix: str = "") -> dict[str, str]:
    if not isinstance(params, dict):
        return {prefix or "value": json.dumps(params)}
    rows: dict[str, str] = {}
    for key, value in params.items():
        name = f"{prefix}.{key}" if prefix else str(key)
        rows.update(_flatten(value, name) if isinstance(value, dict) else {name: json.dumps(value)})
    return rows


def run_smoke(info: ReadyFile) -> list[dict[str, Any]]:
    """Run the exchanges; what each measured (``smoke_table`` shows them)."""
    model = info.model
    admin = info.admin
    cases: list[dict[str, Any]] = []
    for producer_prompt, consumer_prompt in smoke_prompts(model_vocab_size(Path(model))):
        keys_before = metric_total(_metrics(admin), "master_key_count") if admin else None
        complete(info.producer, model, producer_prompt, max_tokens=1)
        keys_after = _wait_for_store_growth(admin, keys_before)

        hits_before = metric_total(_metrics(info.consumer), "vllm:external_prefix_cache_hits_total") or 0.0
        response = complete(info.consumer, model, consumer_prompt, max_tokens=8, logprobs=5)
        hits_after = metric_total(_metrics(info.consumer), "vllm:external_prefix_cache_hits_total") or 0.0
        details = (response.get("usage") or {}).get("prompt_tokens_details") or {}
        cases.append(
            {
                "producer_prompt_tokens": len(producer_prompt),
                "consumer_prompt_tokens": len(consumer_prompt),
                "store_keys": None if keys_after is None else (keys_before, keys_after),
                "cached_tokens": details.get("cached_tokens"),
                "external_hit_tokens_metric": hits_after - hits_before,
                "kv_transfer_params": response.get("kv_transfer_params"),
            }
        )
    return cases


def smoke_table(info: ReadyFile, cases: list[dict[str, Any]]) -> ReportTable:
    """The exchanges side by side: a column per exchange, a row per figure, then the consumer's
    ``kv_transfer_params`` flattened (one row per field)."""
    exchanges = [f"exchange {number + 1}" for number in range(len(cases))]
    rows: list[dict[str, Any]] = []

    def row(label: str, values: list[Any]) -> None:
        rows.append({"": label, **dict(zip(exchanges, values, strict=True))})

    row("producer prompt (max_tokens=1)", [c["producer_prompt_tokens"] for c in cases])
    row("consumer prompt (max_tokens=8)", [c["consumer_prompt_tokens"] for c in cases])
    row(
        "store keys (master)",
        [None if c["store_keys"] is None else "{:g} -> {:g}".format(*c["store_keys"]) for c in cases],
    )
    row("consumer cached tokens (usage)", [c["cached_tokens"] for c in cases])
    row("consumer external hits (/metrics)", [f"{c['external_hit_tokens_metric']:g}" for c in cases])
    flattened = [_flatten(c["kv_transfer_params"]) if c["kv_transfer_params"] is not None else {} for c in cases]
    names = sorted({name for flat in flattened for name in flat})
    row("consumer's kv_transfer_params", ["" if names else "(absent)"] * len(cases))
    for name in names:
        row(f"  {name}", [flat.get(name, "-") for flat in flattened])
    title = f"smoke: connector={info.connector} store={info.store} block_size={info.block_size}"
    return ReportTable(title, ["", *exchanges], rows)
