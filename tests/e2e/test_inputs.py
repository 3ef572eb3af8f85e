"""Inputs the key schema cannot encode as given, through a real engine: a mixed prompt-embeddings
prompt whose placeholder ids are -1 (vLLM accepts it and zeroes the placeholders) is served, keyed
by what the engine computes (zeroed ids plus a digest of the embeddings), and never shares KV with a
text prompt of the same ids. Before, the connector packed -1 as uint32 on the scheduler thread and
the engine core died."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from .pairtools import RunningPair, TOLERANCE

pytestmark = pytest.mark.e2e

REPO_ROOT = Path(__file__).resolve().parents[2]


def run_engine(pair: RunningPair, tmp_path: Path) -> dict[str, dict]:
    env = {
        **os.environ,
        "VLLM_HOST_IP": "127.0.0.1",
        "MC_TCP_BIND_ADDRESS": "127.0.0.1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "PYTHONPATH": str(REPO_ROOT),
    }
    log = tmp_path / "engine.log"
    with open(log, "wb") as out:
        done = subprocess.run(
            [sys.executable, "-m", "tests.e2e.engines.prompt_embeds", pair.model, pair.master, pair.admin],
            stdout=subprocess.PIPE,
            stderr=out,
            cwd=REPO_ROOT,
            env=env,
            timeout=600,
        )
    results = {}
    for line in done.stdout.decode().splitlines():
        if line.startswith("RESULT "):
            record = json.loads(line.removeprefix("RESULT "))
            results[record["run"]] = record
    assert done.returncode == 0 and len(results) == 4, (
        f"the engine exited with {done.returncode} after {sorted(results)}:\n{log.read_text()[-4000:]}"
    )
    return results


def assert_same_answer(answer: dict, reference: dict) -> None:
    assert answer["token_ids"] == reference["token_ids"]
    for got, want in zip(answer["logprobs"], reference["logprobs"], strict=True):
        for token, logprob in want.items():
            if token in got:
                assert abs(got[token] - logprob) <= TOLERANCE


def test_a_minus_one_placeholder_is_keyed_as_the_engine_computes_it(pair, tmp_path):
    results = run_engine(pair, tmp_path)
    first, again, reference = results["first"]["kvtool"], results["again"]["kvtool"], results["reference"]["kvtool"]
    assert first["lookup"] in ("hit", "miss") and first["save_objects"] > 0, first
    assert reference["local_hit_tokens"] + reference["external_hit_tokens"] == 0, "the reference reused KV"
    # vLLM's own cache holds the first block; the store the rest, to the token (the prompt is 45 long).
    assert again["external_hit_tokens"] > 0 and again["load_failure"] is None, again
    assert again["local_hit_tokens"] + again["external_hit_tokens"] == 44, again
    assert_same_answer(results["again"], results["reference"])
    text = results["zeroed_text"]["kvtool"]
    assert text["stored_prefix_tokens"] == 0 and text["external_hit_tokens"] == 0, (
        "a text prompt shared KV with an embeddings prompt of the same ids"
    )
