"""`kvtool bench --compare ... --interleave`: every connector's pair up at once, each workload step sent to
every pair in turn before the next step, the pair that goes first rotating step by step.

One pair after another (the default) measures each connector in its own stretch of minutes, and on a
shared machine those stretches differ by more than the connectors do (benchmarks/compare-peers/README.md:
the same pair's TTFT moves by a third within one run, and the pair that runs last is among the slowest).
Interleaved, a slow spell of the machine lands on every connector alike. It needs the memory of every
pair at once; the pairs after the first get free loopback ports of their own.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator

from kvtool.errors import UserError
from kvtool.pair.config import ServePairConfig
from kvtool.procs import find_free_port

# The ports a pair of its own needs: its engines', and those of what it starts beside them.
PAIR_PORT_FIELDS = ("producer_port", "consumer_port", "master_port", "admin_port", "store_port")


def rotation(names: list[str], index: int) -> list[str]:
    """The order in which a step goes to the pairs when ``index`` steps of its kind went before it:
    each pair goes first in turn."""
    if not names:
        return []
    shift = index % len(names)
    return names[shift:] + names[:shift]


def alternate(
    steppers: dict[str, Iterator[str]],
    targets: list[str],
    on_step: Callable[[str, str], None],
    on_failure: Callable[[str, UserError], None],
) -> None:
    """Advance every stepper one step at a time, all of them per round, until each is exhausted.
    ``targets[i]``: the engine step ``i`` goes to. The order rotates per target, not per step: a
    workload alternates producer and consumer steps, and with two pairs a rotation per step would
    send every consumer request of one pair first, right behind its own producer's request (whose
    save still runs), and every one of the other pair second. One that raises a UserError (its pair
    failed) is dropped after ``on_failure``; the others go on. ``on_step(name, target)`` follows each
    step."""
    live = dict(steppers)
    seen: Counter[str] = Counter()
    for target in targets:
        for name in rotation(list(live), seen[target]):
            try:
                sent = next(live[name])
            except StopIteration:
                del live[name]
                continue
            except UserError as exc:
                del live[name]
                on_failure(name, exc)
                continue
            on_step(name, sent)
        seen[target] += 1


def own_ports(cfg: ServePairConfig, taken: set[int], free_port: Callable[[], int] = find_free_port) -> ServePairConfig:
    """``cfg`` with free loopback ports of its own, none in ``taken`` (which gains them). A master
    named with --master is shared, so its ports stay."""
    fields = [f for f in PAIR_PORT_FIELDS if cfg.external_master is None or f not in ("master_port", "admin_port")]
    update: dict[str, int] = {}
    for name in fields:
        port = free_port()
        while port in taken:
            port = free_port()
        taken.add(port)
        update[name] = port
    return cfg.model_copy(update=update)


def base_ports(cfg: ServePairConfig) -> set[int]:
    return {getattr(cfg, name) for name in PAIR_PORT_FIELDS}
