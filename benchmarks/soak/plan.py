"""What the soak draws at random: the fault plan of an iteration and its prompts."""

from __future__ import annotations

import random

# Fault kinds and their plans (connector/faults.py). Put faults spare watermark records ("w"), so a
# save always ends visibly; a full store for the tail alone is the partial-tail case.
FAULTS: dict[str, dict] = {
    "corrupt_flip": {"corrupt_get": "flip"},
    "corrupt_truncate": {"corrupt_get": "truncate"},
    "corrupt_namespace": {"corrupt_get": "namespace"},
    "load_finds_nothing": {"fail_get": True},
    "lookup_fails": {"fail_exists": True},
    "store_full_tail": {"put_outcome": "no_space", "put_kinds": ["t"]},
    "puts_fail": {"put_outcome": "failed", "put_kinds": ["b", "t"]},
    "save_in_flight": {"put_delay_s": 0.05},
    "slow_store": {"delay_s": 2.5},  # past the 2 s lookup time-out
}
FAULT_WEIGHTS = {"slow_store": 0.2}  # slow faults cost seconds each; draw them less often
TOKEN_LOW, TOKEN_HIGH = 10, 900
MAX_PROMPT_TOKENS = 1500  # chains of extensions stay well inside max_model_len (2048)


def tokens(rng: random.Random, low: int, high: int) -> list[int]:
    return [rng.randrange(TOKEN_LOW, TOKEN_HIGH) for _ in range(rng.randrange(low, high))]


def draw_fault(rng: random.Random, fault_rate: float) -> str | None:
    if rng.random() >= fault_rate:
        return None
    kinds = list(FAULTS)
    return rng.choices(kinds, weights=[FAULT_WEIGHTS.get(k, 1.0) for k in kinds])[0]


def draw_prompts(
    rng: random.Random, published: list[list[int]], both: bool, shared_prefix_rate: float
) -> tuple[list[int], list[int], list[int] | None]:
    """An iteration's producer prompt, consumer continuation and (on `both`, sometimes) shared-prefix prompt."""
    # Half the prompts extend one published before (hits across blocks and tails).
    if published and rng.random() < 0.5:
        base = list(rng.choice(published)) + tokens(rng, 0, 40)
        if len(base) > MAX_PROMPT_TOKENS:
            base = tokens(rng, 2, 140)
    else:
        base = tokens(rng, 2, 140)
    continuation = base + tokens(rng, 1, 20)
    shared = None
    if both and rng.random() < shared_prefix_rate:
        # The consumer publishes the continuation; the producer then asks for a prompt sharing
        # all of it (a tail hit) or a part of it that reaches past its own base (block hits).
        if rng.random() < 0.7:
            cut = len(continuation)
        else:
            cut = rng.randrange(len(base), len(continuation) + 1)
        shared = continuation[:cut] + tokens(rng, 1, 20)
    return base, continuation, shared
