"""Prometheus text pages (vLLM's /metrics, the Mooncake master's /metrics): the one parser. Pure."""

from __future__ import annotations


def samples(text: str) -> dict[str, float]:
    """Every sample by its full name (a labelled one keeps its labels in the name)."""
    found: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        try:
            found[name.strip()] = float(value)
        except ValueError:
            continue
    return found


def total(text: str, name: str) -> float | None:
    """Sum of metric ``name`` over all its label sets; None when the page has no such metric."""
    result = None
    for line in text.splitlines():
        if line.startswith(name) and line[len(name) : len(name) + 1] in (" ", "{"):
            try:
                result = (result or 0.0) + float(line.rsplit(" ", 1)[1])
            except ValueError:
                continue
    return result
