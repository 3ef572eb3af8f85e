"""Comparing a consumer's answer with a recomputation: generated tokens and top-k logprobs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Float32 CPU kernels reordering a sum give differences around 1e-6; a wrong KV gives 1e-1 and up.
DEFAULT_LOGPROB_TOLERANCE = 1e-3


@dataclass(frozen=True)
class Comparison:
    matches: bool
    max_logprob_diff: float
    reason: str = ""


def choice_logprobs(response: dict[str, Any]) -> tuple[list[str], list[dict[str, float]]]:
    """Generated tokens and per-position top-k logprobs of a /v1/completions response (choice 0)."""
    logprobs = response["choices"][0].get("logprobs") or {}
    return list(logprobs.get("tokens") or []), [dict(top or {}) for top in logprobs.get("top_logprobs") or []]


def compare_answers(
    answer: dict[str, Any], reference: dict[str, Any], tolerance: float = DEFAULT_LOGPROB_TOLERANCE
) -> Comparison:
    """Same generated tokens, and the same top-k logprobs within ``tolerance`` at every position.

    A token may enter or leave the top-k only when its logprob is within ``tolerance`` of the k-th
    best (a tie broken differently), never otherwise.
    """
    tokens, tops = choice_logprobs(answer)
    ref_tokens, ref_tops = choice_logprobs(reference)
    if tokens != ref_tokens:
        return Comparison(False, float("inf"), f"generated tokens differ: {tokens} vs {ref_tokens}")
    if len(tops) != len(ref_tops) or not ref_tops:
        return Comparison(False, float("inf"), "top logprobs missing (request them with logprobs=k)")
    worst = 0.0
    for position, (top, ref_top) in enumerate(zip(tops, ref_tops, strict=True)):
        for token in set(top) | set(ref_top):
            if token in top and token in ref_top:
                diff = abs(top[token] - ref_top[token])
            else:
                present, other = (top, ref_top) if token in top else (ref_top, top)
                # Only a near-tie at the k-th place may swap a token in or out.
                diff = abs(present[token] - min(other.values()))
            worst = max(worst, diff)
            if diff > tolerance:
                return Comparison(False, worst, f"position {position}, token {token}: logprob differs by {diff:.3g}")
    return Comparison(True, worst)
