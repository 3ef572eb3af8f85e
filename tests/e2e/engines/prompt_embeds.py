"""An offline engine (kv_both, the kvtool connector) fed mixed prompt-embedding prompts whose
placeholder ids are -1; prints one JSON line per answer. Run by tests/e2e/test_inputs.py:

    python -m tests.e2e.engines.prompt_embeds MODEL_DIR MASTER_HOST:PORT ADMIN_URL
"""

from __future__ import annotations

import json
import os
import sys
import uuid

PLACEHOLDER = -1  # what a client may put at embedded positions; vLLM zeroes it


def main(model_dir: str, master: str, admin: str) -> None:
    import torch
    from vllm import LLM, SamplingParams

    from kvtool.store.admin import open_admin, wait_for_key

    llm = LLM(
        model=model_dir,
        dtype="float32",
        block_size=32,
        max_model_len=512,
        gpu_memory_utilization=0.3,
        enable_prompt_embeds=True,
        enforce_eager=True,
        seed=0,
        kv_transfer_config={
            "kv_connector": "KVToolConnector",
            "kv_connector_module_path": "connector.connector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"master_server_address": master, "global_segment_size": 0},
        },
    )
    warm_up(llm, admin)
    hidden = llm.llm_engine.model_config.get_hidden_size()
    ids = list(range(400, 445))
    mask = [True] * len(ids)
    for position in range(5, 9):
        ids[position], mask[position] = PLACEHOLDER, False
    embeds = torch.zeros(len(ids), hidden)
    embeds[5:9] = torch.randn(4, hidden, generator=torch.Generator().manual_seed(0))
    mixed = {"prompt_embeds": embeds, "prompt_token_ids": ids, "prompt_is_token_ids": mask}
    # The same token ids as the engine sees them (placeholders zeroed), as a plain text prompt.
    zeroed = {"prompt_token_ids": [t if keep else 0 for t, keep in zip(ids, mask, strict=True)]}
    params = SamplingParams(max_tokens=3, logprobs=5, detokenize=False, temperature=0.0)
    runs = [
        ("first", mixed),
        ("again", mixed),  # the store (and vLLM's own cache) may serve it: must equal a recomputation
        ("reference", {**mixed, "cache_salt": uuid.uuid4().hex}),
        ("zeroed_text", zeroed),
    ]
    for name, prompt in runs:
        (output,) = llm.generate([prompt], params, use_tqdm=False)
        completion = output.outputs[0]
        logprobs = [{str(k): v.logprob for k, v in step.items()} for step in completion.logprobs or []]
        details = (output.kv_transfer_params or {}).get("kvtool") or {}
        print(
            "RESULT "
            + json.dumps(
                {
                    "run": name,
                    "token_ids": list(completion.token_ids),
                    "logprobs": logprobs,
                    "kvtool": details,
                }
            ),
            flush=True,
        )
        if name == "first" and details.get("watermark_key"):
            # The next run must find the save in the store: wait until every put of it was tried.
            wait_for_key(open_admin(admin), details["watermark_key"], 60.0)


def warm_up(llm, admin: str, timeout_s: float = 180.0) -> None:
    """Until this engine has loaded from the store once: a fresh client's first transfer from a peer's
    segment can stall and fail (README, known issues), which is a miss, not what this test is about."""
    import time

    from vllm import SamplingParams

    from kvtool.store.admin import open_admin, wait_for_key

    params = SamplingParams(max_tokens=1, detokenize=False)
    deadline, seed = time.monotonic() + timeout_s, 0
    while time.monotonic() < deadline:
        tokens = [600 + (seed * 7 + i) % 400 for i in range(40)]
        (first,) = llm.generate([{"prompt_token_ids": tokens}], params, use_tqdm=False)
        key = ((first.kv_transfer_params or {}).get("kvtool") or {}).get("watermark_key")
        if key:
            wait_for_key(open_admin(admin), key, 60.0)
        (again,) = llm.generate([{"prompt_token_ids": tokens}], params, use_tqdm=False)
        details = (again.kv_transfer_params or {}).get("kvtool") or {}
        if details.get("external_hit_tokens", 0) > 0 and details.get("load_failure") is None:
            return
        seed += 1
        time.sleep(1.0)
    raise SystemExit("the engine never loaded from the store during its warm-up")


if __name__ == "__main__":
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    main(sys.argv[1], sys.argv[2], sys.argv[3])
