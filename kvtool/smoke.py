"""`serve-pair --smoke`: one scripted producer-then-consumer exchange, reported as a table."""

from __future__ import annotations

import json
import random
import time
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.table import Table

from kvtool.client import complete
from kvtool.errors import UserError

SEED = 7
FIRST_TOKEN_ID = 3  # below are <unk>, <s>, </s>


def smoke_prompts(vocab_size: int, seed: int = SEED) -> list[tuple[list[int], list[int]]]:
    """(producer prompt, consumer prompt) pairs: 20 then 20+30 tokens, 85 then 85+30 tokens."""
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(FIRST_TOKEN_ID, vocab_size) for _ in range(n)]

    short, long = tokens(20), tokens(85)
    return [(short, short + tokens(30)), (long, long + tokens(30))]


def model_vocab_size(model: Path) -> int:
    try:
        return int(json.loads((model / "config.json").read_text())["vocab_size"])
    except (OSError, ValueError, KeyError) as exc:
        raise UserError(f"cannot read vocab_size from {model / 'config.json'}: {exc}") from None


def metric_total(metrics_text: str, name: str) -> float | None:
    """Sum of a Prometheus metric over all its label sets; None when absent."""
    total = None
    for line in metrics_text.splitlines():
        if line.startswith(name) and line[len(name) : len(name) + 1] in (" ", "{"):
            total = (total or 0.0) + float(line.rsplit(" ", 1)[1])
    return total


def _metrics(url: str) -> str:
    try:
        return httpx.get(url.rstrip("/") + "/metrics", timeout=5.0).text
    except httpx.HTTPError:
        return ""


def _wait_for_store_growth(
    admin_url: str | None, keys_before: float | None, timeout_s: float = 5.0
) -> float | None:
    """The producer saves asynchronously: give its keys a moment to land before the consumer asks."""
    if admin_url is None:
        time.sleep(1.0)
        return None
    deadline = time.monotonic() + timeout_s
    keys = keys_before
    while time.monotonic() < deadline:
        keys = metric_total(_metrics(admin_url), "master_key_count")
        if keys is not None and keys_before is not None and keys > keys_before:
            time.sleep(0.3)  # a save is usually several puts; let the rest arrive
            return metric_total(_metrics(admin_url), "master_key_count")
        time.sleep(0.2)
    return keys


def run_smoke(info: dict[str, Any], console: Console) -> None:
    model = info["model"]
    admin = info.get("admin")
    table = Table(title=f"smoke check: connector={info['connector']} block_size={info['block_size']}")
    for column in (
        "producer prompt",
        "consumer prompt",
        "store keys",
        "cached tokens",
        "external hits",
        "kv_transfer_params",
    ):
        table.add_column(column)
    for producer_prompt, consumer_prompt in smoke_prompts(model_vocab_size(Path(model))):
        keys_before = metric_total(_metrics(admin), "master_key_count") if admin else None
        complete(info["producer"], model, producer_prompt, max_tokens=1)
        keys_after = _wait_for_store_growth(admin, keys_before)

        hits_before = metric_total(_metrics(info["consumer"]), "vllm:external_prefix_cache_hits_total") or 0.0
        response = complete(info["consumer"], model, consumer_prompt, max_tokens=8, logprobs=5)
        hits_after = metric_total(_metrics(info["consumer"]), "vllm:external_prefix_cache_hits_total") or 0.0

        details = (response.get("usage") or {}).get("prompt_tokens_details") or {}
        params = response.get("kv_transfer_params")
        table.add_row(
            f"{len(producer_prompt)} tokens",
            f"{len(consumer_prompt)} tokens",
            "-" if keys_after is None else f"{keys_before:g} -> {keys_after:g}",
            str(details.get("cached_tokens", "-")),
            f"{hits_after - hits_before:g}",
            json.dumps(params, sort_keys=True) if params is not None else "(absent)",
        )
    console.print(table)
