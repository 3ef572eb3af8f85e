"""Results as they are committed: no path of the machine that made them.

A benchmark's result keeps the command and the configuration that produced it, and both name paths: the
checkout (``/.../kvtool/cli.py``, ``/.../.venv/bin/python``), the home directory (the generated
models under ``~/.cache/kvtool``), a temporary folder (log directories). ``portable`` writes each the
way a user types it on any machine: the command as ``kvtool``, a path in the checkout relative to it
(and one beside it, as ``../shared``), the home directory as ``~``, the temporary folder as
``$TMPDIR``. Pure but for where those are.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
COMMAND_SCRIPTS = ("/kvtool/cli.py", "/bin/kvtool")  # argv[0] of `python -m kvtool.cli` and of `kvtool`


def machine_prefixes(repo: Path = REPO_ROOT) -> list[tuple[str, str]]:
    """(absolute prefix, how a user writes it), the longest first: the checkout inside a temporary
    folder or a home directory is named as the checkout, what lies beside it (the workplace's
    ``../shared``) from it."""
    repo = repo.resolve()
    home, temp = os.path.expanduser("~"), tempfile.gettempdir()
    prefixes = [(str(repo), "."), (home, "~"), (temp, "$TMPDIR")]
    if str(repo.parent) not in ("/", home, temp):
        prefixes.append((str(repo.parent), ".."))
    return sorted((pair for pair in prefixes if pair[0] not in ("", "/")), key=lambda pair: -len(pair[0]))


def portable_text(text: str, prefixes: list[tuple[str, str]]) -> str:
    if text.startswith("/") and text.endswith(COMMAND_SCRIPTS):
        return "kvtool"
    for prefix, written in prefixes:
        if written == ".":
            text = text.replace(prefix + "/", "").replace(prefix, ".")
        elif written == "..":
            text = text.replace(prefix + "/", "../")
        else:
            text = text.replace(prefix + "/", written + "/")
    return text


def portable(value: Any, repo: Path = REPO_ROOT) -> Any:
    """``value`` (JSON-like: dicts, lists, strings, numbers) with every path of this machine in its
    strings written as a user types it."""
    prefixes = machine_prefixes(repo)

    def walk(item: Any) -> Any:
        if isinstance(item, str):
            return portable_text(item, prefixes)
        if isinstance(item, dict):
            return {key: walk(inner) for key, inner in item.items()}
        if isinstance(item, list | tuple):
            return [walk(inner) for inner in item]
        return item

    return walk(value)
