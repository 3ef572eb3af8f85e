"""A fleet's warm-up: every engine's first transfers with the store's segments happen before the
router sends it a user's request.

A Mooncake client's first transfer with a peer's segment can stall for 30-60 s (the README's known
issues: the peer's handshake daemon serves one connection at a time). In a pair the tests warm the
path up; in a fleet every engine is a peer of every other, and a stalled load showed as a 10 s TTFT
(the load's time-out) in the fleet benchmark. So serve-pair warms a kvtool fleet up before it starts
the router: each engine in turn saves a fresh prompt (its puts land in the engines' segments), and
each other engine loads it, until every engine has loaded what every other saved (the hit details
say whether a load went through), or ``WARMUP_TIMEOUT_S`` passes: then the fleet serves anyway, and
a load that still stalls fails closed (a miss). The requests go to the engines directly, never
through the router.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence

from connector.core.hits import HitDetails
from kvtool.client import complete
from kvtool.errors import ServerError
from kvtool.pair.config import ServePairConfig
from kvtool.pair.ready import admin_url_for
from kvtool.model import model_vocab_size
from kvtool.pair.smoke import FIRST_TOKEN_ID
from kvtool.store.admin import open_admin, wait_for_key

WARMUP_TIMEOUT_S = 180.0
BLOCKS = 4  # a warm-up prompt's whole blocks (it also ends mid-block: a tail object too)

Ask = Callable[[str, list[int]], HitDetails | None]


def _ask(cfg: ServePairConfig) -> Ask:
    def ask(url: str, tokens: list[int]) -> HitDetails | None:
        try:
            return HitDetails.from_response(complete(url, str(cfg.model), tokens, max_tokens=1, timeout_s=60.0))
        except ServerError:
            return None  # a request the engine failed: that pair is not warm yet

    return ask


def warm_fleet(cfg: ServePairConfig, say: Callable[[str], None], ask: Ask | None = None) -> set[tuple[str, str]]:
    """Warm every (saver, loader) pair of engines up; the pairs still cold at the deadline (said)."""
    names = cfg.engine_names
    pairs = {(saver, loader) for saver in names for loader in names if saver != loader}
    return _warm(cfg, pairs, "warming the fleet up: each engine loads what each other saved", say, ask)


def warm_engine(
    cfg: ServePairConfig, engine: str, serving: Sequence[str], say: Callable[[str], None], ask: Ask | None = None
) -> set[tuple[str, str]]:
    """Warm an engine that joins a serving fleet up with the engines ``serving``: it loads what each
    of them saves and each loads what it saves (its new Mooncake client has transferred with no one
    yet); the pairs still cold at the deadline (said)."""
    pairs = {pair for other in serving if other != engine for pair in ((engine, other), (other, engine))}
    return _warm(cfg, pairs, f"warming {engine} up with the {len(serving)} engine(s) serving", say, ask)


def _warm(
    cfg: ServePairConfig, pairs: set[tuple[str, str]], what: str, say: Callable[[str], None], ask: Ask | None
) -> set[tuple[str, str]]:
    """Each of ``pairs`` (saver, loader) warmed up: the saver saves a fresh prompt and the loader loads
    it, in rounds, until every pair's load went through or ``WARMUP_TIMEOUT_S`` passes."""
    if not (pairs and cfg.is_fleet and cfg.connector == "kvtool" and cfg.master_address):
        return set()
    ask = ask or _ask(cfg)
    admin_url = admin_url_for(cfg)
    admin = open_admin(admin_url) if admin_url is not None else None
    cold = set(pairs)
    rng = random.Random()  # fresh prompts each time: a store that outlived a fleet holds the last ones
    vocab = model_vocab_size(cfg.model)
    say(f"{what} ({len(cold)} pairs)")
    began = time.monotonic()
    while cold and time.monotonic() - began < WARMUP_TIMEOUT_S:
        for saver in sorted({saver for saver, _ in cold}):
            length = BLOCKS * cfg.effective_block_size + cfg.effective_block_size // 2 + 1
            prompt = [rng.randrange(FIRST_TOKEN_ID, vocab) for _ in range(length)]
            saved = ask(cfg.base_url(saver), prompt)
            if saved is None or not saved.watermark_key:
                continue
            if admin is not None and not wait_for_key(admin, saved.watermark_key, 30.0):
                continue  # its save has not ended: ask again in the next round
            for loader in sorted(loader for s, loader in cold if s == saver):
                loaded = ask(cfg.base_url(loader), [*prompt, rng.randrange(FIRST_TOKEN_ID, vocab)])
                if loaded is not None and loaded.external_hit_tokens > 0 and loaded.load_failure is None:
                    cold.discard((saver, loader))
    took = time.monotonic() - began
    if cold:
        pairs_left = ", ".join(f"{loader} from {saver}" for saver, loader in sorted(cold))
        say(
            f"first transfers did not all go through in {took:.0f} s ({pairs_left}); serving anyway: "
            "such a load fails closed (a miss) until its path recovers"
        )
    else:
        say(f"warm: every load went through ({took:.1f} s)")
    return cold
