"""Saves: waiting (bounded) for a save's final watermark record, and proving the save pipelines still end saves."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from connector.core.hits import HitDetails

from pair import RequestFailed
from plan import tokens

if TYPE_CHECKING:
    from pair_soak import PairSoak

SAVE_WAIT_S = 3.0  # a save normally ends in milliseconds; one the breaker skipped never writes its record
SLOW_SAVE_WAIT_S = 30.0  # under slow_store / save_in_flight
PIPELINE_CHECK_S = 60.0  # a clean save must end within this once faults are off (breaker back-off <= 10 s)


def wait_save(soak: PairSoak, engine: str, details: HitDetails | None, began: float) -> None:
    """Wait (bounded) for a save's final watermark record, so the next request can load it.

    A save the circuit breaker skipped writes no record at all, and one whose final put failed
    writes only its pending record (seq 0): neither is waited for. Not a hang either way (the
    request was answered); check_save_pipelines proves the put threads still end saves."""
    if details is None or not details.watermark_key:
        soak.saves[f"{engine}_nothing_to_save"] += 1
        return
    final = details.watermark_key
    pending = final.rsplit("/", 1)[0] + "/0"
    slow = soak.fault in ("slow_store", "save_in_flight")
    start_grace = 6.0 if slow else 0.5  # under slow_store the pending record's own put takes 2.5 s
    limit = SLOW_SAVE_WAIT_S if slow else SAVE_WAIT_S
    waited_from = time.monotonic()
    started = False
    while True:
        if soak.pair.key_exists(final):
            soak.saves[f"{engine}_ended"] += 1
            return
        # Reconnection and the breaker's back-off follow a master outage by several seconds.
        if soak.master_event_since(began - 15.0) and time.monotonic() - waited_from > 0.5:
            soak.saves[f"{engine}_not_seen_master_event"] += 1  # lost with the master, or never written
            return
        started = started or bool(soak.pair.key_exists(pending))
        elapsed = time.monotonic() - waited_from
        if not started and elapsed > start_grace:
            soak.saves[f"{engine}_not_started_{soak.fault or 'no_fault'}"] += 1  # skipped by the breaker
            return
        if elapsed > limit:
            soak.saves[f"{engine}_not_ended_{soak.fault or 'no_fault'}"] += 1
            return
        time.sleep(0.05)


def check_save_pipelines(soak: PairSoak, when: str) -> None:
    """With faults off, every saving engine must end a fresh save within PIPELINE_CHECK_S.

    A put thread stuck on a hung store would never end one again: that is a stall (a hang)."""
    soak.pair.set_faults(None)
    engines = ["producer", "consumer"] if soak.pair.roles == "both" else ["producer"]
    for engine in engines:
        deadline = time.monotonic() + PIPELINE_CHECK_S
        tries = 0
        while True:
            tries += 1
            prompt = tokens(soak.rng, 40, 120)
            try:
                answer = soak.send(engine, "pipeline_check", prompt, 1)
            except RequestFailed as failed:
                soak.record_failure(failed.record)
                break
            details = HitDetails.from_response(answer)
            key = details.watermark_key if details else None
            ended = False
            wait_until = min(deadline, time.monotonic() + 5)
            while key and time.monotonic() < wait_until:
                if soak.pair.key_exists(key):
                    ended = True
                    break
                time.sleep(0.1)
            if ended:
                break
            if time.monotonic() > deadline:
                soak.hangs.append(
                    {
                        "iteration": soak.iteration,
                        "at_s": soak.now_s(),
                        "engine": engine,
                        "what": f"{when}: no save ended within {PIPELINE_CHECK_S:.0f} s with faults off "
                        f"({tries} tries)",
                        "log_excerpt": soak.pair.log_excerpt(engine),
                    }
                )
                break
            time.sleep(1.0)
