"""What the connector's cost model would do with a prompt's hit (``kvtool inspect prompt --cost``)."""

from __future__ import annotations

from connector.core.keys import KeyKind
from connector.core.refs import LoadPlan, ObjectRef
from connector.core.profit import CostModel, judge
from kvtool.errors import UserError


def parse_cost(text: str) -> CostModel:
    """``LOAD_MS,MB_PER_S,PREFILL_US``: an engine's figures, as its "kvtool: cost model" log line gives them."""
    try:
        load_ms, mb_per_s, prefill_us = (float(part) for part in text.split(","))
    except ValueError:
        raise UserError(
            f"--cost {text!r} is not LOAD_MS,MB_PER_S,PREFILL_US (e.g. 3.2,950,45: the engine's "
            '"kvtool: cost model" log line gives them)'
        ) from None
    if load_ms < 0 or mb_per_s <= 0 or prefill_us < 0:
        raise UserError(f"--cost {text!r}: the load time and prefill cost cannot be negative, the rate must be above 0")
    return CostModel.given(load_ms, mb_per_s, prefill_us)


def cost_verdict(hit_tokens: int, block_size: int, object_bytes: int, model: CostModel) -> tuple[int, str]:
    """The tokens the connector would load of a hit (no local cache hit assumed), and why."""
    if hit_tokens <= 0:
        return 0, "no hit to judge"

    def plan(tokens: int) -> LoadPlan:
        blocks = -(-tokens // block_size)
        refs = tuple(
            ObjectRef(str(i), 0, KeyKind.BLOCK, i, i * block_size, (i + 1) * block_size, b"") for i in range(blocks)
        )
        return LoadPlan(0, tokens, 0, 0, refs)

    cut = hit_tokens // block_size * block_size
    verdict = judge(plan(hit_tokens), plan(cut) if 0 < cut < hit_tokens else None, lambda _: object_bytes, model)
    load = model.load_s(object_bytes * len(verdict.plan.objects)) * 1e3 if verdict.plan.objects else 0.0
    if verdict.skipped is None:
        saved = model.prefill_s(hit_tokens) * 1e3
        return hit_tokens, f"taken whole: its load ({load:.1f} ms) costs less than its prefill ({saved:.1f} ms)"
    return verdict.plan.external_tokens, f"{verdict.skipped}: {verdict.detail}"
