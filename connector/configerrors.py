"""How a bad setting is said, by the config and by each store backend's own section: one sentence
naming the field, its value and what it accepts. No imports of the connector's own."""

from __future__ import annotations

import json
from typing import Any


class ConfigError(ValueError):
    """A bad connector configuration; the message names the field, its value and what it accepts."""

    @classmethod
    def of(cls, *problems: str) -> ConfigError:
        return cls("kvtool connector config: " + "; ".join(problems))


def bad_value(field: str, value: Any, accepts: str, *, kind: str = "field") -> str:
    """One bad setting as every check says it, the value as the config's JSON writes it: ``field
    'hash_unit' is true; it should be a whole number above 0``."""
    try:
        shown = json.dumps(value)
    except (TypeError, ValueError):
        shown = repr(value)
    shown = shown if len(shown) <= 80 else shown[:77] + "..."
    return f"{kind} {field!r} is {shown}; {accepts}"
