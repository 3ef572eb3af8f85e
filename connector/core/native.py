"""Which key builder runs: the C module (``connector/core/_native.c``, built by the install where a C
compiler is at hand) or the pure-Python reference in ``hashing`` and ``prefix`` it is checked against
(``tests/unit/test_native_keys.py``: equal digests, keys and refs on random prompts).

``KEYS`` is the C module, or None where it was not built or ``KVTOOL_NATIVE_KEYS=0`` turns it off (a
benchmark's side-by-side run, an operator ruling it out). Callers read ``native.KEYS`` at each call, so
setting it to None takes effect at once. The keys are the same bytes either way: a store written by
one is read by the other.
"""

from __future__ import annotations

import os
from types import ModuleType


TURNED_OFF = os.environ.get("KVTOOL_NATIVE_KEYS", "1") == "0"


def _load() -> ModuleType | None:
    if TURNED_OFF:
        return None
    try:
        from . import _native
    except ImportError:
        return None
    return _native


KEYS: ModuleType | None = _load()


def describe() -> str:
    """One line for the log: which key builder this process runs."""
    if KEYS is not None:
        return "the C key builder"
    why = "KVTOOL_NATIVE_KEYS=0" if TURNED_OFF else "no C module built"
    return f"the pure-Python key builder ({why})"
