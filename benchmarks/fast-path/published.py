"""What every fast-path script does with its result: names the commit it ran on, prints it, writes it."""

from __future__ import annotations

import json
import platform
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from kvtool.bench.command import provenance as measured_at  # noqa: E402 - after the path above
from kvtool.portable import portable  # noqa: E402


def git_head() -> str | None:
    """The commit a result came from, as kvtool bench names it (``+`` when tracked files were changed)."""
    return measured_at(REPO)["head"]


def provenance() -> dict[str, Any]:
    """What a result says about where it ran: the cores it may use, the Python, the commit, when."""
    measured = measured_at(REPO)
    return {
        "machine": {"cpus": measured["cpus"], "python": platform.python_version()},
        "head": measured["head"],
        "started_at": measured["started_at"],
    }


def write_result(result: dict[str, Any], out: Path | None, echo: bool = True) -> None:
    """Print ``result`` as JSON (``echo``) and write it to ``out`` when one is given."""
    text = json.dumps(portable(result), indent=2)  # no path of this machine (kvtool/portable.py)
    if echo:
        print(text)
    if out:
        out.write_text(text + "\n")
